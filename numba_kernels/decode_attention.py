"""A decode step's attention in one launch per layer: q/k post-processing, KV append, split-K attention
and the merge of the splits.

The prefill path needs three launches (``rope_kv``, ``attention_*``, ``attention_combine``) because
the rows of one sequence read each other's keys. In a decode step every row is its own sequence and
adds one key, so one kernel can do everything, and at batch 1 the two launches it saves per layer
are worth more than the work they did.

``decode_attention_g{G}_d{D}_{bf16|f32}``: grid ``(kv_heads, rows, n_splits)`` like ``attention_*``.
Each block

0. before it waits for the previous kernel (programmatic dependent launch, common.py), starts
   ``cp.async`` copies into shared memory of its split's first STAGE keys' K and V rows, the rotary
   row of the new position and the q/k norm weights (nothing the step's earlier kernels write), and
   with bit 0 of ``split_ptr[1]`` asks L2 for the split's other keys;
1. loads its row's ``G`` query heads (and, in the block whose split holds the row's position, the
   new key and value) from the fused qkv activation, and applies the optional bias, the optional
   per-head RMSNorm (Qwen3) and RoPE in shared memory, exactly as ``rope_kv`` does;
2. the block holding the new token writes its K/V into the pool (rounded as the pool stores them)
   and keeps the rounded values: its key loop stops one short and the new key joins in the merge;
3. folds the staged keys from shared memory and the rest of its split, then merges its warps: over a
   bf16 pool on tensor cores, 16 keys a warp step (decode_attention_mma.py), over an fp32 pool (the
   parity runs) through the ``attention_*`` key loop on CUDA cores;
4. with one split holding keys, writes the output; else writes its partial, and the last block of
   the (row, kv head) to finish (an atomic ticket in ``counters``, reset by that block) merges every
   split's partial into the output (``merge_splits``: a warp a head weighs the splits, then a thread
   per 4 dims of a head sums the weighted pieces, MERGE_BATCH splits' loads in flight at once).

``split_ptr`` (step inputs): the split length, and bits of what the blocks ask L2 for: 1, their split's
unstaged keys and values, before waiting for the previous kernel; 2, the next kernel's weights (below).
``counters``: one int32 per (row, kv head), zero between launches. ``next_w``, ``next_bytes``: the first
bytes of the next kernel's weights (the o projection), which the grid asks L2 for right after its wait
(a share a block) when bit 1 of ``split_ptr[1]`` is set: attention leaves DRAM mostly idle, and the o
GEMV that waits for it reads those weights from L2. The pool is passed twice: as
32-bit words (the key loop's vector loads) and as its element type (the append's stores).
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64, uint32
from numba.cuda import libdevice

from numba_kernels.attention import (VARIANTS, keys_in_flight, load_pair_f32, load_quad_f32, make_key_fold,
                                     make_key_loop, make_warp_merge)
from numba_kernels.common import (F32P, I32P, NEG_BIG, U16P, U32P, bf16_to_f32,
                                  copy_async_16, copy_async_wait, f32_to_bf16, grid_dependency_wait,
                                  global_timer, launch_dependents, load_f32x4, prefetch_block_share, prefetch_l2,
                                  ticket_acq_rel, warp_max, warp_sum)
from numba_kernels.decode_attention_mma import make_mma_key_phase
from numba_kernels.rope import store_bf16, store_f32

MAX_SPLITS = 64  # splits a launch may have (forward.MAX_DECODE_SPLITS; the manifest's ``max_splits``)
# Shared memory for the K and V rows of each split's first keys, copied in before the kernel waits for
# the q/k/v: 16 keys of a bf16 head of 128, a tensor-core tile. (H100, ms a step against 32 keys:
# b8/512 6.163 vs 6.181, b8/1024 6.393 vs 6.404, b1/2048 5.327 vs 5.348, b1/512 level, b1/8192 5.717
# vs 5.703; 64 keys was slower: b4/512 6.269 vs 6.193.)
STAGE_BYTES = 8 << 10
# Splits whose 4-dim pieces a thread of the merge loads per round, by pool: 8 beside the tensor-core key
# phase (H100, ms a step with 8 / 16 / 4: b1/512 5.376 / 5.391 / 5.378, b8/512 6.368 / 6.428 / 6.358,
# b1/2048 5.444 / 5.458 / 5.458), 4 beside the CUDA-core one, which has fewer registers to spare.
MERGE_BATCH = {"bf16": 8, "f32": 4}
# Where the traced variant stamps the time (thread 0 of each block; the last two only in split merges).
TRACE_POINTS = ("start", "staged", "waited", "qkv", "roped", "keys", "partial", "ticket", "merged")


@cuda.jit(device=True, inline=True)
def as_stored_bf16(value):
    return bf16_to_f32(f32_to_bf16(value))


@cuda.jit(device=True, inline=True)
def as_stored_f32(value):
    return value


def make_cuda_key_phase(G, D, WARPS, STAGE):
    """The key phase over an fp32 pool on CUDA cores: ``key_phase(...)`` (the signature of
    decode_attention_mma.py's) folds the staged keys from shared memory, then the rest of ``[start,
    end)`` through attention.py's key loop, and stashes the warps' states (a block sync)."""
    E = D // 32
    U = keys_in_flight(G, D)  # keys in flight per warp
    NV = U * G
    key_loop = make_key_loop(G, D, load_pair_f32, load_quad_f32, U, WARPS)
    fold = make_key_fold(G, D, U)
    empty, stash, _ = make_warp_merge(G, D, WARPS)

    @cuda.jit(device=True, inline=True)
    def staged_row(dst, u, sh_kv, row_at, lane):
        """The lane's ``E`` dims of a staged row (32-bit words from ``row_at``) into ``dst[u]``."""
        at = row_at + lane * E
        for e in range(E):
            dst[u, e] = libdevice.int_as_float(int32(sh_kv[at + e]))

    @cuda.jit(device=True, inline=True)
    def staged_loop(q, acc, m, l, sh_kv, staged, warp, lane, scale):
        """The warp's share of the staged keys, U consecutive keys a step (as ``key_loop``: more would
        cost registers, and at 3 blocks an SM the long-context batches need every one)."""
        s = cuda.local.array((U, G), float32)
        vals = cuda.local.array(NV, float32)
        kb = cuda.local.array((U, E), float32)
        vb = cuda.local.array((U, E), float32)
        for t0 in range(warp * U, staged, WARPS * U):
            for u in range(U):
                slot = min(t0 + u, staged - 1)  # past the end: any staged row, ``fold`` gives it no weight
                staged_row(kb, u, sh_kv, slot * D, lane)
                staged_row(vb, u, sh_kv, (STAGE + slot) * D, lane)
            fold(q, acc, m, l, kb, vb, s, vals, t0, staged, lane, scale)

    @cuda.jit(device=True, inline=True)
    def key_phase(sh_x, sh_kv, sh_m, sh_l, sh_o, kc, page_stride, page_tables, table, page_shift, head_off, v_off,
                  start, staged, end, warp, lane, scale):
        q = cuda.local.array((G, E), float32)
        acc = cuda.local.array((G, E), float32)
        m = cuda.local.array(G, float32)
        l = cuda.local.array(G, float32)
        empty(acc, m, l)
        for g in range(G):
            for e in range(E):
                q[g, e] = sh_x[g, lane * E + e]
        staged_loop(q, acc, m, l, sh_kv, staged, warp, lane, scale)
        key_loop(q, acc, m, l, kc, page_stride, page_tables, table, page_shift, head_off, v_off, start + staged,
                 end, warp, lane, scale)
        stash(sh_m, sh_l, sh_o, m, l, acc, warp, lane)

    return key_phase


