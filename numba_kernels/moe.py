"""Sparse MoE on the device: top-k routing, the expert-sorted plan, grouped expert GEMMs, the combine.

The host never sees the routing, so a decode step's MoE fits in a CUDA Graph; every launch has a
fixed grid and blocks with nothing to do return at once. A "pair" is one (row, routed slot) or one
row's shared-expert use; pairs ``[0, rows * top_k)`` are the routed ones in expert order (after
``moe_plan``), pairs ``[rows * top_k, rows * top_k + rows)`` the shared expert's, one per row.

- ``moe_topk``: one warp a row. Softmax over the router logits, then ``top_k`` rounds of a warp
  argmax over the probabilities below the previous pick in the order (probability desc, id asc), so
  ties go to the lower expert id as in the reference ``route``; optional renormalisation
  (``top_k <= 32``: lane j keeps pick j). The same warp computes the shared-expert gate ``sigmoid(shared_gate . x)`` and fills the shared pairs.
  Launch: grid ``(rows,)``, block 32.
- ``moe_plan``: one block. Counts pairs per expert, scans, places each pair at its expert's range
  (``row_pair`` remembers where), and cuts every expert's range into chunks of at most ``chunk``
  pairs ``(expert, first pair, count)``; the shared expert's pairs follow as chunks of expert -1.
  Launch: grid ``(1,)``, block ``PLAN_THREADS``; ``n_experts <= MAX_EXPERTS``.
- ``moe_route``: both of the above in one block for a decode step's few rows (``rows <= ROUTE_ROWS``),
  latency first. Warp r takes row r: lane l holds the probabilities of experts ``l + 32 i`` in
  registers, computed once (the same fp32 values and sum order as ``moe_topk``); each of the
  ``top_k`` rounds is a warp argmax of the lanes' bests (two ``redux.sync`` on the fp32 bits: the
  largest probability, then the lowest id holding it), after which the winner's lane knocks it out
  and reruns its 5-deep tournament over its slots. Meanwhile every thread of the block takes 4
  elements of the shared-gate dot for all rows (warp sums, then a fixed-order sum over the warps in
  shared memory). The picks stay in shared memory for the plan: thread p places pair p after the
  pairs of lower experts and the earlier pairs of its own (a count over all picks: no counters to
  clear, no atomics), a barrier, then each expert's first pair writes its chunks; two barriers in
  all. Launch: grid ``(1,)``, block ``ROUTE_THREADS``. Built per most experts (``moe_route_e256``,
  ``moe_route_e1024``: ninfer/backends/cuda/moe.py ``route_capacity`` picks one), since a round's cost
  grows with a lane's slots.
- ``moe_{gate_up,down}_{d,p}``: the grouped GEMM, one block per (output tile, chunk), the chunk's
  expert weights streamed once for all its pairs. It is ``mma.sync`` m16n8k16 with the weights as
  the A operand (16 output features x 16 k) and up to 8 pairs' activations as B (k x 8 pairs); the
  lane's k slots are 8 contiguous k so each lane issues 16-byte loads, and each fp32 activation is
  split into ``terms`` bf16 parts, one MMA each (fp32-faithful for 3). W warps split K and meet in
  shared memory in a fixed order, so results never depend on the grid or on which pairs share a
  chunk. ``gate_up`` gathers x by the pair's row and writes ``silu(gate) * up`` (tile rows 0..7 the
  gate rows, 8..15 the matching up rows); ``down`` reads the pair's activation and writes
  ``weight * (act @ down.T)``. Named by shape (``grouped_name``); a chunk holds ``8 * P`` pairs.
  Launch: grid ``(ceil(max(n) / cols), max_chunks)``, block ``32 * warps`` (the manifest's meta).
- ``moe_{gate_up,down}_gemv_*``: the same two GEMMs for decode steps of one or two rows, in fp32 on
  the CUDA cores (``make_grouped_gemv``: a block per chunk and a few weight rows, streamed as the
  dense batch-1 GEMV); same arguments and grid shape.
- ``moe_combine``: ``y[row] = sum over slots of out[row_pair[row, slot]] + out[shared pair of row]``;
  ``moe_combine_residual`` adds that sum into ``y``. Launch: grid ``(ceil(hidden / 256), rows)``, block 256.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64, uint32
from numba.cuda import libdevice

from numba_kernels.common import (F32P, I32P, NEG_BIG, U16P, U32P, U64P, bf16_hi, bf16_lo, bf16_to_f32,
                                  grid_dependency_wait, last_to_finish, launch_dependents, load_f32x4, load_i32_l2,
                                  load_u32x2, load_u64x2, prefetch_l2, prefetch_share, warp_max, warp_max_i32,
                                  warp_min_i32, warp_sum)
from numba_kernels.gemm import (ROUTER_SHAPE, make_gemv_step, make_mma_gemv, make_weight_fragments, make_weight_row,
                                split3_bf16x2)
from numba_kernels.mma import mma_bf16_16816, split_bf16x2

MAX_EXPERTS = 1024
PLAN_THREADS = 1024
ROUTE_THREADS = 512  # moe_route needs more registers than 1024 threads may have
ROUTE_WARPS = ROUTE_THREADS // 32
ROUTE_ROWS = 8  # moe_route's most rows: decode's (GEMV_MAX_ROWS); its shared tables are sized by it
MAX_TOP_K = 32  # one lane of the row's warp per pick
# moe_route's builds: a lane holds the probabilities of experts lane + 32 i in registers, experts / 32
# of them (the Qwen3.5/3.6 MoE models have 256 experts: 8 slots a lane, a quarter of MAX_EXPERTS' 32).
ROUTE_EXPERTS = (256, MAX_EXPERTS)
SLOT_GROUP = 8  # slots moe_route loads and exponentiates without a branch (256 experts: one group)
GATE_SPAN = 4  # hidden elements a thread takes per step of moe_route's shared-gate dot (8 bytes of bf16)
KNOCKED = float32(-1.0)  # below every probability: an expert already picked
ROUTE_PICKS = ROUTE_ROWS * MAX_TOP_K  # moe_route's most routed pairs
assert ROUTE_PICKS + ROUTE_ROWS <= ROUTE_THREADS  # moe_route: a thread per pair and per shared pair
COMBINE_THREADS = 256


@cuda.jit(device=True)
def route_row(r, lane, topk_ids, topk_w, pair_row, pair_weight, logits, x, shared_gate, rows, n_experts, hidden,
              top_k, renormalise):
    """Row ``r``'s routing by one warp (``lane`` = its lane): top-k picks, weights, shared pair."""
    base = int64(r) * n_experts
    m = NEG_BIG
    for e in range(lane, n_experts, 32):
        m = max(m, logits[base + e])
    m = warp_max(m)
    s = float32(0.0)
    for e in range(lane, n_experts, 32):
        s += math.exp(logits[base + e] - m)
    s = warp_sum(s)
    prev_p = float32(3.0e38)
    prev_e = int32(-1)
    total = float32(0.0)
    mine_p = float32(0.0)  # lane j keeps pick j: no lane reads another's global writes
    mine_e = int32(0)
    for slot in range(top_k):
        best_p = float32(-1.0)
        best_e = int32(n_experts)
        for e in range(lane, n_experts, 32):
            p = math.exp(logits[base + e] - m) / s
            below = p < prev_p or (p == prev_p and e > prev_e)
            if below and (p > best_p or (p == best_p and e < best_e)):
                best_p = p
                best_e = e
        for offset in (16, 8, 4, 2, 1):
            other_p = cuda.shfl_xor_sync(0xFFFFFFFF, best_p, offset)
            other_e = cuda.shfl_xor_sync(0xFFFFFFFF, best_e, offset)
            if other_p > best_p or (other_p == best_p and other_e < best_e):
                best_p = other_p
                best_e = other_e
        if lane == slot:
            mine_p = best_p
            mine_e = best_e
        total += best_p
        prev_p = best_p
        prev_e = best_e
    if lane < top_k:
        topk_ids[r * top_k + lane] = mine_e
        topk_w[r * top_k + lane] = mine_p / total if renormalise != 0 else mine_p
    dot = float32(0.0)
    row = int64(r) * hidden
    for h in range(lane, hidden, 32):
        dot += x[row + h] * bf16_to_f32(shared_gate[h])
    dot = warp_sum(dot)
    if lane == 0:
        pair = rows * top_k + r
        pair_row[pair] = r
        pair_weight[pair] = float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * dot)


def moe_topk(topk_ids, topk_w, pair_row, pair_weight, logits, x, shared_gate, rows, n_experts, hidden, top_k,
             renormalise):
    launch_dependents()  # programmatic dependent launch: common.py
    grid_dependency_wait()
    route_row(cuda.blockIdx.x, cuda.threadIdx.x, topk_ids, topk_w, pair_row, pair_weight, logits, x, shared_gate,
              rows, n_experts, hidden, top_k, renormalise)


