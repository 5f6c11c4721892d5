"""Gated full attention of the hybrid models: q/k preparation, paged attention, gated combine.

The attention layer's projection row holds, per query head, ``D`` query then ``D`` gate values,
then the K and V heads (``ninfer.models.hybrid``). The kernels:

``gated_qk_rope_{bf16|f32}``: grid ``(rows, n_heads + 2 n_kv)``, block ``D`` threads (one per
dim, D in 32..256). Query heads: the gate goes to ``gate_out [rows, n_heads * D]``, the query
through its RMSNorm (weight ``1 + w`` folded at upload) and RoPE on the first ``2 * rot_half``
dims (rotate-half within them) into ``q_out``, whose rows are ``(n_heads + 2 n_kv) * D`` wide
with head ``h`` at ``h * D``: the dense qkv layout that ``prefill_attention.py`` reads too. K heads: RMSNorm and RoPE into
the KV page; V heads: into the page as they are. Pool layout as ``rope.py``'s.

``gated_attention_d{D}_{bf16|f32}``: grid ``(n_heads, rows, n_splits)``, block 128 (4 warps).
One block per query head (any GQA group size, as 6 in Qwen3.6-27B), keys of one split; each warp
walks every 4th key, KEYS at a time (their page lookups and loads all out before it scores the
first), lanes own ``D / 32`` dims, scores warp-reduced and folded into an online
softmax; the warps merge and write the unnormalised partial (``o``, max, sum) in the
``attention.py`` layout. The split length is a step input (device memory), so one captured graph
serves every context; blocks past a row's length exit at once. ``gated_attention_merged_d{D}``:
the same, its last split block of each (row, head) merging. ``gated_attention_roped_d{D}`` (head
dims 32 and 256): a decode step's ``gated_qk_rope`` and ``gated_attention`` in one launch
(``make_roped_attention``).

``gated_combine``: grid ``(n_heads, rows)``, block ``D``: merges the splits of each (row, head) (their
loads in groups: ``merge_splits``)
and multiplies by ``sigmoid(gate)``, giving the input of the ``o`` projection.

``sigmoid_gate``: ``out[i] = x[i] * sigmoid(gate[i])``, for attention that wrote its output
whole (the tensor-core prefill kernel). Grid ``(ceil(count / 256),)``, block 256.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64

from numba_kernels.common import (F32P, I32P, NEG_BIG, U16P, block_sum, grid_dependency_wait, last_to_finish,
                                  launch_dependents, warp_sum)
from numba_kernels.decode_attention import as_stored_bf16, as_stored_f32
from numba_kernels.deltanet import sigmoid
from numba_kernels.rope import load_bf16, load_f32, store_bf16, store_f32

HEAD_DIMS = (32, 64, 128, 256)
ROPED_HEAD_DIMS = (32, 256)  # gated_attention_roped's builds: the spec models' head dim and the tests'
MAX_HEAD_DIM = 256
WARPS = 4
KEYS = 4  # keys a warp of gated_attention loads before it scores any: one latency for four


def make_qk_rope(store):
    def qk_rope(qkv, q_out, gate_out, q_norm, k_norm, cos_t, sin_t, kc, page_stride, page_tables,
                max_pages, row_table, positions, n_heads, n_kv, head_dim, rot_half, page_size, eps):
        sh = cuda.shared.array(MAX_HEAD_DIM, float32)
        scratch = cuda.shared.array(32, float32)
        row = int64(cuda.blockIdx.x)
        head = cuda.blockIdx.y
        i = cuda.threadIdx.x
        width = 2 * (n_heads + n_kv) * head_dim
        is_q = head < n_heads
        is_v = head >= n_heads + n_kv
        # What no kernel of the step writes (the position, its rotary entry, the norm weight, the KV page)
        # is loaded before the wait for the q/k/v GEMM, and before the trigger: ptxas keeps loads that
        # precede it there (common.py, "programmatic dependent launch").
        pos = positions[row]
        weight, c, s = float32(0.0), float32(1.0), float32(0.0)
        if not is_v:
            weight = q_norm[i] if is_q else k_norm[i]
            if i < 2 * rot_half:
                at = pos * rot_half + (i if i < rot_half else i - rot_half)
                c = cos_t[at]
                s = sin_t[at]
        page = int64(0)
        if not is_q:
            page = int64(page_tables[row_table[row] * max_pages + pos // page_size])
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
        if is_q:
            src = row * width + head * 2 * head_dim + i
            gate_out[row * n_heads * head_dim + head * head_dim + i] = qkv[src + head_dim]
        else:
            src = row * width + 2 * n_heads * head_dim + (head - n_heads) * head_dim + i
        x = qkv[src]
        if not is_v:  # uniform per block, so every thread of it reaches the block_sum
            total = block_sum(x * x, scratch)
            inv = float32(1.0) / math.sqrt(total / float32(head_dim) + eps)
            x = (x * inv) * weight
            sh[i] = x
            cuda.syncthreads()
            if i < rot_half:
                x = x * c - sh[i + rot_half] * s
            elif i < 2 * rot_half:
                x = x * c + sh[i - rot_half] * s
        if is_q:
            q_out[row * (n_heads + 2 * n_kv) * head_dim + head * head_dim + i] = x
            return
        slot = pos % page_size
        kv_head = head - n_heads
        base = page * page_stride
        if is_v:
            kv_head -= n_kv
            base += int64(n_kv) * page_size * head_dim
        store(kc, base + (int64(kv_head) * page_size + slot) * head_dim + i, x)

    return qk_rope


def make_split_pieces(D):
    """(fold_round, write_partial): a warp's online softmax over one round of KEYS keys already in
    registers, and the block's warps merged into its split's cell of ``part_o`` / ``part_ml``."""
    E = D // 32  # dims per lane

    @cuda.jit(device=True, inline=True)
    def fold_round(q, keys, values, scores, acc, m, l, first, end, scale):
        """Keys ``first, first + WARPS, ...`` (those at or past ``end`` weigh 0) into the warp's state;
        returns the new maximum and sum."""
        for g in range(KEYS):
            dot = float32(0.0)
            for e in range(E):
                dot += q[e] * keys[g, e]
            scores[g] = warp_sum(dot) * scale if first + g * WARPS < end else NEG_BIG
        m_new = m
        for g in range(KEYS):
            m_new = max(m_new, scores[g])
        alpha = math.exp(m - m_new)
        l *= alpha
        for e in range(E):
            acc[e] *= alpha
        for g in range(KEYS):
            p = math.exp(scores[g] - m_new)
            l += p
            for e in range(E):
                acc[e] += p * values[g, e]
        return m_new, l

    @cuda.jit(device=True, inline=True)
    def write_partial(acc, m, l, warp, lane, part_o, part_ml, row, h, n_heads, n_splits, split):
        """The block's warps' states merged (a block barrier) into the cell of (row, head h, split)."""
        sh_m = cuda.shared.array(WARPS, float32)
        sh_l = cuda.shared.array(WARPS, float32)
        sh_o = cuda.shared.array((WARPS, D), float32)
        if lane == 0:
            sh_m[warp] = m
            sh_l[warp] = l
        for e in range(E):
            sh_o[warp, lane * E + e] = acc[e]
        cuda.syncthreads()
        for d in range(cuda.threadIdx.x, D, WARPS * 32):
            mm = NEG_BIG
            for w in range(WARPS):
                mm = max(mm, sh_m[w])
            ll = float32(0.0)
            oo = float32(0.0)
            for w in range(WARPS):
                f = math.exp(sh_m[w] - mm) if sh_l[w] > float32(0.0) else float32(0.0)
                ll += sh_l[w] * f
                oo += sh_o[w, d] * f
            cell = (row * n_heads + h) * n_splits + split
            part_o[cell * D + d] = oo
            if d == 0:
                part_ml[cell * 2] = mm
                part_ml[cell * 2 + 1] = ll

    return fold_round, write_partial


def make_attention(D, load, merged: bool = False):
    """``gated_attention_d{D}``; ``merged``: ``gated_attention_merged_d{D}``, whose last block of each
    (row, head) to finish its split (a ticket in ``tickets[row * n_heads + head]``, zero between
    launches) merges the row's splits with the gate as ``gated_combine`` does, bit for bit: one launch
    a decode attention layer fewer (three more arguments, ``out, gate, tickets``)."""
    E = D // 32  # dims per lane
    fold_round, write_partial = make_split_pieces(D)

    @cuda.jit(device=True, inline=True)
    def partials(q_in, kc, page_stride, page_tables, max_pages, row_table, positions, part_o, part_ml,
                 n_heads, n_kv, page_shift, split_ptr, n_splits, scale):
        """The block's split of keys into its cell of ``part_o`` / ``part_ml``; False if the split is
        past the row's keys (the block has nothing to do)."""
        h = cuda.blockIdx.x
        row = cuda.blockIdx.y
        split = cuda.blockIdx.z
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        length = positions[row] + 1
        split_len = split_ptr[0]
        start = split * split_len
        if start >= length:
            return False
        end = min(start + split_len, length)
        kvh = h // (n_heads // n_kv)
        q = cuda.local.array(E, float32)
        acc = cuda.local.array(E, float32)
        for e in range(E):
            q[e] = q_in[(int64(row) * (n_heads + 2 * n_kv) + h) * D + lane * E + e]
            acc[e] = float32(0.0)
        m = NEG_BIG
        l = float32(0.0)
        table = row_table[row] * max_pages
        page_mask = (int64(1) << page_shift) - 1
        head_off = int64(kvh) * (page_mask + 1) * D + lane * E
        v_off = int64(n_kv) * (page_mask + 1) * D
        at = cuda.local.array(KEYS, int64)
        keys = cuda.local.array((KEYS, E), float32)
        values = cuda.local.array((KEYS, E), float32)
        scores = cuda.local.array(KEYS, float32)
        first = start + warp
        while first < end:  # keys first, first + WARPS, ... (KEYS of them), loaded before any is used
            for g in range(KEYS):
                t = min(first + g * WARPS, end - 1)  # past the split: a valid key, weighed 0 below
                at[g] = int64(page_tables[table + (t >> page_shift)]) * page_stride + head_off + (t & page_mask) * D
            for g in range(KEYS):
                for e in range(E):
                    keys[g, e] = load(kc, at[g] + e)
                    values[g, e] = load(kc, at[g] + v_off + e)
            m, l = fold_round(q, keys, values, scores, acc, m, l, first, end, scale)
            first += KEYS * WARPS
        write_partial(acc, m, l, warp, lane, part_o, part_ml, row, h, n_heads, n_splits, split)
        return True

    if not merged:
        def attention(q_in, kc, page_stride, page_tables, max_pages, row_table, positions, part_o, part_ml,
                      n_heads, n_kv, page_shift, split_ptr, n_splits, scale):
            launch_dependents()  # programmatic dependent launch: common.py
            grid_dependency_wait()
            partials(q_in, kc, page_stride, page_tables, max_pages, row_table, positions, part_o, part_ml,
                     n_heads, n_kv, page_shift, split_ptr, n_splits, scale)

        return attention

    def attention_merged(q_in, kc, page_stride, page_tables, max_pages, row_table, positions, part_o, part_ml,
                         n_heads, n_kv, page_shift, split_ptr, n_splits, scale, out, gate, tickets):
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
        if not partials(q_in, kc, page_stride, page_tables, max_pages, row_table, positions, part_o, part_ml,
                        n_heads, n_kv, page_shift, split_ptr, n_splits, scale):
            return  # no ticket: the row's splits are those with keys
        h = cuda.blockIdx.x
        row = cuda.blockIdx.y
        active = splits_with_keys(positions[row], split_ptr[0], n_splits)
        if last_to_finish(tickets, row * n_heads + h, active):  # every split's partial is out
            for d in range(cuda.threadIdx.x, D, WARPS * 32):
                merge_splits(out, gate, part_o, part_ml, row, h, active, n_heads, n_splits, D, d)

    return attention_merged


