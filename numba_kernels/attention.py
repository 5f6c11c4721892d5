"""Paged attention over the KV pool for rows of prefill chunks (split-K, GQA).

Each query row ``r`` attends causally to positions ``0..positions[r]`` of the sequence whose page
table is ``page_tables[row_table[r]]`` (its own K/V are already in the pool: ``rope_kv`` ran first),
so rows of one sequence may share a launch. Decode steps use ``decode_attention.py``, which reuses
this module's key loop and warp merge (``make_key_loop``, ``make_warp_merge``).

``attention_g{G}_d{D}_{bf16|f32}`` (the KV pool's dtype): grid ``(kv_heads, rows, n_splits)``, block 128 (4 warps). A block takes the
``G`` query heads sharing one KV head and the keys ``[split * split_len, ...)`` of one row (``split_len``
is read from device memory: the runner picks it per step, the grid covers the shortest split); each warp
walks every 4th key, lanes own ``D / 32`` dims, the ``G`` dot products are warp-reduced and folded
into an online softmax. The block writes an unnormalised partial (``o``, max ``m``, sum ``l``) per
(row, head, split). ``G`` and ``D`` are compile-time so the per-lane arrays stay in registers.
A captured graph launches a fixed grid; blocks of splits past a row's length exit at once.

Pages hold ``2**page_shift`` tokens (the launcher passes the shift, not the size).

``attention_combine``: grid ``(n_heads, rows)``, block ``4 * D``: four groups of ``D`` threads
merge every 4th active split each (online softmax), then the groups merge in shared memory.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64

from numba_kernels.common import F32P, I32P, U32P, NEG_BIG, bf16_hi, bf16_lo, load_f32x4, load_u32x2

WARPS = 4
VARIANTS = [(g, d) for d in (64, 128) for g in (1, 2, 4, 8)]


@cuda.jit(device=True, inline=True)
def load_pair_bf16(pool, element):
    """Elements ``element`` and ``element + 1`` (even) of a bf16 pool read as one uint32."""
    word = pool[element >> 1]
    return bf16_lo(word), bf16_hi(word)


@cuda.jit(device=True, inline=True)
def load_pair_f32(pool, element):
    return pool[element], pool[element + 1]


@cuda.jit(device=True, inline=True)
def load_quad_bf16(pool, element):
    """Four bf16 (``element`` a multiple of 4) in one 8-byte load."""
    w0, w1 = load_u32x2(pool, element >> 1)
    return bf16_lo(w0), bf16_hi(w0), bf16_lo(w1), bf16_hi(w1)


@cuda.jit(device=True, inline=True)
def load_quad_f32(pool, element):
    return load_f32x4(pool, element)


def keys_in_flight(G, D):
    """Keys a warp loads per step by default: 4, or 2 for the widest groups (registers)."""
    return 2 if G * D > 512 else 4


def make_key_fold(G, D, U):
    """A device function folding ``U`` keys' K and V rows (``kb``, ``vb``: the lane's ``D / 32`` dims of
    each; keys ``t0 + u`` at or past ``end`` get no weight) into one warp's online softmax state
    (``acc``, ``m``, ``l`` per query head of the group) for the query ``q``. ``s`` and ``vals`` are the
    caller's scratch (``[U, G]`` and ``[U * G]`` local arrays)."""
    E = D // 32
    NV = U * G  # scores per warp step, a power of two <= 32
    LOG = NV.bit_length() - 1

    @cuda.jit(device=True, inline=True)
    def fold(q, acc, m, l, kb, vb, s, vals, t0, end, lane, scale):
        # U * G dot products, reduced over the warp by a transposing butterfly: each step
        # sends half of the values and keeps the other half, so NV values cost
        # NV - 1 + (5 - LOG) shuffles plus NV broadcasts instead of 5 * NV.
        for u in range(U):
            for g in range(G):
                v = float32(0.0)
                for e in range(E):
                    v += q[g, e] * kb[u, e]
                vals[u * G + g] = v
        for step in range(LOG):
            half = NV >> (step + 1)
            upper = (lane >> (4 - step)) & 1
            for i in range(half):
                a = vals[i]
                b = vals[i + half]
                send = a if upper else b
                keep = b if upper else a
                vals[i] = keep + cuda.shfl_xor_sync(0xFFFFFFFF, send, 16 >> step)
        total = vals[0]
        for step in range(LOG, 5):
            total += cuda.shfl_xor_sync(0xFFFFFFFF, total, 16 >> step)
        # Lane l now holds value (l >> (5 - LOG)); every lane needs all of them.
        for u in range(U):
            for g in range(G):
                v = cuda.shfl_sync(0xFFFFFFFF, total, (u * G + g) << (5 - LOG))
                # The reference scales the scores, not q; missing keys get no weight.
                s[u, g] = v * scale if t0 + u < end else NEG_BIG
        for g in range(G):
            m_new = m[g]
            for u in range(U):
                m_new = max(m_new, s[u, g])
            alpha = math.exp(m[g] - m_new)
            total = l[g] * alpha
            for e in range(E):
                acc[g, e] *= alpha
            for u in range(U):
                p = math.exp(s[u, g] - m_new) if t0 + u < end else float32(0.0)
                total += p
                for e in range(E):
                    acc[g, e] += p * vb[u, e]
            l[g] = total
            m[g] = m_new

    return fold