@cuda.jit(device=True)
def plan_pairs(counts, fill, starts, chunk_starts, routed_chunks, chunks, n_chunks, pair_row, pair_weight, row_pair,
               topk_ids, topk_w, rows, top_k, n_experts, chunk):
    """The whole block sorts the pairs by expert and writes the chunks (shared tables given)."""
    tid = cuda.threadIdx.x
    threads = cuda.blockDim.x
    pairs = rows * top_k
    for e in range(tid, n_experts, threads):
        counts[e] = 0
        fill[e] = 0
    cuda.syncthreads()
    for p in range(tid, pairs, threads):
        cuda.atomic.add(counts, topk_ids[p], 1)
    cuda.syncthreads()
    if tid < 32:  # one warp scans: each lane a contiguous run of experts, then a shuffle scan
        per = (n_experts + 31) // 32
        lo = tid * per
        hi = min(lo + per, n_experts)
        own_pairs = 0
        own_chunks = 0
        for e in range(lo, hi):
            own_pairs += counts[e]
            own_chunks += (counts[e] + chunk - 1) // chunk
        inc_pairs = own_pairs
        inc_chunks = own_chunks
        for offset in (1, 2, 4, 8, 16):
            up_pairs = cuda.shfl_up_sync(0xFFFFFFFF, inc_pairs, offset)
            up_chunks = cuda.shfl_up_sync(0xFFFFFFFF, inc_chunks, offset)
            if tid >= offset:
                inc_pairs += up_pairs
                inc_chunks += up_chunks
        at_pair = inc_pairs - own_pairs
        at_chunk = inc_chunks - own_chunks
        for e in range(lo, hi):
            starts[e] = at_pair
            chunk_starts[e] = at_chunk
            at_pair += counts[e]
            at_chunk += (counts[e] + chunk - 1) // chunk
        if tid == 31:
            routed_chunks[0] = inc_chunks
    cuda.syncthreads()
    for p in range(tid, pairs, threads):
        e = topk_ids[p]
        at = starts[e] + cuda.atomic.add(fill, e, 1)
        pair_row[at] = p // top_k
        pair_weight[at] = topk_w[p]
        row_pair[p] = at
    for e in range(tid, n_experts, threads):
        q = chunk_starts[e]
        for first in range(0, counts[e], chunk):
            chunks[3 * q] = e
            chunks[3 * q + 1] = starts[e] + first
            chunks[3 * q + 2] = min(chunk, counts[e] - first)
            q += 1
    routed = routed_chunks[0]
    shared = (rows + chunk - 1) // chunk
    for i in range(tid, shared, threads):
        q = routed + i
        chunks[3 * q] = -1
        chunks[3 * q + 1] = pairs + i * chunk
        chunks[3 * q + 2] = min(chunk, rows - i * chunk)
    if tid == 0:
        n_chunks[0] = routed + shared


def moe_plan(chunks, n_chunks, pair_row, pair_weight, row_pair, topk_ids, topk_w, rows, top_k, n_experts, chunk):
    launch_dependents()  # programmatic dependent launch: common.py
    grid_dependency_wait()
    counts = cuda.shared.array(MAX_EXPERTS, int32)
    fill = cuda.shared.array(MAX_EXPERTS, int32)
    starts = cuda.shared.array(MAX_EXPERTS, int32)
    chunk_starts = cuda.shared.array(MAX_EXPERTS, int32)
    routed_chunks = cuda.shared.array(1, int32)
    plan_pairs(counts, fill, starts, chunk_starts, routed_chunks, chunks, n_chunks, pair_row, pair_weight, row_pair,
               topk_ids, topk_w, rows, top_k, n_experts, chunk)


# -- moe_route: decode routing and plan in one block -------------------------------------------------

def make_row_picks(experts: int):
    """A warp's routing of one row over at most ``experts`` experts (a multiple of 32, at most
    MAX_EXPERTS): (load_logits, softmax_slots, pick_rounds, pick_row), each lane holding ``experts // 32``
    slots. The slot count is fixed at build time because a pick round's cost is linear in it: the lane that
    loses its best reruns a tournament over all its slots, and 256 experts need 8, not MAX_EXPERTS' 32."""
    slots = experts // 32
    group = min(SLOT_GROUP, slots)
    groups = slots // group
    tournament = 2 * slots  # nodes of a lane's tournament over its slots, in heap order (node 0 unused)
    assert slots * 32 == experts and slots & (slots - 1) == 0 and experts <= MAX_EXPERTS

    @cuda.jit(device=True)
    def load_logits(probs, logits, r, lane, n_experts):
        """Row ``r``'s logits into the lane's slots (slot i: expert ``lane + 32 i``; absent ones NEG_BIG).
        A group of SLOT_GROUP slots loads with no branch (absent experts read a clamped, valid address),
        so its loads are all in flight at once; a group wholly past the experts is skipped."""
        base = int64(r) * n_experts
        for i in range(slots):  # constant bounds, fully unrolled: the slots stay in registers
            probs[i] = NEG_BIG
        for g in range(groups):
            if 32 * group * g < n_experts:
                for j in range(group):
                    i = group * g + j
                    e = lane + 32 * i
                    v = logits[base + min(e, n_experts - 1)]
                    probs[i] = v if e < n_experts else NEG_BIG

    @cuda.jit(device=True)
    def softmax_slots(probs, lane, n_experts):
        """The slots' logits become ``exp(logit - max) / sum`` in place, the same fp32 values as
        ``route_row`` (each lane sums its experts in id order, then the warp). Absent experts of a live
        group get 0: it never changes the sum, and on a tie they lose to every real expert (their ids are
        higher), so they need no mark; a group wholly past the experts is skipped and keeps NEG_BIG.
        A group's exps and divisions have no branch between them, so they overlap."""
        m = NEG_BIG
        for i in range(slots):
            m = max(m, probs[i])
        m = warp_max(m)
        s = float32(0.0)
        for g in range(groups):
            if 32 * group * g < n_experts:
                for j in range(group):
                    i = group * g + j
                    v = math.exp(probs[i] - m)
                    probs[i] = v if lane + 32 * i < n_experts else float32(0.0)
                    s += probs[i]
        s = warp_sum(s)
        for g in range(groups):
            if 32 * group * g < n_experts:
                for j in range(group):
                    i = group * g + j
                    probs[i] = probs[i] / s

    @cuda.jit(device=True)
    def lane_best(probs, lane):
        """The lane's most probable expert left, ties to the lower id: a tournament in heap order (node k
        the winner of 2k and 2k + 1, leaves ``slots + i`` the slots), log2(slots) rounds deep instead of
        a chain of compares. Node 2k's leaves hold lower ids than 2k + 1's, so a strict ``>`` keeps a tie
        on the lower id."""
        p = cuda.local.array(tournament, float32)
        at = cuda.local.array(tournament, int32)
        for i in range(slots):
            p[slots + i] = probs[i]
            at[slots + i] = i
        for k in range(slots - 1, 0, -1):  # constant bounds, fully unrolled: registers
            right = p[2 * k + 1] > p[2 * k]
            p[k] = p[2 * k + 1] if right else p[2 * k]
            at[k] = at[2 * k + 1] if right else at[2 * k]
        return p[1], int32(lane + 32 * at[1])

    @cuda.jit(device=True)
    def knock_out(probs, slot):
        """Drop a picked expert: its slot falls below every probability."""
        for i in range(slots):  # a select each: conditional stores fold back into probs[slot] (local memory)
            probs[i] = KNOCKED if i == slot else probs[i]

    @cuda.jit(device=True)
    def pick_rounds(probs, lane, top_k):
        """The row's ``top_k`` picks from the warp's probabilities: each round the warp argmax of the
        lanes' bests, then the owner knocks its winner out and finds its next best. Returns lane j's
        pick j (probability, expert; zeros past top_k) and the picks' sum, in pick order as
        ``route_row`` sums."""
        best_p, best_e = lane_best(probs, lane)
        total = float32(0.0)
        mine_p = float32(0.0)
        mine_e = int32(0)
        for slot in range(top_k):
            p, e = warp_argmax(best_p, best_e)
            if lane == slot:
                mine_p = p
                mine_e = e
            total += p
            if (e & 31) == lane:
                knock_out(probs, e >> 5)
                best_p, best_e = lane_best(probs, lane)
        return mine_p, mine_e, total

    @cuda.jit(device=True)
    def pick_row(probs, r, lane, top_k, renormalise, topk_ids, topk_w, pick_ids, pick_w):
        """Row ``r``'s picks (``pick_rounds``): lane j writes pick j to global memory (the result) and
        to shared memory (the plan's input)."""
        mine_p, mine_e, total = pick_rounds(probs, lane, top_k)
        if lane < top_k:
            at = r * top_k + lane
            w = mine_p / total if renormalise != 0 else mine_p
            topk_ids[at] = mine_e
            topk_w[at] = w
            pick_ids[at] = mine_e
            pick_w[at] = w

    return load_logits, softmax_slots, pick_rounds, pick_row


@cuda.jit(device=True)
def warp_argmax(p, e):
    """The warp's largest ``p``, ties to the lowest ``e``. For p >= 0 the fp32 bit patterns order as
    signed integers do, and KNOCKED's and NEG_BIG's are negative, so two integer warp reductions
    decide it."""
    bits = libdevice.float_as_int(p)
    top = warp_max_i32(bits)
    winner = warp_min_i32(e if bits == top else int32(0x7FFFFFFF))
    return libdevice.int_as_float(top), winner


