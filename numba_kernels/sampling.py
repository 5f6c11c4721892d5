"""Device sampling: the rule of ``ninfer.backends.sampling`` on the GPU, in two launches.

Penalised logit ``l[t] - presence * (count[t] > 0) - frequency * count[t]`` is computed on the fly
from the lane's counts. Candidates are ordered by value descending, then index ascending (a total
order), and a row keeps its ``k`` best (``k = 1`` for greedy, else top_k capped at 20).

``sample_partial`` (grid ``(parts, rows)``): each block takes one slice of the vocabulary and
finds its ``k`` best in ``k`` rounds; round ``r`` picks the best element that ranks strictly below
the winner of round ``r - 1``, so no list of taken ids is searched. Slices are small and spread
over many SMs: one block scanning 150k logits 20 times was 3.9 ms a step on the H200.
``sample`` (grid ``(rows,)``): merges the ``parts x k`` candidates the same way, then thread 0
applies temperature, softmax, top-p, min-p and the splitmix64 draw keyed by ``(seed, step)``.
Only the chosen ids leave the device.

Per-row parameters: ``fparams[r*5 : r*5+5] = temperature, top_p, min_p, presence, frequency``;
``iparams[r*2 : r*2+2] = top_k, lane``; ``keys[r*2 : r*2+2] = seed (as u64), step``.
Candidates: ``part_v/part_i[(row * parts + part) * TOP_K_CAP + j]``; an empty slot has index
``NONE`` (a slice shorter than ``k``). Both launches use ``THREADS`` threads a block.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64, uint64

from numba_kernels.common import F32P, I32P, U64P, grid_dependency_wait, launch_dependents

THREADS = 256
WARPS = THREADS // 32
TOP_K_CAP = 20
MAX_PARTS = 64
NONE = int32(0x7FFFFFFF)  # after every real index in the candidate order
GOLDEN = uint64(0x9E3779B97F4A7C15)
MIX1 = uint64(0xBF58476D1CE4E5B9)
MIX2 = uint64(0x94D049BB133111EB)


@cuda.jit(device=True, inline=True)
def splitmix64(x):
    x = x + GOLDEN
    x = (x ^ (x >> uint64(30))) * MIX1
    x = (x ^ (x >> uint64(27))) * MIX2
    return x ^ (x >> uint64(31))


@cuda.jit(device=True, inline=True)
def better(v, i, bv, bi):
    """Candidate order: larger value first, then lower index."""
    return v > bv or (v == bv and i < bi)


@cuda.jit(device=True, inline=True)
def row_k(fparams, iparams, row, vocab):
    """How many candidates the row keeps: 1 when greedy, else top_k (0 or > 20 mean 20)."""
    k = 1
    if fparams[row * 5] > float32(0.0):
        top_k = iparams[row * 2]
        k = top_k if 1 <= top_k <= TOP_K_CAP else TOP_K_CAP
    return min(k, vocab)


@cuda.jit(device=True, inline=True)
def block_best(bv, bi, red_v, red_i):
    """The best (value, index) over the block; every thread gets it."""
    lane = cuda.threadIdx.x & 31
    warp = cuda.threadIdx.x >> 5
    for offset in (16, 8, 4, 2, 1):
        ov = cuda.shfl_xor_sync(0xFFFFFFFF, bv, offset)
        oi = cuda.shfl_xor_sync(0xFFFFFFFF, bi, offset)
        if better(ov, oi, bv, bi):
            bv = ov
            bi = oi
    if lane == 0:
        red_v[warp] = bv
        red_i[warp] = bi
    cuda.syncthreads()
    bv = red_v[0]
    bi = red_i[0]
    for w in range(1, WARPS):
        if better(red_v[w], red_i[w], bv, bi):
            bv = red_v[w]
            bi = red_i[w]
    cuda.syncthreads()  # red_* are rewritten by the next round
    return bv, bi


def sample_partial(part_v, part_i, logits, counts, fparams, iparams, vocab, parts):
    red_v = cuda.shared.array(WARPS, float32)
    red_i = cuda.shared.array(WARPS, int32)
    launch_dependents()
    grid_dependency_wait()
    part = cuda.blockIdx.x
    row = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    presence = fparams[row * 5 + 3]
    frequency = fparams[row * 5 + 4]
    penalised = presence != float32(0.0) or frequency != float32(0.0)
    k = row_k(fparams, iparams, row, vocab)
    span = (vocab + parts - 1) // parts
    first = part * span
    last = min(vocab, first + span)
    lbase = int64(row) * vocab
    cbase = int64(iparams[row * 2 + 1]) * vocab
    out = (row * parts + part) * TOP_K_CAP
    prev_v = float32(math.inf)
    prev_i = int32(-1)
    for rnd in range(k):
        bv = float32(-math.inf)
        bi = NONE
        for t in range(first + tid, last, THREADS):
            v = logits[lbase + t]
            if penalised:
                c = counts[cbase + t]
                v = v - presence * float32(c > 0) - frequency * float32(c)
            if better(prev_v, prev_i, v, t) and better(v, t, bv, bi):
                bv = v
                bi = t
        bv, bi = block_best(bv, bi, red_v, red_i)
        if tid == 0:
            part_v[out + rnd] = bv
            part_i[out + rnd] = bi
        prev_v = bv
        prev_i = bi


def sample(out, part_v, part_i, fparams, iparams, keys, vocab, parts):
    cand_v = cuda.shared.array(TOP_K_CAP, float32)
    cand_i = cuda.shared.array(TOP_K_CAP, int32)
    red_v = cuda.shared.array(WARPS, float32)
    red_i = cuda.shared.array(WARPS, int32)
    grid_dependency_wait()
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    temperature = fparams[row * 5]
    k = row_k(fparams, iparams, row, vocab)
    base = row * parts * TOP_K_CAP
    prev_v = float32(math.inf)
    prev_i = int32(-1)
    for rnd in range(k):
        bv = float32(-math.inf)
        bi = NONE
        for c in range(tid, parts * k, THREADS):  # slot j of part p, for j < k
            at = base + (c // k) * TOP_K_CAP + c % k
            v = part_v[at]
            t = part_i[at]
            if t != NONE and better(prev_v, prev_i, v, t) and better(v, t, bv, bi):
                bv = v
                bi = t
        bv, bi = block_best(bv, bi, red_v, red_i)
        if tid == 0:
            cand_v[rnd] = bv
            cand_i[rnd] = bi
        prev_v = bv
        prev_i = bi
    if tid != 0:
        return
    if k == 1 or temperature <= float32(0.0):
        out[row] = cand_i[0]
        return
    probs = cuda.local.array(TOP_K_CAP, float32)
    top = cand_v[0] / temperature
    total = float32(0.0)
    for j in range(k):
        probs[j] = math.exp(cand_v[j] / temperature - top)
        total += probs[j]
    for j in range(k):
        probs[j] = probs[j] / total
    keep = k
    top_p = fparams[row * 5 + 1]
    if top_p < float32(1.0):
        threshold = top_p - float32(1e-6)
        cumulative = float32(0.0)
        below = 0
        for j in range(k):
            cumulative += probs[j]
            if cumulative < threshold:
                below += 1
        keep = min(max(1, below + 1), k)
    min_p = fparams[row * 5 + 2]
    if min_p > float32(0.0):
        floor = min_p * probs[0]
        kept = 0
        for j in range(keep):
            if probs[j] >= floor:
                kept += 1
        keep = kept
    cumulative = float32(0.0)
    for j in range(keep):
        cumulative += probs[j]
    seed = uint64(keys[row * 2])
    step = uint64(keys[row * 2 + 1])
    x = splitmix64(seed ^ (step * GOLDEN))
    u = float32(x >> uint64(40)) / float32(16777216.0)
    target = u * cumulative
    running = float32(0.0)
    index = 0
    for j in range(keep):
        running += probs[j]
        if running <= target:
            index += 1
    out[row] = cand_i[min(index, keep - 1)]


_META = {"threads": THREADS, "max_parts": MAX_PARTS, "top_k_cap": TOP_K_CAP, "grid_wait": 1}
KERNELS = {"sample_partial": (sample_partial, (F32P, I32P, F32P, I32P, F32P, I32P, int32, int32), _META),
           "sample": (sample, (I32P, F32P, I32P, F32P, I32P, U64P, int32, int32), _META)}