def make_key_loop(G, D, load_pair, load_quad, U, WARPS):
    """A device function folding one warp's share of the keys ``[start, end)``, read from the paged
    pool, into its online softmax state (``make_key_fold``)."""
    E = D // 32  # dims per lane (even: D is a multiple of 64)
    EW = E // 2  # uint32 words per lane
    QUADS = E % 4 == 0  # D = 128: each lane's K (and V) slice of a key is one vector load
    NV = U * G
    fold = make_key_fold(G, D, U)

    @cuda.jit(device=True, inline=True)
    def key_loop(q, acc, m, l, kc, page_stride, page_tables, table, page_shift, head_off, v_off, start, end,
                 warp, lane, scale):
        s = cuda.local.array((U, G), float32)
        vals = cuda.local.array(NV, float32)
        kb = cuda.local.array((U, E), float32)
        vb = cuda.local.array((U, E), float32)
        # Pages hold 2**page_shift tokens: shifts and masks instead of the 64-bit divisions that
        # `t // page_size` compiles to (tens of instructions per key in an issue-bound loop).
        page_mask = (int64(1) << page_shift) - 1
        # Each warp takes U consecutive keys per step and issues all their K and V loads before
        # any arithmetic: the per-key chain (page lookup -> load -> reduce) overlaps U ways.
        for t0 in range(start + warp * U, end, WARPS * U):
            for u in range(U):
                t = t0 + u
                if t < end:
                    page = int64(page_tables[table + (t >> page_shift)])
                    kbase = page * page_stride + head_off + (t & page_mask) * D + lane * E
                    if QUADS:
                        for qd in range(E // 4):
                            k0, k1, k2, k3 = load_quad(kc, kbase + 4 * qd)
                            v0, v1, v2, v3 = load_quad(kc, kbase + v_off + 4 * qd)
                            kb[u, 4 * qd] = k0
                            kb[u, 4 * qd + 1] = k1
                            kb[u, 4 * qd + 2] = k2
                            kb[u, 4 * qd + 3] = k3
                            vb[u, 4 * qd] = v0
                            vb[u, 4 * qd + 1] = v1
                            vb[u, 4 * qd + 2] = v2
                            vb[u, 4 * qd + 3] = v3
                    else:
                        for w in range(EW):
                            k0, k1 = load_pair(kc, kbase + 2 * w)
                            kb[u, 2 * w] = k0
                            kb[u, 2 * w + 1] = k1
                            v0, v1 = load_pair(kc, kbase + v_off + 2 * w)
                            vb[u, 2 * w] = v0
                            vb[u, 2 * w + 1] = v1
                else:
                    for e in range(E):
                        kb[u, e] = float32(0.0)
                        vb[u, e] = float32(0.0)
            fold(q, acc, m, l, kb, vb, s, vals, t0, end, lane, scale)

    return key_loop


def make_warp_merge(G, D, WARPS):
    """Device functions over a warp's softmax state (``acc`` [G, D / 32] of the lane's dims, max ``m``
    and sum ``l`` per head): ``empty`` starts it, ``stash`` writes it to shared memory (then syncs the
    block), ``warp_factors`` weighs the stashed states of head g (once a head: the exponentials do not
    depend on the dim)."""
    E = D // 32

    @cuda.jit(device=True, inline=True)
    def empty(acc, m, l):
        for g in range(G):
            m[g] = NEG_BIG
            l[g] = float32(0.0)
            for e in range(E):
                acc[g, e] = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def stash(sh_m, sh_l, sh_o, m, l, acc, warp, lane):
        if lane == 0:
            for g in range(G):
                sh_m[warp, g] = m[g]
                sh_l[warp, g] = l[g]
        for g in range(G):
            for e in range(E):
                sh_o[warp, g, lane * E + e] = acc[g, e]
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def warp_factors(sh_m, sh_l, g, f):
        """Each warp's factor ``exp(m_w - top)`` for head g into ``f[w]`` (0 for a warp without keys);
        returns (top, the sum of the warps' sums weighed by their factors)."""
        top = NEG_BIG
        for w in range(WARPS):
            top = max(top, sh_m[w, g])
        total = float32(0.0)
        for w in range(WARPS):
            f[w] = math.exp(sh_m[w, g] - top) if sh_l[w, g] > float32(0.0) else float32(0.0)
            total += sh_l[w, g] * f[w]
        return top, total

    return empty, stash, warp_factors


def make_attention(G, D, load_pair, load_quad, U=None, WARPS=WARPS):
    """``U`` keys in flight per warp (default ``keys_in_flight``), ``WARPS`` warps a block."""
    E = D // 32
    key_loop = make_key_loop(G, D, load_pair, load_quad, U or keys_in_flight(G, D), WARPS)
    empty, stash, warp_factors = make_warp_merge(G, D, WARPS)

    def attention(qkv, kc, page_stride, page_tables, max_pages, row_table, positions, part_o,
                  part_ml, n_heads, n_kv, page_shift, split_ptr, n_splits, scale):
        sh_m = cuda.shared.array((WARPS, G), float32)
        sh_l = cuda.shared.array((WARPS, G), float32)
        sh_o = cuda.shared.array((WARPS, G, D), float32)
        sh_f = cuda.shared.array((WARPS, G), float32)  # each warp's factor, by head
        sh_ml = cuda.shared.array((G, 2), float32)  # the merged max and sum, by head
        kvh = cuda.blockIdx.x
        row = cuda.blockIdx.y
        split = cuda.blockIdx.z
        warp = cuda.threadIdx.x >> 5
        lane = cuda.threadIdx.x & 31
        length = positions[row] + 1
        split_len = split_ptr[0]  # a step input, so one captured graph serves every context length
        start = split * split_len
        if start >= length:
            return  # the combine reads only the splits that hold keys
        end = min(start + split_len, length)
        width = (n_heads + 2 * n_kv) * D
        q = cuda.local.array((G, E), float32)
        acc = cuda.local.array((G, E), float32)
        m = cuda.local.array(G, float32)
        l = cuda.local.array(G, float32)
        empty(acc, m, l)
        for g in range(G):
            for e in range(E):
                q[g, e] = qkv[row * width + (kvh * G + g) * D + lane * E + e]
        page_size = int64(1) << page_shift
        head_off = int64(kvh) * page_size * D
        v_off = int64(n_kv) * page_size * D
        key_loop(q, acc, m, l, kc, page_stride, page_tables, row_table[row] * max_pages, page_shift, head_off, v_off,
                 start, end, warp, lane, scale)
        stash(sh_m, sh_l, sh_o, m, l, acc, warp, lane)
        tid = cuda.threadIdx.x
        if tid < G:  # thread g weighs head g's warps
            f = cuda.local.array(WARPS, float32)
            sh_ml[tid, 0], sh_ml[tid, 1] = warp_factors(sh_m, sh_l, tid, f)
            for w in range(WARPS):
                sh_f[w, tid] = f[w]
        cuda.syncthreads()
        # Merge the warps: thread t owns (g, d) pairs t, t + 32 * WARPS, ...
        for idx in range(tid, G * D, WARPS * 32):
            g = idx // D
            d = idx % D
            oo = float32(0.0)
            for w in range(WARPS):
                oo += sh_o[w, g, d] * sh_f[w, g]
            cell = (row * n_heads + kvh * G + g) * n_splits + split
            part_o[cell * D + d] = oo
            if d == 0:
                part_ml[cell * 2] = sh_ml[g, 0]
                part_ml[cell * 2 + 1] = sh_ml[g, 1]

    return attention


COMBINE_GROUPS = 4  # split groups per combine block: 4 loads in flight per output element
MAX_HEAD_DIM = 128


def attention_combine(out, part_o, part_ml, positions, n_heads, n_splits, head_dim, split_ptr):
    sh_m = cuda.shared.array(COMBINE_GROUPS, float32)
    sh_l = cuda.shared.array(COMBINE_GROUPS, float32)
    sh_o = cuda.shared.array((COMBINE_GROUPS, MAX_HEAD_DIM), float32)
    h = cuda.blockIdx.x
    row = cuda.blockIdx.y
    d = cuda.threadIdx.x % head_dim
    group = cuda.threadIdx.x // head_dim
    cell0 = (row * n_heads + h) * n_splits
    split_len = split_ptr[0]
    # Only the splits that hold keys of this row were written.
    active = min(n_splits, (positions[row] + split_len) // split_len)
    mm = NEG_BIG
    ll = float32(0.0)
    oo = float32(0.0)
    for sp in range(group, active, COMBINE_GROUPS):  # online merge of this group's splits
        m_sp = part_ml[(cell0 + sp) * 2]
        l_sp = part_ml[(cell0 + sp) * 2 + 1]
        if l_sp > float32(0.0):
            m_new = max(mm, m_sp)
            a = math.exp(mm - m_new)
            b = math.exp(m_sp - m_new)
            ll = ll * a + l_sp * b
            oo = oo * a + part_o[(cell0 + sp) * head_dim + d] * b
            mm = m_new
    if d == 0:
        sh_m[group] = mm
        sh_l[group] = ll
    sh_o[group, d] = oo
    cuda.syncthreads()
    if group == 0:
        top = NEG_BIG
        for g in range(COMBINE_GROUPS):
            if sh_l[g] > float32(0.0):
                top = max(top, sh_m[g])
        lt = float32(0.0)
        ot = float32(0.0)
        for g in range(COMBINE_GROUPS):
            if sh_l[g] > float32(0.0):
                f = math.exp(sh_m[g] - top)
                lt += sh_l[g] * f
                ot += sh_o[g, d] * f
        out[(row * n_heads + h) * head_dim + d] = ot / lt


def _signature(pool):
    return (F32P, pool, int64, I32P, int32, I32P, I32P, F32P, F32P, int32, int32, int32, I32P,
            int32, float32)


KERNELS = {}
for _g, _d in VARIANTS:
    KERNELS[f"attention_g{_g}_d{_d}_bf16"] = (make_attention(_g, _d, load_pair_bf16, load_quad_bf16),
                                               _signature(U32P), {"threads": 32 * WARPS})
    KERNELS[f"attention_g{_g}_d{_d}_f32"] = (make_attention(_g, _d, load_pair_f32, load_quad_f32), _signature(F32P),
                                              {"threads": 32 * WARPS})
KERNELS["attention_combine"] = (attention_combine, (F32P, F32P, F32P, I32P, int32, int32, int32, I32P),
                                {"threads_per_dim": COMBINE_GROUPS})