@cuda.jit(device=True)
def first_gate_words(shared_gate, hidden):
    """The thread's first 4 shared-gate weights (``gate_partials``' first step): weights, so a kernel
    loads them before its grid wait."""
    h = GATE_SPAN * cuda.threadIdx.x
    if h < hidden:
        return load_u32x2(shared_gate, h)  # h % 4 == 0: 8-byte aligned
    return uint32(0), uint32(0)


@cuda.jit(device=True)
def gate_partials(part, x, shared_gate, rows, hidden, w01, w23):
    """This thread's share of every row's ``shared_gate . x``: 4 elements a step over the whole
    block, the gate's 4 read once for all rows (``w01, w23``: the first step's, ``first_gate_words``).
    Every row's load goes out before the first use; rows past ``rows`` reread the last row (no
    branch, a valid address) and their sums go unused."""
    xs = cuda.local.array((ROUTE_ROWS, GATE_SPAN), float32)
    for r in range(ROUTE_ROWS):
        part[r] = float32(0.0)
    h = GATE_SPAN * cuda.threadIdx.x
    while h < hidden:  # not a stepped range: its trip count costs a 64-bit division before the loads
        if h != GATE_SPAN * cuda.threadIdx.x:  # the first step's are in hand
            w01, w23 = load_u32x2(shared_gate, h)
        for r in range(ROUTE_ROWS):  # hidden % 8 == 0: 16-byte aligned
            xs[r, 0], xs[r, 1], xs[r, 2], xs[r, 3] = load_f32x4(x, int64(min(r, rows - 1)) * hidden + h)
        g0, g1, g2, g3 = bf16_lo(w01), bf16_hi(w01), bf16_lo(w23), bf16_hi(w23)
        for r in range(ROUTE_ROWS):
            part[r] += xs[r, 0] * g0 + xs[r, 1] * g1 + xs[r, 2] * g2 + xs[r, 3] * g3
        h += GATE_SPAN * cuda.blockDim.x


@cuda.jit(device=True)
def store_gate_partials(gate_red, part, warp, lane):
    """The warp's sums of the thread shares into ``gate_red[warp]``: all rows' shuffle chains first,
    with no branch between them, so they interleave."""
    for r in range(ROUTE_ROWS):
        part[r] = warp_sum(part[r])
    if lane == 0:
        for r in range(ROUTE_ROWS):
            gate_red[warp, r] = part[r]


@cuda.jit(device=True)
def shared_pair(gate_red, pair_row, pair_weight, r, rows, top_k):
    """Row ``r``'s shared-expert pair, weighted ``sigmoid(shared_gate . x)`` (warp sums in warp order)."""
    dot = float32(0.0)
    for w in range(cuda.blockDim.x >> 5):
        dot += gate_red[w, r]
    pair = rows * top_k + r
    pair_row[pair] = r
    pair_weight[pair] = float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * dot)


@cuda.jit(device=True)
def place_pair(p, pick_ids, pick_w, first_chunks, pair_row, pair_weight, row_pair, pairs, top_k, chunk):
    """Pair ``p``'s place in expert order, from all picks in shared memory: after every pair of a lower
    expert and every earlier pair of its own (no counters to clear, no atomics, a deterministic
    order). The expert's first pair records its chunk count in ``first_chunks``; the rest record 0.
    Returns (expert, its first place, its pair count, whether ``p`` is its first pair)."""
    mine = pick_ids[p]
    lower = 0
    count = 0
    earlier = 0
    for q in range(pairs):
        e = pick_ids[q]
        if e < mine:
            lower += 1
        elif e == mine:
            count += 1
            if q < p:
                earlier += 1
    at = lower + earlier
    pair_row[at] = p // top_k
    pair_weight[at] = pick_w[p]
    row_pair[p] = at
    first_chunks[p] = (count + chunk - 1) // chunk if earlier == 0 else 0
    return mine, lower, count, earlier == 0


@cuda.jit(device=True)
def expert_chunks(chunks, q, expert, start, count, chunk):
    """Cut an expert's ``count`` pairs from ``start`` into chunks ``q, q + 1, ...`` of at most ``chunk``."""
    for first in range(0, count, chunk):
        chunks[3 * q] = expert
        chunks[3 * q + 1] = start + first
        chunks[3 * q + 2] = min(chunk, count - first)
        q += 1


@cuda.jit(device=True)
def write_chunks(p, mine, lower, count, first, pick_ids, first_chunks, chunks, n_chunks, pairs, rows, chunk):
    """Pair ``p``'s part of the chunk list: its expert's chunks if it is the expert's first pair (they
    follow the chunks of every lower expert), shared chunk ``p`` after all routed ones, the count."""
    below = 0
    routed = 0
    for q in range(pairs):
        c = first_chunks[q]
        routed += c
        if pick_ids[q] < mine:
            below += c
    if first:
        expert_chunks(chunks, below, mine, lower, count, chunk)
    shared = (rows + chunk - 1) // chunk  # <= rows <= pairs: threads p < pairs cover them
    if p < shared:
        expert_chunks(chunks, routed + p, -1, pairs + p * chunk, min(chunk, rows - p * chunk), chunk)
    if p == 0:
        n_chunks[0] = routed + shared