def make_decode_attention(G, D, dtype, TRACE=False):
    """The kernel over a ``dtype`` pool; with ``TRACE`` a variant taking one more parameter, a uint64
    array where thread 0 of each block writes ``%globaltimer`` at TRACE_POINTS
    (tools/trace_decode_attention.py). A bf16 pool's key phase runs on tensor cores
    (decode_attention_mma.py), an fp32 pool's on CUDA cores (attention.py's key loop)."""
    store, as_stored, ITEM = POOLS[dtype][2:]
    TC = dtype == "bf16"
    WARPS = TC_WARPS if TC else CUDA_WARPS
    WORD_SHIFT = 1 if ITEM == 2 else 0  # pool elements per 32-bit word of ``kc``: 2 (bf16) or 1
    HALF = D // 2
    THREADS = WARPS * 32
    ROWS = G + 2  # shared-array shapes must be plain constants
    ROPED = G + 1
    FACTORS = WARPS + 1  # a head's factors: its warps', then the new value's
    STAGE = STAGE_BYTES // (2 * D * ITEM)  # keys whose K and V rows are staged in shared memory
    ROW_WORDS = D * ITEM // 4  # 32-bit words of one key's K (or V) row
    ROW_CHUNKS = D * ITEM // 16  # its 16-byte copies
    KV_WORDS = 2 * STAGE * ROW_WORDS  # the staged K rows, then the V rows
    STAGE_COPIES = -(-2 * STAGE * ROW_CHUNKS // THREADS)  # 16-byte copies per thread
    QKV_LOADS = -(-ROWS * D // THREADS)  # q/k/v values per thread
    QUADS = D // 4  # 4-dim pieces of a head the split merge gives its threads
    BATCH = MERGE_BATCH[dtype]
    NORMS = 2 * D
    key_phase = (make_mma_key_phase if TC else make_cuda_key_phase)(G, D, WARPS, STAGE)
    warp_factors = make_warp_merge(G, D, WARPS)[2]

    @cuda.jit(device=True, inline=True)
    def row_dot(sh_x, a, b, lane):
        """``sh_x[a] . sh_x[b]`` summed over the warp; every lane gets it."""
        total = float32(0.0)
        for d in range(lane, D, 32):
            total += sh_x[a, d] * sh_x[b, d]
        return warp_sum(total)

    @cuda.jit(device=True, inline=True)
    def stage_keys(sh_kv, kc, page_stride, page_tables, table, page_shift, head_off, v_off, start, staged, tid):
        """Start copying the K and V rows of keys ``[start, start + staged)`` into ``sh_kv``."""
        page_mask = (int64(1) << page_shift) - 1
        # A fixed count of copies per thread, so the loop unrolls and the page lookups go out together.
        for j in range(STAGE_COPIES):
            i = tid + j * THREADS
            chunk = i % ROW_CHUNKS
            pair = i // ROW_CHUNKS  # (key, K or V)
            slot = pair >> 1
            kv = pair & 1
            if slot < staged:
                t = start + slot
                page = int64(page_tables[table + (t >> page_shift)])
                element = page * page_stride + head_off + kv * v_off + (t & page_mask) * D + chunk * (16 // ITEM)
                copy_async_16(sh_kv, (kv * STAGE + slot) * ROW_WORDS + chunk * 4, kc, element >> WORD_SHIFT)

    @cuda.jit(device=True, inline=True)
    def stage_floats(dst, dst_at, src, src_at, count, tid):
        """Start copying ``count`` (a multiple of 4) fp32 values into shared memory."""
        for i in range(tid, count >> 2, THREADS):
            copy_async_16(dst, dst_at + 4 * i, src, src_at + 4 * i)

    @cuda.jit(device=True, inline=True)
    def head_factors(sh_m, sh_l, sh_s, sh_f, sh_ml, owner, tid):
        """Thread ``g < G``: head g's warp states (``stash``) combined, in the block holding the new token
        with the new key as one more softmax term: each warp's factor into ``sh_f[warp, g]``, the new
        value's into ``sh_f[WARPS, g]``, the maximum and sum into ``sh_ml[g]``; then a block barrier.
        The exponentials once a head, not once a dimension (H100, ms a step against that: b1/512 5.288
        vs 5.298, b8/512 6.182 vs 6.195, b4/512 5.958 vs 5.947, b1/8192 5.709 vs 5.703)."""
        if tid < G:
            g = tid
            f = cuda.local.array(WARPS, float32)
            top, total = warp_factors(sh_m, sh_l, g, f)
            p = float32(0.0)
            if owner:
                s_new = sh_s[g]
                m_new = max(top, s_new)
                alpha = math.exp(top - m_new)
                p = math.exp(s_new - m_new)
                total = total * alpha + p
                top = m_new
                for w in range(WARPS):
                    f[w] *= alpha
            for w in range(WARPS):
                sh_f[w, g] = f[w]
            sh_f[WARPS, g] = p
            sh_ml[g, 0] = top
            sh_ml[g, 1] = total
        cuda.syncthreads()

    SLOTS = MAX_SPLITS // 32  # splits a lane weighs

    @cuda.jit(device=True, inline=True)
    def split_weights(part_ml, sh_w, sh_scale, head0, n_splits, active, warp, lane):
        """A warp a head: each split's weight ``exp(m - top)`` (``top``: the largest maximum of the
        head's splits with keys; 0 for a split without) into ``sh_w[g, split]`` and the scale of the
        head's weighted sum, ``1 / sum(w * l)``, into ``sh_scale[g]``."""
        for g in range(warp, G, WARPS):
            cell0 = (head0 + g) * n_splits
            ms = cuda.local.array(SLOTS, float32)
            ls = cuda.local.array(SLOTS, float32)
            for j in range(SLOTS):
                split = lane + 32 * j
                cell = cell0 + min(split, active - 1)
                ms[j] = part_ml[cell * 2]
                ls[j] = part_ml[cell * 2 + 1] if split < active else float32(0.0)
            top = NEG_BIG
            for j in range(SLOTS):
                if ls[j] > float32(0.0):
                    top = max(top, ms[j])
            top = warp_max(top)
            total = float32(0.0)
            for j in range(SLOTS):
                w = math.exp(ms[j] - top) if ls[j] > float32(0.0) else float32(0.0)
                sh_w[g, lane + 32 * j] = w
                total += w * ls[j]
            total = warp_sum(total)
            if lane == 0:
                sh_scale[g] = float32(1.0) / total

    @cuda.jit(device=True, inline=True)
    def merge_splits(part_o, part_ml, out, head0, n_splits, active, tid, sh_w, sh_scale):
        """The last block's merge of the ``active`` splits' partials of its heads ``head0 + g`` (cells
        ``(head0 + g) * n_splits + split``) into ``out``: the splits' weights first (``split_weights``,
        a block barrier), then a thread per 4 dims of a head sums the weighted partials, BATCH splits'
        loads in flight. An exponential per split and head, not per split and thread: the merge was
        bound by its instructions (H100, ms a step against each thread folding its splits with their
        exponentials: b1/512 5.376 vs 5.404, b8/512 6.368 vs 6.460, b1/8192 5.813 vs 5.897)."""
        split_weights(part_ml, sh_w, sh_scale, head0, n_splits, active, tid >> 5, tid & 31)
        cuda.syncthreads()
        for item in range(tid, G * QUADS, THREADS):
            g = item // QUADS
            d = (item - g * QUADS) * 4
            cell0 = (head0 + g) * n_splits
            o = cuda.local.array(4, float32)
            for i in range(4):
                o[i] = float32(0.0)
            pieces = cuda.local.array((BATCH, 4), float32)
            for sp0 in range(0, active, BATCH):
                for u in range(BATCH):
                    cell = cell0 + min(sp0 + u, active - 1)
                    pieces[u, 0], pieces[u, 1], pieces[u, 2], pieces[u, 3] = load_f32x4(part_o, cell * D + d)
                for u in range(BATCH):
                    w = sh_w[g, sp0 + u] if sp0 + u < active else float32(0.0)
                    for i in range(4):
                        o[i] += w * pieces[u, i]
            scale = sh_scale[g]
            for i in range(4):
                out[(head0 + g) * D + d + i] = o[i] * scale

    @cuda.jit(device=True, inline=True)
    def mark(trace, point):
        if TRACE and cuda.threadIdx.x == 0:
            block = (cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x + cuda.blockIdx.x
            trace[block * len(TRACE_POINTS) + point] = global_timer()

    @cuda.jit(device=True, inline=True)
    def body(qkv, bias, q_norm, k_norm, cos_t, sin_t, kc, kw, page_stride, page_tables, max_pages, row_table,
             positions, out, part_o, part_ml, counters, n_heads, n_kv, page_shift, split_ptr, n_splits, scale,
             has_bias, has_norm, eps, next_w, next_bytes, trace):
        # Rows 0..G-1: the query heads; G: the new key; G + 1: the new value.
        sh_x = cuda.shared.array((ROWS, D), float32)
        sh_inv = cuda.shared.array(ROPED, float32)
        sh_s = cuda.shared.array(G, float32)  # the new key's scores
        sh_m = cuda.shared.array((WARPS, G), float32)
        sh_l = cuda.shared.array((WARPS, G), float32)
        sh_o = cuda.shared.array((WARPS, G, D), float32)
        sh_last = cuda.shared.array(1, int32)
        sh_w = cuda.shared.array((G, MAX_SPLITS), float32)  # the split merge's weights
        sh_f = cuda.shared.array((FACTORS, G), float32)  # each warp's and the new value's factor a head
        sh_ml = cuda.shared.array((G, 2), float32)  # the block's maximum and sum a head
        sh_scale = cuda.shared.array(G, float32)  # and each head's 1 / total
        sh_kv = cuda.shared.array(KV_WORDS, uint32, alignment=16)
        sh_rope = cuda.shared.array(D, float32, alignment=16)  # cos, then sin, at the new position
        sh_norm = cuda.shared.array(NORMS, float32, alignment=16)  # q_norm, then k_norm
        kvh = cuda.blockIdx.x
        row = cuda.blockIdx.y
        split = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        # Latency-bound and few blocks: let the output projection's blocks come in at once (common.py,
        # "programmatic dependent launch"). Nothing the previous kernel writes is needed to find this
        # split's keys, and the keys already in the pool, the rotary tables and the norm weights are
        # not written in this step: start copying the split's first STAGE keys and those vectors into
        # shared memory, and (bit 0 of ``split_ptr[1]``) ask L2 for the rest, then
        # wait for the q/k/v. Launched in order, the copies still run under the q/k/v loads.
        mark(trace, 0)
        launch_dependents()
        pos = positions[row]
        length = pos + 1
        split_len = split_ptr[0]  # a step input, so one captured graph serves every context length
        start = split * split_len
        end = min(start + split_len, length)
        owner = end == length  # this block appends the new token's K/V
        old_end = end - 1 if owner else end  # the keys already in the pool
        staged = max(0, min(old_end - start, STAGE))
        table = row_table[row] * max_pages
        append_page = int64(page_tables[table + (pos >> page_shift)])  # where the new token's K/V go
        head_off = (int64(kvh) << page_shift) * D
        v_off = (int64(n_kv) << page_shift) * D
        if start < length:
            stage_keys(sh_kv, kc, page_stride, page_tables, table, page_shift, head_off, v_off, start, staged, tid)
            stage_floats(sh_rope, 0, cos_t, pos * HALF, HALF, tid)
            stage_floats(sh_rope, HALF, sin_t, pos * HALF, HALF, tid)
            if has_norm != 0:
                stage_floats(sh_norm, 0, q_norm, 0, D, tid)
                stage_floats(sh_norm, D, k_norm, 0, D, tid)
            rest = start + staged
            if (split_ptr[1] & 1) != 0 and rest < old_end:
                first = rest >> page_shift
                pages = ((old_end - 1) >> page_shift) - first + 1
                for i in range(tid, 2 * pages, THREADS):  # the K, then the V rows of each page
                    page = int64(page_tables[table + first + (i >> 1)])
                    at = page * page_stride + head_off + (i & 1) * v_off
                    prefetch_l2(kc, at >> WORD_SHIFT, (D << page_shift) * ITEM)
        mark(trace, 1)
        grid_dependency_wait()
        mark(trace, 2)
        if (split_ptr[1] & 2) != 0 and tid == 0:  # one request a block (one a thread stalled the warps)
            prefetch_block_share(next_w, next_bytes)
        if start >= length:
            return  # neither a ticket nor a partial: ``active`` counts only the splits that hold keys
        active = min(n_splits, (length + split_len - 1) // split_len)
        slots = G + 2 if owner else G
        width = (n_heads + 2 * n_kv) * D
        # Every load first, unconditionally (past the rows: the last value again), then the stores: a
        # load and its store inside one branch went out one at a time, each waiting for L2.
        loaded = cuda.local.array(QKV_LOADS, float32)
        for j in range(QKV_LOADS):
            idx = min(tid + j * THREADS, ROWS * D - 1)
            slot = idx // D
            d = idx % D
            col = (kvh * G + slot) * D + d if slot < G else (n_heads + (slot - G) * n_kv + kvh) * D + d
            loaded[j] = qkv[row * width + col] + (bias[col] if has_bias != 0 else float32(0.0))
        for j in range(QKV_LOADS):
            idx = tid + j * THREADS
            slot = idx // D
            if slot < slots:
                sh_x[slot, idx % D] = loaded[j]
        copy_async_wait()
        cuda.syncthreads()  # the q/k/v and every thread's staged copies
        mark(trace, 3)
        roped = G + 1 if owner else G  # q heads, then the key
        if has_norm != 0:
            for slot in range(warp, roped, WARPS):
                ss = row_dot(sh_x, slot, slot, lane)
                if lane == 0:
                    sh_inv[slot] = float32(1.0) / math.sqrt(ss / float32(D) + eps)
            cuda.syncthreads()
        slot_off = (int64(kvh) << page_shift) + (pos & ((1 << page_shift) - 1))
        k_dst = append_page * page_stride + slot_off * D
        v_dst = k_dst + v_off
        for idx in range(tid, roped * HALF, THREADS):
            slot = idx // HALF
            i = idx % HALF
            a = sh_x[slot, i]
            b = sh_x[slot, i + HALF]
            if has_norm != 0:
                inv = sh_inv[slot]
                at = 0 if slot < G else D
                a = a * inv * sh_norm[at + i]
                b = b * inv * sh_norm[at + i + HALF]
            c = sh_rope[i]
            s = sh_rope[HALF + i]
            a, b = a * c - b * s, b * c + a * s
            if slot == G:  # the new key: into the pool, and kept as the pool holds it
                store(kw, k_dst + i, a)
                store(kw, k_dst + i + HALF, b)
                a = as_stored(a)
                b = as_stored(b)
            sh_x[slot, i] = a
            sh_x[slot, i + HALF] = b
        if owner:
            for d in range(tid, D, THREADS):
                v = sh_x[G + 1, d]
                store(kw, v_dst + d, v)
                sh_x[G + 1, d] = as_stored(v)
        cuda.syncthreads()
        mark(trace, 4)
        if owner:
            for g in range(warp, G, WARPS):
                dot = row_dot(sh_x, g, G, lane)
                if lane == 0:
                    sh_s[g] = dot * scale
        key_phase(sh_x, sh_kv, sh_m, sh_l, sh_o, kc, page_stride, page_tables, table, page_shift, head_off, v_off,
                  start, staged, old_end, warp, lane, scale)  # syncs the block (sh_s too)
        mark(trace, 5)
        head_factors(sh_m, sh_l, sh_s, sh_f, sh_ml, owner, tid)  # syncs the block
        for idx in range(tid, G * D, THREADS):
            g = idx // D
            d = idx % D
            oo = sh_f[WARPS, g] * sh_x[G + 1, d] if owner else float32(0.0)  # the new value's term
            for w in range(WARPS):
                oo += sh_f[w, g] * sh_o[w, g, d]
            h = kvh * G + g
            if active == 1:
                out[(row * n_heads + h) * D + d] = oo / sh_ml[g, 1]
            else:
                cell = (row * n_heads + h) * n_splits + split
                part_o[cell * D + d] = oo
                if d == 0:
                    part_ml[cell * 2] = sh_ml[g, 0]
                    part_ml[cell * 2 + 1] = sh_ml[g, 1]
        mark(trace, 6)
        if active == 1:
            return
        # The last block to finish merges: publish this block's partial, then take a ticket (the barrier and
        # the acquire-release atomic order the partials; fences by every thread measured 0.1-0.35% slower).
        cuda.syncthreads()
        if tid == 0:
            ticket = ticket_acq_rel(counters, row * n_kv + kvh)
            sh_last[0] = int32(ticket == active - 1)
            if ticket == active - 1:
                counters[row * n_kv + kvh] = 0  # every other split has its ticket: ready for the next launch
        cuda.syncthreads()
        mark(trace, 7)
        if sh_last[0] == 0:
            return
        merge_splits(part_o, part_ml, out, row * n_heads + kvh * G, n_splits, active, tid, sh_w, sh_scale)
        mark(trace, 8)

    def decode_attention(qkv, bias, q_norm, k_norm, cos_t, sin_t, kc, kw, page_stride, page_tables, max_pages,
                         row_table, positions, out, part_o, part_ml, counters, n_heads, n_kv, page_shift, split_ptr,
                         n_splits, scale, has_bias, has_norm, eps, next_w, next_bytes):
        body(qkv, bias, q_norm, k_norm, cos_t, sin_t, kc, kw, page_stride, page_tables, max_pages, row_table,
             positions, out, part_o, part_ml, counters, n_heads, n_kv, page_shift, split_ptr, n_splits, scale,
             has_bias, has_norm, eps, next_w, next_bytes, counters)

    def decode_attention_traced(qkv, bias, q_norm, k_norm, cos_t, sin_t, kc, kw, page_stride, page_tables, max_pages,
                                row_table, positions, out, part_o, part_ml, counters, n_heads, n_kv, page_shift,
                                split_ptr, n_splits, scale, has_bias, has_norm, eps, next_w, next_bytes, trace):
        body(qkv, bias, q_norm, k_norm, cos_t, sin_t, kc, kw, page_stride, page_tables, max_pages, row_table,
             positions, out, part_o, part_ml, counters, n_heads, n_kv, page_shift, split_ptr, n_splits, scale,
             has_bias, has_norm, eps, next_w, next_bytes, trace)

    return decode_attention_traced if TRACE else decode_attention


POOLS = {"bf16": (U32P, U16P, store_bf16, as_stored_bf16, 2), "f32": (F32P, F32P, store_f32, as_stored_f32, 4)}
TC_WARPS = 4  # warps a block, tensor-core key phase (164 registers: 3 blocks an SM)
CUDA_WARPS = 4  # and CUDA-core key phase


def signature(dtype: str) -> tuple:
    read, write = POOLS[dtype][:2]
    return (F32P, F32P, F32P, F32P, F32P, F32P, read, write, int64, I32P, int32, I32P, I32P, F32P, F32P, F32P,
            I32P, int32, int32, int32, I32P, int32, float32, int32, int32, float32, U32P, int32)


KERNELS = {}
for _g, _d in VARIANTS:
    for _dtype in POOLS:
        KERNELS[f"decode_attention_g{_g}_d{_d}_{_dtype}"] = (
            make_decode_attention(_g, _d, _dtype), signature(_dtype),
            {"threads": 32 * (TC_WARPS if _dtype == "bf16" else CUDA_WARPS), "grid_wait": 1, "max_splits": MAX_SPLITS})