def make_roped_attention(D, load, store, as_stored):
    """``gated_attention_roped_d{D}``: a decode step's ``gated_qk_rope`` and ``gated_attention`` in one launch
    (every row its own sequence, adding one key), the same grid, block and results bit for bit. Before
    the grid wait a block loads what no kernel of the step writes: its dims' norm weights and rotary
    entries, the new token's page, and its warps' first round of keys (the new token's slot too, whose
    stale value is never used). After it: the query head (and its gate, by the split-0 block, into
    ``gate_out`` for ``gated_combine``) and, where the split holds the new token, its K and V head, all
    from the projection row; the norms summed as ``block_sum`` over a thread a dim sums them (a warp a
    32-dim chunk, the chunks in order), RoPE on the first ``2 * rot_half`` dims; the block of the head's
    group's first query head appends K and V to the pool, and every block folds the new key from shared
    memory (as the pool holds it) in its place among the keys. Arguments: ``gated_attention``'s, the
    projection ``qkv`` in place of q, then ``gate_out, q_norm, k_norm, cos, sin, rot_half, eps``."""
    E = D // 32  # dims per lane
    THREADS = WARPS * 32
    DIMS = -(-D // THREADS)  # dims a thread normalises and rotates
    CHUNKS = D // 32
    fold_round, write_partial = make_split_pieces(D)

    @cuda.jit(device=True, inline=True)
    def normalised(x, weight, sh, scratch, eps):
        """``x * (1 / rms) * weight`` of a head (a thread's DIMS dims of it; block-uniform call) into
        ``sh``, summed as ``gated_qk_rope``'s block of D threads sums; then a block barrier."""
        warp = cuda.threadIdx.x >> 5
        for j in range(DIMS):
            if warp + j * WARPS < CHUNKS:
                total = warp_sum(x[j] * x[j])
                if cuda.threadIdx.x & 31 == 0:
                    scratch[warp + j * WARPS] = total
        cuda.syncthreads()
        total = float32(0.0)
        for c in range(CHUNKS):
            total += scratch[c]
        inv = float32(1.0) / math.sqrt(total / float32(D) + eps)
        for j in range(DIMS):
            d = cuda.threadIdx.x + j * THREADS
            if d < D:
                sh[d] = (x[j] * inv) * weight[j]
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def load_round(kc, page_tables, table, page_stride, page_shift, head_off, v_off, first, end, lane, at, keys,
                   values):
        """The lane's dims of keys ``first, first + WARPS, ...`` (KEYS of them; past the split: its last key)."""
        page_mask = (int64(1) << page_shift) - 1
        for g in range(KEYS):
            t = min(first + g * WARPS, end - 1)
            at[g] = int64(page_tables[table + (t >> page_shift)]) * page_stride + head_off + (t & page_mask) * D
        for g in range(KEYS):
            for e in range(E):
                keys[g, e] = load(kc, at[g] + lane * E + e)
                values[g, e] = load(kc, at[g] + v_off + lane * E + e)

    @cuda.jit(device=True, inline=True)
    def rotated(sh, d, c, s, rot_half):
        """Dim ``d`` of the normalised head in ``sh`` after RoPE (``gated_qk_rope``'s arithmetic)."""
        if d < rot_half:
            return sh[d] * c - sh[d + rot_half] * s
        if d < 2 * rot_half:
            return sh[d] * c + sh[d - rot_half] * s
        return sh[d]

    def roped(qkv, kc, page_stride, page_tables, max_pages, row_table, positions, part_o, part_ml, n_heads, n_kv,
              page_shift, split_ptr, n_splits, scale, gate_out, q_norm, k_norm, cos_t, sin_t, rot_half, eps):
        sh_x = cuda.shared.array(D, float32)  # a normalised head
        sh_q = cuda.shared.array(D, float32)
        sh_k = cuda.shared.array(D, float32)  # the new key and value, as the pool holds them
        sh_v = cuda.shared.array(D, float32)
        scratch = cuda.shared.array(32, float32)
        h = cuda.blockIdx.x
        row = cuda.blockIdx.y
        split = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        pos = positions[row]
        length = pos + 1
        start = split * split_ptr[0]
        if start >= length:
            return  # no keys: no partial (an exited block counts as triggered)
        end = min(start + split_ptr[0], length)
        owner = end == length  # the split holding the new token
        group = n_heads // n_kv
        kvh = h // group
        table = row_table[row] * max_pages
        page_mask = (int64(1) << page_shift) - 1
        head_off = int64(kvh) * (page_mask + 1) * D
        v_off = int64(n_kv) * (page_mask + 1) * D
        # What no kernel of the step writes, before the trigger (ptxas keeps such loads before the wait).
        wq = cuda.local.array(DIMS, float32)
        wk = cuda.local.array(DIMS, float32)
        cs = cuda.local.array(DIMS, float32)
        sn = cuda.local.array(DIMS, float32)
        for j in range(DIMS):
            d = min(tid + j * THREADS, D - 1)
            wq[j] = q_norm[d]
            wk[j] = k_norm[d]
            r = min(d if d < rot_half else d - rot_half, rot_half - 1)
            cs[j] = cos_t[pos * rot_half + r]
            sn[j] = sin_t[pos * rot_half + r]
        new_at = int64(page_tables[table + (pos >> page_shift)]) * page_stride + head_off + (pos & page_mask) * D
        at = cuda.local.array(KEYS, int64)
        keys = cuda.local.array((KEYS, E), float32)
        values = cuda.local.array((KEYS, E), float32)
        scores = cuda.local.array(KEYS, float32)
        first = start + warp
        load_round(kc, page_tables, table, page_stride, page_shift, head_off, v_off, first, end, lane, at, keys,
                   values)  # the warp's first round
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
        width = int64(2 * (n_heads + n_kv) * D)
        q_at = row * width + 2 * h * D
        k_at = row * width + (2 * n_heads + kvh) * D
        x = cuda.local.array(DIMS, float32)
        xk = cuda.local.array(DIMS, float32)
        xv = cuda.local.array(DIMS, float32)
        for j in range(DIMS):  # every load first
            d = min(tid + j * THREADS, D - 1)
            x[j] = qkv[q_at + d]
            xk[j] = qkv[k_at + d]
            xv[j] = qkv[k_at + n_kv * D + d]
        if split == 0:
            for d in range(tid, D, THREADS):
                gate_out[(row * n_heads + h) * D + d] = qkv[q_at + D + d]
        normalised(x, wq, sh_x, scratch, eps)
        for j in range(DIMS):
            d = tid + j * THREADS
            if d < D:
                sh_q[d] = rotated(sh_x, d, cs[j], sn[j], rot_half)
        if owner:  # block-uniform
            cuda.syncthreads()  # sh_x is read: it takes the key next
            normalised(xk, wk, sh_x, scratch, eps)
            writes = h == kvh * group  # the group's first head appends
            for j in range(DIMS):
                d = tid + j * THREADS
                if d < D:
                    k = rotated(sh_x, d, cs[j], sn[j], rot_half)
                    if writes:
                        store(kc, new_at + d, k)
                        store(kc, new_at + v_off + d, xv[j])
                    sh_k[d] = as_stored(k)
                    sh_v[d] = as_stored(xv[j])
        cuda.syncthreads()
        q = cuda.local.array(E, float32)
        acc = cuda.local.array(E, float32)
        for e in range(E):
            q[e] = sh_q[lane * E + e]
            acc[e] = float32(0.0)
        m = NEG_BIG
        l = float32(0.0)
        loaded = True
        while first < end:  # as gated_attention's loop, the new key from shared memory
            if not loaded:
                load_round(kc, page_tables, table, page_stride, page_shift, head_off, v_off, first, end, lane, at,
                           keys, values)
            loaded = False
            for g in range(KEYS):
                if min(first + g * WARPS, end - 1) == pos:
                    for e in range(E):
                        keys[g, e] = sh_k[lane * E + e]
                        values[g, e] = sh_v[lane * E + e]
            m, l = fold_round(q, keys, values, scores, acc, m, l, first, end, scale)
            first += KEYS * WARPS
        write_partial(acc, m, l, warp, lane, part_o, part_ml, row, h, n_heads, n_splits, split)

    return roped


@cuda.jit(device=True, inline=True)
def splits_with_keys(position, split_len, n_splits):
    """The splits of a row whose last key is at ``position`` that hold keys."""
    return min(n_splits, (position + split_len) // split_len)


MERGE_GROUP = 8  # splits whose partials merge_splits loads before it uses any (their loads overlap)


@cuda.jit(device=True, inline=True)
def merge_splits(out, gate, part_o, part_ml, row, h, active, n_heads, n_splits, head_dim, d):
    """Dim ``d`` of (row, head): the ``active`` splits' partials merged, times ``sigmoid(gate)``. Every
    split's max first, then the sums rescaled to it, each pass over groups of MERGE_GROUP splits whose
    loads go out together (a split past ``active`` rereads the last one, and weighs 0): a step at 512
    keys has 16 splits a row, which one dependent load after another took 6.7 us to merge."""
    cell0 = (row * n_heads + h) * n_splits
    last = active - 1
    mm = NEG_BIG
    for g in range(0, active, MERGE_GROUP):
        for j in range(MERGE_GROUP):
            sp = min(g + j, last)
            if part_ml[(cell0 + sp) * 2 + 1] > float32(0.0):  # a split with keys
                mm = max(mm, part_ml[(cell0 + sp) * 2])
    ll = float32(0.0)
    oo = float32(0.0)
    for g in range(0, active, MERGE_GROUP):
        for j in range(MERGE_GROUP):
            sp = min(g + j, last)
            m_sp = part_ml[(cell0 + sp) * 2]
            l_sp = part_ml[(cell0 + sp) * 2 + 1]
            o_sp = part_o[(cell0 + sp) * head_dim + d]
            b = math.exp(m_sp - mm) if g + j <= last and l_sp > float32(0.0) else float32(0.0)
            ll += l_sp * b
            oo += o_sp * b
    index = (row * n_heads + h) * head_dim + d
    out[index] = oo / ll * sigmoid(gate[index])


def gated_combine(out, gate, part_o, part_ml, positions, n_heads, n_splits, head_dim, split_ptr):
    launch_dependents()  # programmatic dependent launch: common.py
    grid_dependency_wait()
    row = cuda.blockIdx.y
    active = splits_with_keys(positions[row], split_ptr[0], n_splits)
    merge_splits(out, gate, part_o, part_ml, row, cuda.blockIdx.x, active, n_heads, n_splits, head_dim,
                 cuda.threadIdx.x)


def sigmoid_gate(out, x, gate, count):
    i = cuda.grid(1)
    if i < count:
        out[i] = x[i] * sigmoid(gate[i])


def _rope_signature(pool):
    return (F32P, F32P, F32P, F32P, F32P, F32P, F32P, pool, int64, I32P, int32, I32P, I32P,
            int32, int32, int32, int32, int32, float32)


def _attention_signature(pool):
    return (F32P, pool, int64, I32P, int32, I32P, I32P, F32P, F32P, int32, int32, int32, I32P, int32, float32)


KERNELS = {
    "gated_qk_rope_bf16": (make_qk_rope(store_bf16), _rope_signature(U16P), {"grid_wait": 1}),
    "gated_qk_rope_f32": (make_qk_rope(store_f32), _rope_signature(F32P), {"grid_wait": 1}),
    "gated_combine": (gated_combine, (F32P, F32P, F32P, F32P, I32P, int32, int32, int32, I32P), {"grid_wait": 1}),
    "sigmoid_gate": (sigmoid_gate, (F32P, F32P, F32P, int32)),
}
for _d in HEAD_DIMS:
    for _pool, _load, _ptr, _store, _stored in (("bf16", load_bf16, U16P, store_bf16, as_stored_bf16),
                                                ("f32", load_f32, F32P, store_f32, as_stored_f32)):
        if _d in ROPED_HEAD_DIMS:
            KERNELS[f"gated_attention_roped_d{_d}_{_pool}"] = (
                make_roped_attention(_d, _load, _store, _stored),
                _attention_signature(_ptr) + (F32P, F32P, F32P, F32P, F32P, int32, float32),
                {"threads": WARPS * 32, "grid_wait": 1})
        KERNELS[f"gated_attention_d{_d}_{_pool}"] = (make_attention(_d, _load), _attention_signature(_ptr),
                                                     {"threads": WARPS * 32, "grid_wait": 1})
        KERNELS[f"gated_attention_merged_d{_d}_{_pool}"] = (
            make_attention(_d, _load, merged=True), _attention_signature(_ptr) + (F32P, F32P, I32P),
            {"threads": WARPS * 32, "grid_wait": 1})