def make_route_block(experts: int):
    """``moe_route``'s work for at most ``experts`` experts (``make_row_picks``), by one block of
    ``ROUTE_THREADS``."""
    load_logits, softmax_slots, _, pick_row = make_row_picks(experts)
    slots = experts // 32

    @cuda.jit(device=True, inline=True)
    def route_block(chunks, n_chunks, pair_row, pair_weight, row_pair, topk_ids, topk_w, logits, x, shared_gate, rows,
                    n_experts, hidden, top_k, renormalise, chunk, w01, w23):
        """``w01, w23``: the thread's ``first_gate_words``."""
        gate_red = cuda.shared.array((ROUTE_WARPS, ROUTE_ROWS), float32)
        pick_ids = cuda.shared.array(ROUTE_PICKS, int32)
        pick_w = cuda.shared.array(ROUTE_PICKS, float32)
        first_chunks = cuda.shared.array(ROUTE_PICKS, int32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        probs = cuda.local.array(slots, float32)
        if warp < rows:  # warp r routes row r; its logit loads are in flight during the gate's
            load_logits(probs, logits, warp, lane, n_experts)
        part = cuda.local.array(ROUTE_ROWS, float32)
        gate_partials(part, x, shared_gate, rows, hidden, w01, w23)
        store_gate_partials(gate_red, part, warp, lane)
        if warp < rows:
            softmax_slots(probs, lane, n_experts)
            pick_row(probs, warp, lane, top_k, renormalise, topk_ids, topk_w, pick_ids, pick_w)
        cuda.syncthreads()  # picks and gate sums visible to the block
        pairs = rows * top_k
        mine, lower, count, first = int32(0), 0, 0, False  # what pair tid's thread keeps across the barrier
        if tid < pairs:  # thread p places pair p (pairs <= ROUTE_PICKS < the block)
            mine, lower, count, first = place_pair(tid, pick_ids, pick_w, first_chunks, pair_row, pair_weight,
                                                   row_pair, pairs, top_k, chunk)
        elif tid < pairs + rows:  # the next rows threads: one shared pair each
            shared_pair(gate_red, pair_row, pair_weight, tid - pairs, rows, top_k)
        cuda.syncthreads()  # every expert's chunk count visible
        if tid < pairs:
            write_chunks(tid, mine, lower, count, first, pick_ids, first_chunks, chunks, n_chunks, pairs, rows, chunk)

    return route_block


def make_route(experts: int):
    """``moe_route_e{experts}``: ``moe_topk`` and ``moe_plan`` in one block (decode: ``rows <=
    ROUTE_ROWS``, one launch) for at most ``experts`` experts."""
    route_block = make_route_block(experts)

    def moe_route(chunks, n_chunks, pair_row, pair_weight, row_pair, topk_ids, topk_w, logits, x, shared_gate, rows,
                  n_experts, hidden, top_k, renormalise, chunk):
        w01, w23 = first_gate_words(shared_gate, hidden)  # weights: before the wait
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
        route_block(chunks, n_chunks, pair_row, pair_weight, row_pair, topk_ids, topk_w, logits, x, shared_gate,
                    rows, n_experts, hidden, top_k, renormalise, chunk, w01, w23)

    return moe_route


def make_router_route(experts: int):
    """``moe_router_route``: the normalising router GEMM (numba_kernels/gemm.py's
    ``mma_gemv_normed_keep_store`` of ROUTER_SHAPE, a block per 16 experts) with ``moe_route`` folded
    in. Each block writes its logits and its share of the normalised rows, then takes a ticket
    (``ticket[0]``, zero between launches; the last block resets it); the last block to finish routes
    for every row, as ``moe_route``'s one block does: one launch a decode MoE layer fewer. The router's
    weights are loaded before the grid wait (``make_mma_gemv``'s ``early``, as CudaMoe.early_router's)."""
    T, W, U, TERMS = ROUTER_SHAPE
    assert 32 * W == ROUTE_THREADS  # the GEMM's block routes
    route_block = make_route_block(experts)
    router = cuda.jit(device=True, inline=True)(make_mma_gemv(True, "store", T, W, U, TERMS, keep=True, early=True))

    def moe_router_route(logits, x, router_w, norm_w, rows, n_experts, hidden, eps, normed, chunks, n_chunks,
                         pair_row, pair_weight, row_pair, topk_ids, topk_w, shared_gate, top_k, renormalise, chunk,
                         ticket):
        router(logits, x, router_w, norm_w, rows, n_experts, hidden, n_experts, eps, normed)
        if last_to_finish(ticket, 0, cuda.gridDim.x):  # every block's logits and normalised columns are out
            w01, w23 = first_gate_words(shared_gate, hidden)
            route_block(chunks, n_chunks, pair_row, pair_weight, row_pair, topk_ids, topk_w, logits, normed, shared_gate,
                        rows, n_experts, hidden, top_k, renormalise, chunk, w01, w23)

    return moe_router_route


def make_grouped(kind: str, T: int, W: int, U: int, P: int, TERMS: int, hold: bool = False, early: bool = False):
    """Grouped GEMM over chunks: T tiles of 16 weight rows, W warps on K, U k-steps in flight, P x 8 pairs.

    ``kind``: "gate_up", "down", or "router": one dense matrix (``w_shared``, n = ``n_shared``, k =
    ``k_shared``) over rows ``[0, n_routed)`` in chunks of 8 P by block, no plan, no pair weights;
    or "down_combine": "down" with ``moe_combine_residual`` folded in (five more arguments
    ``residual, row_pair, rows, top_k, tickets``): each block of a column tile takes a ticket
    (``tickets[tile]``, zero between launches) once its outputs are out, and the tile's last block
    adds every row's pairs, in slot order and then the shared pair, into ``residual`` there.

    ``hold`` (name suffix ``h``): each round's first MMA waits for every weight and activation word of
    the round (``make_mma_gemv``'s waits for the weights): ptxas otherwise issues three of a round's
    loads, MMAs on them, then the rest.

    ``early`` (name suffix ``e``, decode; named in CudaMoe.decode_gemms): a gate_up block issues
    ``launch_dependents`` after its grid wait, not before, so the down GEMM after it starts only once the
    routing has finished; a down block then reads its chunk from the plan and loads its first round of
    weights before its own wait (``load_i32_l2``: common.py's PDL rules), in gate/up's tail."""
    assert not early or kind in ("gate_up", "down")
    COMBINE = kind == "down_combine"
    TRIGGER_LATE = early and kind == "gate_up"
    LOAD_EARLY = early and kind == "down"
    swiglu = kind == "gate_up"
    DENSE = kind == "router"
    THREADS = 32 * W
    COLS = 8 if swiglu else 16  # output columns per 16-row tile
    PAIRS = 8 * P
    OUTS = T * COLS * PAIRS
    MATRICES = 2 if swiglu else 1  # gate_up holds 2n rows per expert
    load_weights = make_weight_fragments(T, load_u64x2)
    plan_entry = load_i32_l2 if LOAD_EARLY else plain_entry  # the plan before the wait: from L2

    @cuda.jit(device=True, inline=True)
    def grouped_block(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared,
                      k_routed, k_shared, ldy, ldx):
        """The block's (chunk, column tile); False if it has none (past the chunks or the columns)."""
        if TRIGGER_LATE:  # programmatic dependent launch: common.py
            grid_dependency_wait()
            launch_dependents()
        elif not LOAD_EARLY:
            launch_dependents()
            grid_dependency_wait()
        ci = cuda.blockIdx.y
        if DENSE:
            expert = -1
            start = ci * PAIRS
            count = min(PAIRS, n_routed - start)
        else:
            if ci >= plan_entry(n_chunks, 0):
                if LOAD_EARLY:
                    grid_dependency_wait()  # before any return: common.py
                return False
            expert = plan_entry(chunks, 3 * ci)
            start = plan_entry(chunks, 3 * ci + 1)
            count = plan_entry(chunks, 3 * ci + 2)
        if expert >= 0:
            n = n_routed
            k = k_routed
            w = w_experts
            w_base = int64(expert) * MATRICES * n * k
        else:
            n = n_shared
            k = k_shared
            w = w_shared
            w_base = int64(0)
        col_base = cuda.blockIdx.x * T * COLS
        if col_base >= n:
            if LOAD_EARLY:
                grid_dependency_wait()
            return False
        red = cuda.shared.array((W, T, P, 16, 8), float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        row_at = cuda.local.array((T, 2), int64)  # element offset of the lane's weight rows, -1 past n
        for tt in range(T):
            for h in range(2):
                if swiglu:
                    j = col_base + tt * 8 + g
                    row_at[tt, h] = w_base + (int64(j) + h * int64(n)) * k if j < n else int64(-1)
                else:
                    f = col_base + tt * 16 + g + 8 * h
                    row_at[tt, h] = w_base + int64(f) * k if f < n else int64(-1)
        wr = cuda.local.array((U, T, 2, 4), uint32)
        if LOAD_EARLY:  # the first round's weights in flight while the gate/up GEMM finishes
            for u in range(U):
                load_weights(w, row_at, k, (warp + u * W) * 32 + 8 * t, u, wr)
            launch_dependents()
            grid_dependency_wait()
        x_at = cuda.local.array(P, int64)  # element offset of the lane's pairs' activations, -1 past count
        for pp in range(P):
            q = g + 8 * pp
            if q < count:
                src = pair_row[start + q] if swiglu else start + q
                x_at[pp] = int64(src) * ldx
            else:
                x_at[pp] = int64(-1)
        acc = cuda.local.array((T, P, 4), float32)
        for tt in range(T):
            for pp in range(P):
                for e in range(4):
                    acc[tt, pp, e] = float32(0.0)
        xr = cuda.local.array((U, P, 8), float32)
        steps = (k + 31) >> 5
        for s0 in range(warp, steps, W * U):
            for u in range(U):  # every load of U steps before the first MMA
                kk = (s0 + u * W) * 32 + 8 * t
                inside = kk < k
                if not LOAD_EARLY or s0 != warp:  # the first round's are in flight already
                    load_weights(w, row_at, k, kk, u, wr)
                for pp in range(P):
                    if inside and x_at[pp] >= 0:
                        x0, x1, x2, x3 = load_f32x4(x, x_at[pp] + kk)
                        x4, x5, x6, x7 = load_f32x4(x, x_at[pp] + kk + 4)
                        xr[u, pp, 0], xr[u, pp, 1], xr[u, pp, 2], xr[u, pp, 3] = x0, x1, x2, x3
                        xr[u, pp, 4], xr[u, pp, 5], xr[u, pp, 6], xr[u, pp, 7] = x4, x5, x6, x7
                    else:
                        for e in range(8):
                            xr[u, pp, e] = float32(0.0)
            if hold:  # + 0.0 (n_routed >= 0) that depends on every weight and activation word of the round
                dep = int32(0)
                for u in range(U):
                    for tt in range(T):
                        for h in range(2):
                            for e in range(4):
                                dep ^= int32(wr[u, tt, h, e])
                    for pp in range(P):
                        for e in range(8):
                            dep ^= libdevice.float_as_int(xr[u, pp, e])
                acc[0, 0, 0] += libdevice.int_as_float(dep & (int32(n_routed) >> int32(31)))
            for u in range(U):
                for half in range(2):  # k = 8t+0..3, then 8t+4..7
                    e = 4 * half
                    for pp in range(P):
                        if TERMS == 3:
                            p0, q0, r0 = split3_bf16x2(xr[u, pp, e], xr[u, pp, e + 1])
                            p1, q1, r1 = split3_bf16x2(xr[u, pp, e + 2], xr[u, pp, e + 3])
                        else:
                            p0, q0 = split_bf16x2(xr[u, pp, e], xr[u, pp, e + 1])
                            p1, q1 = split_bf16x2(xr[u, pp, e + 2], xr[u, pp, e + 3])
                        for tt in range(T):
                            a0 = wr[u, tt, 0, 2 * half]
                            a1 = wr[u, tt, 1, 2 * half]
                            a2 = wr[u, tt, 0, 2 * half + 1]
                            a3 = wr[u, tt, 1, 2 * half + 1]
                            c0, c1, c2, c3 = acc[tt, pp, 0], acc[tt, pp, 1], acc[tt, pp, 2], acc[tt, pp, 3]
                            if TERMS == 3:  # smallest part first
                                c0, c1, c2, c3 = mma_bf16_16816(a0, a1, a2, a3, r0, r1, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma_bf16_16816(a0, a1, a2, a3, q0, q1, c0, c1, c2, c3)
                            c0, c1, c2, c3 = mma_bf16_16816(a0, a1, a2, a3, p0, p1, c0, c1, c2, c3)
                            acc[tt, pp, 0], acc[tt, pp, 1], acc[tt, pp, 2], acc[tt, pp, 3] = c0, c1, c2, c3
        for tt in range(T):
            for pp in range(P):
                red[warp, tt, pp, g, 2 * t] = acc[tt, pp, 0]
                red[warp, tt, pp, g, 2 * t + 1] = acc[tt, pp, 1]
                red[warp, tt, pp, g + 8, 2 * t] = acc[tt, pp, 2]
                red[warp, tt, pp, g + 8, 2 * t + 1] = acc[tt, pp, 3]
        cuda.syncthreads()
        for idx in range(tid, OUTS, THREADS):  # consecutive threads: consecutive columns of one pair
            q = idx // (T * COLS)
            col = idx % (T * COLS)
            tt = col // COLS
            i = col % COLS
            out_col = col_base + col
            if q < count and out_col < n:
                pp = q >> 3
                c = q & 7
                v = float32(0.0)
                for wp in range(W):
                    v += red[wp, tt, pp, i, c]
                pair = start + q
                at = int64(pair) * ldy + out_col
                if swiglu:
                    up = float32(0.0)
                    for wp in range(W):
                        up += red[wp, tt, pp, i + 8, c]
                    y[at] = v * (float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * v)) * up
                elif DENSE:
                    y[at] = v
                else:
                    y[at] = pair_weight[pair] * v
        return True

    if not COMBINE:
        def grouped(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared,
                    k_routed, k_shared, ldy, ldx):
            grouped_block(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared,
                          k_routed, k_shared, ldy, ldx)

        return grouped

    def grouped_combine(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared,
                        k_routed, k_shared, ldy, ldx, residual, row_pair, rows, top_k, tickets):
        if not grouped_block(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared,
                             k_routed, k_shared, ldy, ldx):
            return  # no ticket: the tile counts the blocks of the step's chunks
        tile = cuda.blockIdx.x
        if not last_to_finish(tickets, tile, n_chunks[0]):  # the tile's pairs are all out after this
            return
        width = T * COLS
        for idx in range(cuda.threadIdx.x, rows * width, THREADS):  # moe_combine_residual's sums, this tile
            r = idx // width
            h = tile * width + idx % width
            if h < n_shared:
                total = float32(0.0)
                for slot in range(top_k):
                    total += y[int64(row_pair[r * top_k + slot]) * ldy + h]
                total += y[int64(rows * top_k + r) * ldy + h]
                residual[int64(r) * ldy + h] += total

    return grouped_combine


def make_combine(residual: bool):
    """``moe_combine`` (y = the row's sum) or, with ``residual``, ``moe_combine_residual`` (y += it:
    the decode step adds the MoE straight into the residual stream, no launch of its own for the add)."""

    def moe_combine(y, out, row_pair, rows, top_k, hidden):
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
        r = cuda.blockIdx.y
        h = cuda.blockIdx.x * COMBINE_THREADS + cuda.threadIdx.x
        if h >= hidden:
            return
        total = float32(0.0)
        for slot in range(top_k):
            total += out[int64(row_pair[r * top_k + slot]) * hidden + h]
        total += out[int64(rows * top_k + r) * hidden + h]
        if residual:
            y[int64(r) * hidden + h] += total
        else:
            y[int64(r) * hidden + h] = total

    return moe_combine


def make_gemv_chunk(kind: str, M: int, COLS: int, THREADS: int):
    """(weight_rows, load_step, stream_steps, finish_chunk, gemv_chunk): the ``COLS`` weight rows of a
    grouped GEMV's column tile and the work on one chunk once the first step of weights is in ``raw``
    (``load_step`` at step ``t``, the thread's place among the chunk's ``THREADS``). ``stream_steps``:
    every step against the chunk's activation rows ``x_at`` (element offsets, -1 past the chunk; the next
    step's weights loaded as soon as a step's are used) into the thread's ``acc``; ``finish_chunk``: the
    warps' sums of ``acc`` in a fixed order, then column tile ``tile``'s epilogue into pair rows
    ``start ..`` of y; ``gemv_chunk``: both, for the block's own tile."""
    SWIGLU = kind == "gate_up"
    OUT = COLS // 2 if SWIGLU else COLS
    WARPS = THREADS // 32
    weight_rows, load_step, accumulate = make_gemv_step(M, COLS, SWIGLU)

    @cuda.jit(device=True, inline=True)
    def stream_steps(acc, x, w, row_of, raw, x_at, k, t):
        steps = k >> 3  # 16-byte steps of a weight row: 8 bf16 weights, 8 fp32 activations
        words = k >> 2
        for q in range(M):
            for c in range(COLS):
                acc[q, c] = float32(0.0)
        xr = cuda.local.array((M, 8), float32)
        for j in range(t, steps, THREADS):
            for q in range(M):  # the step's activations first, their loads out together
                if x_at[q] >= 0:
                    xr[q, 0], xr[q, 1], xr[q, 2], xr[q, 3] = load_f32x4(x, x_at[q] + 8 * j)
                    xr[q, 4], xr[q, 5], xr[q, 6], xr[q, 7] = load_f32x4(x, x_at[q] + 8 * j + 4)
                else:
                    for e in range(8):
                        xr[q, e] = float32(0.0)
            accumulate(acc, raw, xr)
            load_step(w, row_of, words, steps, j + THREADS, raw)  # the registers are free again

    @cuda.jit(device=True, inline=True)
    def finish_chunk(acc, y, n, start, count, pair_weight, ldy, tile):
        tid = cuda.threadIdx.x
        red = cuda.shared.array((WARPS, M, COLS), float32)
        warp = tid >> 5
        for q in range(M):
            for c in range(COLS):
                red[warp, q, c] = warp_sum(acc[q, c])
        cuda.syncthreads()
        if tid < M * OUT:
            q = tid // OUT
            c = tid % OUT
            col = tile * OUT + c
            if q < count and col < n:
                total = float32(0.0)
                for wp in range(WARPS):
                    total += red[wp, q, c]
                at = int64(start + q) * ldy + col
                if SWIGLU:
                    up = float32(0.0)
                    for wp in range(WARPS):
                        up += red[wp, q, c + OUT]
                    y[at] = total * (float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * total)) * up
                else:
                    y[at] = pair_weight[start + q] * total

    @cuda.jit(device=True, inline=True)
    def gemv_chunk(y, x, w, row_of, raw, x_at, n, k, start, count, pair_weight, ldy):
        acc = cuda.local.array((M, COLS), float32)
        stream_steps(acc, x, w, row_of, raw, x_at, k, cuda.threadIdx.x)
        finish_chunk(acc, y, n, start, count, pair_weight, ldy, cuda.blockIdx.x)

    return weight_rows, load_step, stream_steps, finish_chunk, gemv_chunk


def make_grouped_gemv(kind: str, M: int, COLS: int, THREADS: int, SHARED_EARLY: bool = False):
    """The grouped GEMM of a decode step of at most ``M`` rows in fp32 on the CUDA cores, as the dense
    batch-1 GEMV (``gemm.py`` ``make_gemv``) streams: one block per (chunk, ``COLS`` weight rows), its
    ``THREADS`` threads walking K together in 16-byte steps (``make_gemv_chunk``). A chunk holds at
    most M pairs (a decode chunk holds its expert's rows, so at most ``rows``). Same arguments and
    outputs as ``make_grouped``'s kernel of ``kind`` ("gate_up": the block's first COLS / 2 rows are
    gate rows, the rest the matching up rows; "down": scaled by the pair weight); the sums run in
    another order, so it agrees with the MMA build to fp32 rounding.

    ``SHARED_EARLY`` (``M == 1``, name suffix ``s``): a one-row step's plan has ``top_k`` routed chunks
    and then the shared expert's, the grid's last row of blocks, so those blocks load their first
    step of the shared expert's weights before the grid wait (the weights of a routed expert wait
    for the routing); after it the plan is read as ever, and a block whose chunk turns out not to be
    the shared one loads again."""
    assert not SHARED_EARLY or M == 1
    SWIGLU = kind == "gate_up"
    assert kind in ("gate_up", "down") and THREADS % 32 == 0 and (COLS % 2 == 0 or not SWIGLU)
    OUT = COLS // 2 if SWIGLU else COLS
    MATRICES = 2 if SWIGLU else 1
    weight_rows, load_step, _, _, gemv_chunk = make_gemv_chunk(kind, M, COLS, THREADS)

    def grouped_gemv(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared,
                     k_routed, k_shared, ldy, ldx):
        tid = cuda.threadIdx.x
        row_of = cuda.local.array(COLS, int64)  # the block's weight rows (-1: past the matrix)
        raw = cuda.local.array((COLS, 4), uint32)
        guessed = SHARED_EARLY and cuda.blockIdx.y == cuda.gridDim.y - 1
        if guessed:  # the shared expert's chunk in a one-row step: its weights need no routing
            weight_rows(row_of, n_shared, int64(0), cuda.blockIdx.x)
            load_step(w_shared, row_of, k_shared >> 2, k_shared >> 3, tid, raw)
        launch_dependents()  # programmatic dependent launch: common.py (the routed weights wait for the plan)
        grid_dependency_wait()
        ci = cuda.blockIdx.y
        if ci >= n_chunks[0]:
            return
        expert = chunks[3 * ci]
        start = chunks[3 * ci + 1]
        count = chunks[3 * ci + 2]
        if expert >= 0:
            n = n_routed
            k = k_routed
            w = w_experts
            first_row = int64(expert) * MATRICES * n  # the expert's first weight row
        else:
            n = n_shared
            k = k_shared
            w = w_shared
            first_row = int64(0)
        if cuda.blockIdx.x * OUT >= n:
            return
        if not guessed or expert >= 0:
            weight_rows(row_of, n, first_row, cuda.blockIdx.x)
            load_step(w, row_of, k >> 2, k >> 3, tid, raw)
        x_at = cuda.local.array(M, int64)  # each pair's activation row (-1: past the chunk)
        for q in range(M):
            if q < count:
                x_at[q] = int64(pair_row[start + q] if SWIGLU else start + q) * ldx
            else:
                x_at[q] = int64(-1)
        gemv_chunk(y, x, w, row_of, raw, x_at, n, k, start, count, pair_weight, ldy)

    return grouped_gemv


def make_ranked_picks(experts: int):
    """``ranked_picks(logits, n_experts, top_k, lane)`` for one warp: row 0's picks as ``moe_route``
    makes them (``make_row_picks``), lane j < top_k returning pick j (probability, expert), the picks'
    sum, and its expert's place among the picks by id (a one-row plan's chunk of that pick)."""
    load_logits, softmax_slots, pick_rounds, _ = make_row_picks(experts)
    SLOTS = experts // 32

    @cuda.jit(device=True, inline=True)
    def ranked_picks(logits, n_experts, top_k, lane):
        probs = cuda.local.array(SLOTS, float32)
        load_logits(probs, logits, 0, lane, n_experts)
        softmax_slots(probs, lane, n_experts)
        mine_p, mine_e, total = pick_rounds(probs, lane, top_k)
        rank = int32(0)
        for j in range(top_k):
            if cuda.shfl_sync(0xFFFFFFFF, mine_e, j) < mine_e:
                rank += 1
        return mine_p, mine_e, total, rank

    return ranked_picks


def make_routed_gemv(COLS: int, THREADS: int, experts: int, NEXT: bool = False, SHARED_FIRST: bool = False,
                     ITEMS: int = 1, LEAD: bool = False):
    """``moe_gate_up_gemv_m1c{COLS}x{THREADS}r{experts}``: a one-row decode step's gate/up GEMV that
    routes the row itself, so no ``moe_route`` launch precedes it. The one row's plan is fixed but for
    which expert each routed chunk holds: chunk ``c < top_k`` is the pick of ``c``-th lowest expert id
    (the plan is in expert order), chunk ``top_k`` the shared expert. So the shared blocks load their
    first step before the grid wait, and each routed block's first warp routes the row from the router
    logits after it (``make_row_picks``: the same picks and weights as ``moe_route``, every block the
    same) and takes its chunk's expert by rank. The blocks of column tile 0 write what ``moe_route``
    writes for one row (the plan, ``row_pair``, the picks; the shared pair's weight ``sigmoid(shared_gate
    . x)`` summed in another order, so to fp32 rounding), read by the down GEMM and the combine after
    this grid. Arguments: ``make_grouped_gemv``'s, then row_pair, topk_ids, topk_w, logits, shared_gate,
    n_experts, top_k, renormalise; grid ``(blocks, top_k + 1)``, ``blocks`` covering the chunks' column
    tiles ``ITEMS`` a block.

    ``ITEMS`` (name suffix ``i{ITEMS}`` past 1): a block takes ``ITEMS`` adjacent column tiles of its
    chunk in turn. Every routed block repeats the routing, a warp's thousand-odd instructions: with 2304
    blocks (the 35B-A3B) that is issue time the loads wait on, and the blocks of later waves route
    before they load. With ITEMS tiles a block there are ITEMS times fewer routings, and at 3 every block
    of the 35B-A3B's grid is resident at once (80 registers: six blocks an SM, 792 on 132 SMs, for 774
    blocks). The same tiles and sums: bit for bit the build without it. ``LEAD`` (name suffix ``l``,
    with ITEMS): a block loads the first step of its next tile as soon as it has used the last step of
    a tile, so those loads fly while it sums the tile and writes it out (without it they go out only
    after the tile's block barrier). The same sums: bit for bit the build without it.

    ``NEXT`` (last arguments ``down_experts, down_shared, down_bytes, shared_bytes``): once a block has
    streamed its columns, its thread 0 asks L2 for the block's share of the first ``down_bytes`` of its
    chunk's expert's down matrix (``[k_routed, n_routed]`` bf16 each; the shared chunk: ``shared_bytes``
    of the shared expert's), which the down GEMV after this grid reads: they stream over this grid's
    tail and the down GEMV's start, when DRAM would wait on the plan.

    ``SHARED_FIRST`` (name suffix ``f``, before ``n``): the grid's first row of blocks takes the shared
    chunk and row ``y`` routed chunk ``y - 1``. Blocks start in launch order (x, then y), and only the
    first few of the grid's blocks fit beside the kernel before it. With the shared chunk in the last row
    its early loads come only after the wait; first, its blocks are the ones resident before the wait, so
    they load their first step there, and ask L2 for the rest of their rows, while the router runs. The
    same chunks and sums: bit for bit the build without it."""
    OUT = COLS // 2
    weight_rows, load_step, stream_steps, finish_chunk, _ = make_gemv_chunk("gate_up", 1, COLS, THREADS)
    weight_row = make_weight_row(COLS, SWIGLU=True)
    ranked_picks = make_ranked_picks(experts)

    @cuda.jit(device=True, inline=True)
    def chunk_of_row(y, top_k):
        """The chunk of the blocks of grid row ``y``: the shared one (``top_k``) first with SHARED_FIRST."""
        if not SHARED_FIRST:
            return y
        if y == 0:
            return top_k
        return y - 1 if y <= top_k else y

    @cuda.jit(device=True, inline=True)
    def ask_rest_of_rows(w, n, words, first_row, first_tile, tid):
        """Thread ``c < COLS`` of the block asks L2 for weight row ``c`` of each of the block's tiles of a
        matrix of ``n`` gate and ``n`` up rows from ``first_row`` (computed again, not read from ``row_of``:
        indexing that by thread would put it in local memory), the first tile's past the first step,
        which the block has loaded (16 bytes a thread: ``2 * THREADS`` of the row's ``words`` u64 words)."""
        if tid < COLS:
            for i in range(ITEMS):
                skip = 2 * THREADS if i == 0 else 0
                row = weight_row(tid, n, first_row, first_tile + i)
                if row >= 0 and words > skip:
                    prefetch_l2(w, row * words + skip, (words - skip) * 8)

    @cuda.jit(device=True, inline=True)
    def prefetch_down(down_w, expert, nbytes, matrix_bytes, n):
        """The block's share (its place among the chunk's ``n / OUT`` tiles, ITEMS a block) of the first
        ``nbytes`` of ``expert``'s down matrix of ``matrix_bytes``."""
        blocks = ((n + OUT - 1) // OUT + ITEMS - 1) // ITEMS
        prefetch_share(down_w, int64(expert) * matrix_bytes, nbytes, blocks, cuda.blockIdx.x)

    @cuda.jit(device=True, inline=True)
    def stream_tiles(y, x, w, row_of, raw, n, k, first_row, first_tile, ci, pair_weight, ldy):
        """The block's tiles of its chunk (the first's first step in ``raw``), each into pair row ``ci`` of y."""
        tid = cuda.threadIdx.x
        x_at = cuda.local.array(1, int64)
        x_at[0] = int64(0)
        acc = cuda.local.array((1, COLS), float32)
        for i in range(ITEMS):
            tile = first_tile + i
            if tile * OUT < n:
                if i > 0 and not LEAD:
                    weight_rows(row_of, n, first_row, tile)
                    load_step(w, row_of, k >> 2, k >> 3, tid, raw)
                stream_steps(acc, x, w, row_of, raw, x_at, k, tid)
                if LEAD and i + 1 < ITEMS:  # raw is free: the next tile's first step (zeros past n)
                    weight_rows(row_of, n, first_row, tile + 1)
                    load_step(w, row_of, k >> 2, k >> 3, tid, raw)
                finish_chunk(acc, y, n, ci, 1, pair_weight, ldy, tile)
                if i + 1 < ITEMS:
                    cuda.syncthreads()  # every thread past this tile's sums before the next writes them

    @cuda.jit(device=True, inline=True)
    def body(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared, k_routed,
             k_shared, ldy, ldx, row_pair, topk_ids, topk_w, logits, shared_gate, n_experts, top_k, renormalise,
             down_experts, down_shared, down_bytes, shared_bytes):
        tid = cuda.threadIdx.x
        lane = tid & 31
        ci = chunk_of_row(cuda.blockIdx.y, top_k)
        shared = ci == top_k
        first_tile = int32(cuda.blockIdx.x * ITEMS)  # 32-bit index arithmetic, as blockIdx.x's
        row_of = cuda.local.array(COLS, int64)  # the weight rows of the block's tile (-1: past the matrix)
        raw = cuda.local.array((COLS, 4), uint32)
        w01, w23 = uint32(0), uint32(0)
        expert = int32(0)  # a routed block's pick
        if shared:  # its weights need no routing
            weight_rows(row_of, n_shared, int64(0), first_tile)
            load_step(w_shared, row_of, k_shared >> 2, k_shared >> 3, tid, raw)
            w01, w23 = first_gate_words(shared_gate, k_shared)
            if SHARED_FIRST:
                ask_rest_of_rows(w_shared, n_shared, k_shared >> 2, int64(0), first_tile, tid)
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
        if ci > top_k:
            return
        if shared:
            if cuda.blockIdx.x == 0:  # the shared pair and the plan's shared chunk and count
                gate = shared_gate_dot(x, shared_gate, k_shared, w01, w23)
                if tid == 0:
                    pair_row[top_k] = 0
                    pair_weight[top_k] = float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * gate)
                    chunks[3 * top_k] = -1
                    chunks[3 * top_k + 1] = top_k
                    chunks[3 * top_k + 2] = 1
                    n_chunks[0] = top_k + 1
            n = n_shared
            k = k_shared
            w = w_shared
            first_row = int64(0)
        else:
            picked = cuda.shared.array(1, int32)
            if tid < 32:
                mine_p, mine_e, total, rank = ranked_picks(logits, n_experts, top_k, lane)
                if lane < top_k and rank == ci:
                    picked[0] = mine_e
                    if cuda.blockIdx.x == 0:  # moe_route's outputs for this pick
                        weight = mine_p / total if renormalise != 0 else mine_p
                        topk_ids[lane] = mine_e
                        topk_w[lane] = weight
                        row_pair[lane] = ci
                        pair_row[ci] = 0
                        pair_weight[ci] = weight
                        chunks[3 * ci] = mine_e
                        chunks[3 * ci + 1] = ci
                        chunks[3 * ci + 2] = 1
            cuda.syncthreads()
            expert = picked[0]
            n = n_routed
            k = k_routed
            w = w_experts
            first_row = int64(expert) * 2 * n
            if first_tile * OUT < n:
                weight_rows(row_of, n, first_row, first_tile)
                load_step(w, row_of, k >> 2, k >> 3, tid, raw)
        if first_tile * OUT >= n:
            return
        stream_tiles(y, x, w, row_of, raw, n, k, first_row, first_tile, ci, pair_weight, ldy)
        if NEXT and tid == 0:
            if shared:
                prefetch_down(down_shared, 0, shared_bytes, int64(k_shared) * n_shared * 2, n)
            else:
                prefetch_down(down_experts, expert, down_bytes, int64(k_routed) * n_routed * 2, n)

    if NEXT:
        def routed_gemv(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared,
                        k_routed, k_shared, ldy, ldx, row_pair, topk_ids, topk_w, logits, shared_gate, n_experts,
                        top_k, renormalise, down_experts, down_shared, down_bytes, shared_bytes):
            body(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared, k_routed,
                 k_shared, ldy, ldx, row_pair, topk_ids, topk_w, logits, shared_gate, n_experts, top_k, renormalise,
                 down_experts, down_shared, down_bytes, shared_bytes)
    else:
        def routed_gemv(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared,
                        k_routed, k_shared, ldy, ldx, row_pair, topk_ids, topk_w, logits, shared_gate, n_experts,
                        top_k, renormalise):
            body(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared, k_routed,
                 k_shared, ldy, ldx, row_pair, topk_ids, topk_w, logits, shared_gate, n_experts, top_k, renormalise,
                 y, y, 0, 0)

    return routed_gemv


def make_combined_down_gemv(COLS: int, THREADS: int, GROUPS: int):
    """``moe_down_combine_gemv_m1c{COLS}x{THREADS}g{GROUPS}``: a one-row step's down GEMV with
    ``moe_combine_residual`` folded in, no ticket needed: a block per ``COLS`` output columns, its
    ``GROUPS`` groups of ``THREADS`` threads one chunk each (group g chunk g: at most GROUPS chunks, so
    ``top_k + 1 <= GROUPS``), each streaming its chunk as ``make_grouped_gemv``'s block does. The
    pairs' columns stay in shared memory, and the block adds their sum (slots in order, then the
    shared pair, as ``moe_combine_residual``) into the residual stream: bit for bit the down GEMV
    and the combine launched apart. Arguments: ``make_grouped`` "down_combine"'s; grid ``(tiles,)``."""
    WARPS = THREADS // 32
    weight_rows, load_step, stream_steps, _, _ = make_gemv_chunk("down", 1, COLS, THREADS)

    @cuda.jit(device=True, inline=True)
    def stream_and_combine(x, w, row_of, raw, k, live, pair, pair_weight, ldx, residual, row_pair, top_k, n):
        """The group's chunk (one pair, its first step in ``raw``), then the tile's combine."""
        red = cuda.shared.array((GROUPS, WARPS, COLS), float32)
        outs = cuda.shared.array((GROUPS, COLS), float32)  # by pair: a one-row pair's weighted columns
        tid = cuda.threadIdx.x
        group = tid // THREADS
        t = tid % THREADS
        acc = cuda.local.array((1, COLS), float32)
        for c in range(COLS):
            acc[0, c] = float32(0.0)
        if live:
            x_at = cuda.local.array(1, int64)
            x_at[0] = int64(pair) * ldx
            stream_steps(acc, x, w, row_of, raw, x_at, k, t)
        for c in range(COLS):
            red[group, t >> 5, c] = warp_sum(acc[0, c])
        cuda.syncthreads()
        if live and t < COLS:
            total = float32(0.0)
            for wp in range(WARPS):
                total += red[group, wp, t]
            outs[pair, t] = pair_weight[pair] * total
        cuda.syncthreads()
        col = cuda.blockIdx.x * COLS + tid
        if tid < COLS and col < n:
            total = float32(0.0)
            for slot in range(top_k):
                total += outs[row_pair[slot], tid]
            total += outs[top_k, tid]
            residual[col] += total

    def combined_down(y, x, w_experts, w_shared, chunks, n_chunks, pair_row, pair_weight, n_routed, n_shared,
                      k_routed, k_shared, ldy, ldx, residual, row_pair, rows, top_k, tickets):
        group = cuda.threadIdx.x // THREADS
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
        live = group < n_chunks[0]
        pair = 0
        k = k_shared
        w = w_shared
        row_of = cuda.local.array(COLS, int64)
        raw = cuda.local.array((COLS, 4), uint32)
        if live:
            expert = chunks[3 * group]
            pair = chunks[3 * group + 1]
            first_row = int64(0)
            if expert >= 0:
                k = k_routed
                w = w_experts
                first_row = int64(expert) * n_routed
            weight_rows(row_of, n_routed, first_row, cuda.blockIdx.x)  # n_routed == n_shared == hidden
            load_step(w, row_of, k >> 2, k >> 3, cuda.threadIdx.x % THREADS, raw)
        stream_and_combine(x, w, row_of, raw, k, live, pair, pair_weight, ldx, residual, row_pair, top_k, n_routed)

    return combined_down


def combined_down_name(COLS: int, THREADS: int, GROUPS: int) -> str:
    return f"moe_down_combine_gemv_m1c{COLS}x{THREADS}g{GROUPS}"


@cuda.jit(device=True, inline=True)
def shared_gate_dot(x, shared_gate, hidden, w01, w23):
    """``shared_gate . x[0]`` over the block, 4 elements a thread a step (``w01, w23``: the thread's
    ``first_gate_words``); warp sums, then the warps' in order. Every thread returns it."""
    red = cuda.shared.array(32, float32)
    part = float32(0.0)
    h = GATE_SPAN * cuda.threadIdx.x
    while h < hidden:
        if h != GATE_SPAN * cuda.threadIdx.x:  # the first step's are in hand
            w01, w23 = load_u32x2(shared_gate, h)
        x0, x1, x2, x3 = load_f32x4(x, h)
        part += x0 * bf16_lo(w01) + x1 * bf16_hi(w01) + x2 * bf16_lo(w23) + x3 * bf16_hi(w23)
        h += GATE_SPAN * cuda.blockDim.x
    part = warp_sum(part)
    if (cuda.threadIdx.x & 31) == 0:
        red[cuda.threadIdx.x >> 5] = part
    cuda.syncthreads()
    total = float32(0.0)
    for wp in range(cuda.blockDim.x >> 5):
        total += red[wp]
    return total


def gemv_name(kind: str, M: int, COLS: int, THREADS: int, shared_early: bool = False) -> str:
    return f"moe_{kind}_gemv_m{M}c{COLS}x{THREADS}{'s' if shared_early else ''}"


def routed_gemv_name(COLS: int, THREADS: int, experts: int, NEXT: bool = False, SHARED_FIRST: bool = False,
                     ITEMS: int = 1, LEAD: bool = False) -> str:
    items = f"i{ITEMS}" if ITEMS > 1 else ""
    flags = ("f" if SHARED_FIRST else "") + ("l" if LEAD else "") + ("n" if NEXT else "")
    return f"moe_gate_up_gemv_m1c{COLS}x{THREADS}r{experts}{items}{flags}"


@cuda.jit(device=True, inline=True)
def plain_entry(array, index):
    return array[index]


def grouped_name(kind: str, T: int, W: int, U: int, P: int, TERMS: int, hold: bool = False, early: bool = False) -> str:
    return f"moe_{kind}_t{T}w{W}u{U}p{P}s{TERMS}{'h' if hold else ''}{'e' if early else ''}"


# Candidates (kind, tiles, warps, steps in flight, pair groups of 8, activation terms): decode ones
# with one group of 8 pairs and three parts, prefill ones with more pairs per chunk and two parts;
# the prefill router keeps three parts (a near tie must break as in the reference).
# ninfer/backends/cuda/moe.py names the ones it launches.
GROUPED_SHAPES = [
    ("gate_up", 1, 8, 2, 1, 3), ("gate_up", 1, 4, 4, 1, 3), ("gate_up", 2, 4, 2, 1, 3),
    ("down", 1, 4, 2, 1, 3), ("down", 1, 8, 1, 1, 3), ("down", 2, 4, 2, 1, 3),
    ("gate_up", 2, 4, 1, 4, 2), ("gate_up", 4, 4, 1, 2, 2), ("gate_up", 8, 4, 1, 2, 2), ("gate_up", 4, 4, 1, 4, 2),
    ("down", 2, 4, 1, 4, 2), ("down", 4, 4, 1, 2, 2), ("down", 8, 4, 1, 2, 2), ("down", 4, 4, 1, 4, 2),
    ("router", 4, 4, 1, 2, 3),
    ("down_combine", 1, 4, 2, 1, 3),  # the decode down shape with the combine folded in (CudaMoe.fold_combine)
]
GROUPED_SIG = (F32P, F32P, U64P, U64P, I32P, I32P, I32P, F32P, int32, int32, int32, int32, int32, int32)
COMBINE_SIG = (F32P, I32P, int32, int32, I32P)  # down_combine's more: residual, row_pair, rows, top_k, tickets

KERNELS = {
    "moe_topk": (moe_topk, (I32P, F32P, I32P, F32P, F32P, F32P, U16P, int32, int32, int32, int32, int32),
                 {"threads": 32, "grid_wait": 1}),
    "moe_plan": (moe_plan, (I32P, I32P, I32P, F32P, I32P, I32P, F32P, int32, int32, int32, int32),
                 {"threads": PLAN_THREADS, "max_experts": MAX_EXPERTS, "grid_wait": 1}),
    "moe_combine": (make_combine(False), (F32P, F32P, I32P, int32, int32, int32),
                    {"threads": COMBINE_THREADS, "grid_wait": 1}),
    "moe_combine_residual": (make_combine(True), (F32P, F32P, I32P, int32, int32, int32),
                             {"threads": COMBINE_THREADS, "grid_wait": 1}),
}
ROUTE_SIG = (I32P, I32P, I32P, F32P, I32P, I32P, F32P, F32P, F32P, U16P, int32, int32, int32, int32, int32, int32)
ROUTER_ROUTE_SIG = (F32P, F32P, U64P, F32P, int32, int32, int32, float32, F32P, I32P, I32P, I32P, F32P, I32P, I32P,
                    F32P, U16P, int32, int32, int32, I32P)
for _experts in ROUTE_EXPERTS:
    KERNELS[f"moe_route_e{_experts}"] = (make_route(_experts), ROUTE_SIG, {
        "threads": ROUTE_THREADS, "max_experts": _experts, "max_rows": ROUTE_ROWS, "grid_wait": 1})
    KERNELS[f"moe_router_route_e{_experts}"] = (make_router_route(_experts), ROUTER_ROUTE_SIG, {
        "threads": ROUTE_THREADS, "cols": 16 * ROUTER_SHAPE[0], "max_experts": _experts, "max_rows": ROUTE_ROWS,
        "grid_wait": 1})
# The decode shapes holding each round's MMAs for all of its loads (``hold``), candidates for
# CudaMoe.decode_gemms (tools/gpu_bench_hybrid.py --moe-gemms-ablation).
# A 2048-wide gate/up row is 64 k-steps: 8 warps of 2 take four rounds, 8 of 4 two, 16 of 4 one; a
# 512-wide down row is 16: 4 warps of 2 take two rounds, the others one.
HOLD_SHAPES = [(kind, 1, w, u, 1, 3) for kind, w, u in (
    ("gate_up", 8, 2), ("gate_up", 8, 4), ("gate_up", 16, 4), ("gate_up", 4, 4),
    ("down", 4, 2), ("down", 8, 2), ("down", 4, 4),
    ("down_combine", 4, 2), ("down_combine", 8, 2), ("down_combine", 4, 4))]
# The ``early`` builds (candidates for CudaMoe.decode_gemms): the decode gate/up shape triggering after its wait, and down
# shapes loading their first round before it (4 warps of 4 steps: a 512-wide row's whole K).
EARLY_SHAPES = [("gate_up", 1, 8, 2, 1, 3), ("down", 1, 4, 2, 1, 3), ("down", 1, 4, 4, 1, 3)]
_BUILDS = ([(_s, False, False) for _s in GROUPED_SHAPES] + [(_s, True, False) for _s in HOLD_SHAPES]
           + [(_s, False, True) for _s in EARLY_SHAPES])
# The fp32 grouped GEMVs of decode steps of one or two rows (CudaMoe.gemv_gemms): (kind, rows, weight rows a
# block, threads). gate/up's 2048-wide rows take 128 threads two steps, down's 512-wide ones 64 threads one.
# Fewer threads a block take more steps each (gate/up 32 threads: eight) and let every block of a step be
# resident at once (no second wave): candidates for one row.
# The ``s`` builds load the shared expert's weights before the wait (``SHARED_EARLY``, one row).
GEMV_SHAPES = [(kind, m, cols, threads, False) for m in (1, 2) for kind, cols, threads in (
    ("gate_up", 4, 128), ("gate_up", 8, 128), ("down", 8, 64), ("down", 4, 64))] + [
    ("gate_up", 1, 4, 64, False), ("gate_up", 1, 4, 32, False), ("down", 1, 8, 32, False), ("down", 1, 4, 32, False),
    ("gate_up", 1, 4, 128, True), ("down", 1, 8, 64, True)]
for _kind, _m, _cols, _threads, _early in GEMV_SHAPES:
    KERNELS[gemv_name(_kind, _m, _cols, _threads, _early)] = (
        make_grouped_gemv(_kind, _m, _cols, _threads, _early), GROUPED_SIG,
        {"threads": _threads, "cols": _cols // 2 if _kind == "gate_up" else _cols, "pairs": _m, "grid_wait": 1})
# The one-row gate/up GEMVs that route the row themselves (CudaMoe.gemv_routes), for at most 256 experts.
ROUTED_GEMV_SHAPES = [(4, 128, 256), (4, 64, 256)]
ROUTED_GEMV_SIG = GROUPED_SIG + (I32P, I32P, F32P, F32P, U16P, int32, int32, int32)
for _cols, _threads, _experts in ROUTED_GEMV_SHAPES:
    KERNELS[routed_gemv_name(_cols, _threads, _experts)] = (
        make_routed_gemv(_cols, _threads, _experts), ROUTED_GEMV_SIG,
        {"threads": _threads, "cols": _cols // 2, "pairs": 1, "max_experts": _experts, "grid_wait": 1})
# The first shape with the shared chunk in the grid's first row (SHARED_FIRST), with several column tiles a
# block (ITEMS), loading each next tile's first step early (LEAD), with and without asking L2 for its
# chunk's down weights at its tail (CudaMoe.down_prefetch): (NEXT, SHARED_FIRST, ITEMS, LEAD).
ROUTED_GEMV_VARIANTS = [(_next, True, _items, _lead) for _next in (False, True)
                        for _items, _lead in ((1, False), (3, False), (3, True))] + [(True, False, 1, False)]
for _next, _first, _items, _lead in ROUTED_GEMV_VARIANTS:
    _cols, _threads, _experts = ROUTED_GEMV_SHAPES[0]
    KERNELS[routed_gemv_name(_cols, _threads, _experts, _next, _first, _items, _lead)] = (
        make_routed_gemv(_cols, _threads, _experts, _next, _first, _items, _lead),
        ROUTED_GEMV_SIG + ((U32P, U32P, int32, int32) if _next else ()),
        {"threads": _threads, "cols": _cols // 2 * _items, "pairs": 1, "max_experts": _experts, "grid_wait": 1,
         **({"next": 1} if _next else {})})
# The one-row down GEMVs with the combine folded in (CudaMoe.gemv_combine): 8 columns x 64 or 32 threads a chunk
# (32: two blocks an SM, all 256 of a 2048-wide model resident), 9 chunks (top 8, the shared expert) a block.
COMBINED_DOWN_SHAPES = [(8, 64, 9), (8, 32, 9)]
for _cols, _threads, _groups in COMBINED_DOWN_SHAPES:
    KERNELS[combined_down_name(_cols, _threads, _groups)] = (
        make_combined_down_gemv(_cols, _threads, _groups), GROUPED_SIG + COMBINE_SIG,
        {"threads": _threads * _groups, "cols": _cols, "pairs": 1, "groups": _groups, "grid_wait": 1})
for (_kind, _T, _W, _U, _P, _terms), _hold, _early in _BUILDS:
    KERNELS[grouped_name(_kind, _T, _W, _U, _P, _terms, _hold, _early)] = (
        make_grouped(_kind, _T, _W, _U, _P, _terms, _hold, _early),
        GROUPED_SIG + (COMBINE_SIG if _kind == "down_combine" else ()),
        {"threads": 32 * _W, "cols": _T * (8 if _kind == "gate_up" else 16), "pairs": 8 * _P, "terms": _terms,
         "early": int(_early), "grid_wait": 1})
