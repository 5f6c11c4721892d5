"""The key phase of ``decode_attention`` on tensor cores: a warp folds 16 keys a step with ``mma.sync``.

On CUDA cores (attention.py's key loop) a lane owns ``D / 32`` dims of every key, so each score is a
warp-wide reduction (shuffles) and a key costs over a hundred instructions a warp: at batch 8 the
SMs spend the key phase issuing, not waiting for memory. Here a warp takes a tile of 16 keys and
computes, with ``g = lane >> 2`` and ``c = lane & 3`` (mma.py has the fragment layouts):

- the scores transposed, ``S^T = K Q^T`` (M = 16 keys, N = 8 columns of which the group's ``G`` query
  heads are used, K = the head's dims): lane (g, c) loads 16 bytes of dims ``32j + 8c ...`` of keys g
  and g + 8 for each j, and reads them as the A fragments of two k-steps. A k-step's 16 logical
  indices are thereby a permutation of 16 dims; q's B fragments take the same permutation, and a dot
  product does not care about the order of its terms. q is split into two bf16 parts (``split_bf16x2``)
  so the scores keep about 16 bits of q, not 8; the keys are bf16 already.
- the online softmax on the C fragment: lane (g, c) holds the scores of keys g and g + 8 for heads
  2c and 2c + 1; maxima and sums reduce over the 8 lanes of a column (shuffles by 4, 8 and 16).
- the output transposed, ``O^T += V^T P^T`` (M = dims, N = heads, K = the 16 keys): P's C fragment,
  packed to bf16 pairs and transposed by ``movmatrix``, is exactly P^T's B fragment (two parts again,
  for precision); V^T's A fragments need two keys' values of one dim in one register, so lane (g, c)
  loads ``D / 8`` consecutive dims of keys 2c, 2c + 1, 2c + 8 and 2c + 9 and pairs their halves (byte
  permutes). M-tile ``mt`` then holds dims ``g * D / 8 + 2 mt`` (row g) and ``... + 1`` (row g + 8).

A tile reads its keys from the block's staged copy in shared memory (decode_attention.py stages the
split's first keys before the grid wait) or from the pool; keys past the split's end are clamped to
its last key (finite values) and get no weight.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int64, uint32

from numba_kernels.common import NEG_BIG, load_u32x4, lds_u32x4, shared_address
from numba_kernels.mma import mma_bf16_16816, movmatrix_trans, split_bf16x2

TILE = 16  # keys a warp folds per step: the MMA's M


def make_mma_key_phase(G, D, WARPS, STAGE):
    """``key_phase(sh_x, sh_kv, sh_m, sh_l, sh_o, kc, page_stride, page_tables, table, page_shift,
    head_off, v_off, start, staged, end, warp, lane, scale)`` for ``G`` query heads (at most 8) of head
    dim ``D`` (a multiple of 64) over a bf16 pool: q from rows 0..G-1 of ``sh_x``, every warp's tiles
    of the keys ``[start, end)`` (the first ``staged`` in ``sh_kv``, STAGE of them at most, a multiple
    of TILE), then the warps' states into shared arrays laid out as attention.py's ``stash`` writes
    them (``sh_m``, ``sh_l``: ``[WARPS, G]``; ``sh_o``: ``[WARPS, G, D]``; decode_attention.py's
    ``head_factors`` reads them) and a block sync."""
    assert G <= 8 and D % 64 == 0 and STAGE % TILE == 0
    KSTEPS = D // 16  # k-steps of the scores; also the m-tiles (16 dims each) of the output
    CHUNKS = D // 32  # 16-byte loads a K row takes per lane (dims 32j + 8c ...)
    V_LOADS = D // 64  # 16-byte loads a V row takes per lane (its D / 8 dims)
    V_WORDS = D // 16  # their words: one per m-tile
    K_WORDS = D // 8  # the words a lane holds of a K row (CHUNKS loads)
    ROW_WORDS = D // 2  # 32-bit words of a bf16 row

    @cuda.jit(device=True, inline=True)
    def q_fragments(qh, ql, sh_x, lane):
        g = lane >> 2
        c = lane & 3
        head = min(g, G - 1)  # columns past the group: zeros
        for ks in range(KSTEPS):
            for w in range(2):  # b0: dims 32j + 8c + 4h + {0, 1}; b1: + {2, 3}
                d = 32 * (ks >> 1) + 8 * c + 4 * (ks & 1) + 2 * w
                big, small = split_bf16x2(sh_x[head, d], sh_x[head, d + 1])
                qh[ks, w] = big if g < G else uint32(0)
                ql[ks, w] = small if g < G else uint32(0)

    @cuda.jit(device=True, inline=True)
    def empty(acc, m, l):
        for mt in range(KSTEPS):
            for i in range(4):
                acc[mt, i] = float32(0.0)
        for h in range(2):
            m[h] = NEG_BIG
            l[h] = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def load_staged(kw, vw, sh_kv, first, staged, g, c):
        """Tile keys ``first ...`` (split-relative) from the staged rows."""
        base = shared_address(sh_kv)
        for r in range(2):  # keys g and g + 8
            slot = min(first + g + 8 * r, staged - 1)
            for j in range(CHUNKS):
                at = base + 4 * (slot * ROW_WORDS + 16 * j + 4 * c)
                kw[r, 4 * j], kw[r, 4 * j + 1], kw[r, 4 * j + 2], kw[r, 4 * j + 3] = lds_u32x4(at)
        for r in range(4):  # keys 2c, 2c + 1, 2c + 8, 2c + 9
            slot = min(first + 2 * c + (r & 1) + 8 * (r >> 1), staged - 1)
            for v in range(V_LOADS):
                at = base + 4 * ((STAGE + slot) * ROW_WORDS + g * V_WORDS + 4 * v)
                vw[r, 4 * v], vw[r, 4 * v + 1], vw[r, 4 * v + 2], vw[r, 4 * v + 3] = lds_u32x4(at)

    @cuda.jit(device=True, inline=True)
    def load_pool(kw, vw, kc, page_stride, page_tables, table, page_shift, head_off, v_off, t0, last, g, c):
        """Tile keys ``t0 ...`` from the pool (32-bit words of bf16 pairs), clamped to key ``last``."""
        page_mask = (int64(1) << page_shift) - 1
        for r in range(2):
            t = min(t0 + g + 8 * r, last)
            row = int64(page_tables[table + (t >> page_shift)]) * page_stride + head_off + (t & page_mask) * D
            for j in range(CHUNKS):
                kw[r, 4 * j], kw[r, 4 * j + 1], kw[r, 4 * j + 2], kw[r, 4 * j + 3] = load_u32x4(
                    kc, (row + 32 * j + 8 * c) >> 1)
        for r in range(4):
            t = min(t0 + 2 * c + (r & 1) + 8 * (r >> 1), last)
            row = int64(page_tables[table + (t >> page_shift)]) * page_stride + head_off + v_off + (t & page_mask) * D
            for v in range(V_LOADS):
                vw[r, 4 * v], vw[r, 4 * v + 1], vw[r, 4 * v + 2], vw[r, 4 * v + 3] = load_u32x4(
                    kc, (row + g * (D // 8) + 8 * v) >> 1)

    @cuda.jit(device=True, inline=True)
    def fold(qh, ql, acc, m, l, kw, vw, t0, end, g, scale):
        """The tile's scores, softmax update and P V into the warp's state."""
        s0 = s1 = s2 = s3 = float32(0.0)
        for ks in range(KSTEPS):
            j = ks >> 1
            w = 4 * j + 2 * (ks & 1)
            a0, a1, a2, a3 = kw[0, w], kw[1, w], kw[0, w + 1], kw[1, w + 1]
            s0, s1, s2, s3 = mma_bf16_16816(a0, a1, a2, a3, qh[ks, 0], qh[ks, 1], s0, s1, s2, s3)
            s0, s1, s2, s3 = mma_bf16_16816(a0, a1, a2, a3, ql[ks, 0], ql[ks, 1], s0, s1, s2, s3)
        near = t0 + g < end  # key g (the fragment's rows 0-7) holds a key of the split; key g + 8
        far = t0 + g + 8 < end
        s0 = s0 * scale if near else NEG_BIG
        s1 = s1 * scale if near else NEG_BIG
        s2 = s2 * scale if far else NEG_BIG
        s3 = s3 * scale if far else NEG_BIG
        top0 = max(s0, s2)  # head 2c
        top1 = max(s1, s3)  # head 2c + 1
        for offset in (4, 8, 16):
            top0 = max(top0, cuda.shfl_xor_sync(0xFFFFFFFF, top0, offset))
            top1 = max(top1, cuda.shfl_xor_sync(0xFFFFFFFF, top1, offset))
        top0 = max(top0, m[0])
        top1 = max(top1, m[1])
        alpha0 = math.exp(m[0] - top0)
        alpha1 = math.exp(m[1] - top1)
        m[0] = top0
        m[1] = top1
        p0 = math.exp(s0 - top0) if near else float32(0.0)
        p1 = math.exp(s1 - top1) if near else float32(0.0)
        p2 = math.exp(s2 - top0) if far else float32(0.0)
        p3 = math.exp(s3 - top1) if far else float32(0.0)
        l[0] = l[0] * alpha0 + (p0 + p2)  # this lane's keys; the column's lanes add up in ``stash``
        l[1] = l[1] * alpha1 + (p1 + p3)
        near_big, near_small = split_bf16x2(p0, p1)
        far_big, far_small = split_bf16x2(p2, p3)
        b0 = movmatrix_trans(near_big)
        b1 = movmatrix_trans(far_big)
        b0s = movmatrix_trans(near_small)
        b1s = movmatrix_trans(far_small)
        for mt in range(KSTEPS):
            w0, w1, w2, w3 = vw[0, mt], vw[1, mt], vw[2, mt], vw[3, mt]
            a0 = (w0 & uint32(0xFFFF)) | (w1 << uint32(16))  # dim 2mt (row g) of keys 2c, 2c + 1
            a1 = (w0 >> uint32(16)) | (w1 & uint32(0xFFFF0000))  # dim 2mt + 1 (row g + 8)
            a2 = (w2 & uint32(0xFFFF)) | (w3 << uint32(16))  # keys 2c + 8, 2c + 9
            a3 = (w2 >> uint32(16)) | (w3 & uint32(0xFFFF0000))
            c0 = acc[mt, 0] * alpha0
            c1 = acc[mt, 1] * alpha1
            c2 = acc[mt, 2] * alpha0
            c3 = acc[mt, 3] * alpha1
            c0, c1, c2, c3 = mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
            acc[mt, 0], acc[mt, 1], acc[mt, 2], acc[mt, 3] = mma_bf16_16816(a0, a1, a2, a3, b0s, b1s,
                                                                            c0, c1, c2, c3)

    @cuda.jit(device=True, inline=True)
    def key_loop(qh, ql, acc, m, l, sh_kv, kc, page_stride, page_tables, table, page_shift, head_off, v_off, start,
                 staged, end, warp, lane, scale):
        """The warp's tiles (every WARPS-th) of keys ``[start, end)``; the first ``staged`` are in
        ``sh_kv``. ``staged`` is either every key or STAGE, so a tile is staged whole or not at all."""
        g = lane >> 2
        c = lane & 3
        kw = cuda.local.array((2, K_WORDS), uint32)
        vw = cuda.local.array((4, V_WORDS), uint32)
        for tile in range(warp, (end - start + TILE - 1) // TILE, WARPS):
            first = tile * TILE
            if first < staged:
                load_staged(kw, vw, sh_kv, first, staged, g, c)
            else:
                load_pool(kw, vw, kc, page_stride, page_tables, table, page_shift, head_off, v_off, start + first,
                          end - 1, g, c)
            fold(qh, ql, acc, m, l, kw, vw, start + first, end, g, scale)

    @cuda.jit(device=True, inline=True)
    def stash(sh_m, sh_l, sh_o, m, l, acc, warp, lane):
        g = lane >> 2
        c = lane & 3
        l0 = l[0]
        l1 = l[1]
        for offset in (4, 8, 16):
            l0 += cuda.shfl_xor_sync(0xFFFFFFFF, l0, offset)
            l1 += cuda.shfl_xor_sync(0xFFFFFFFF, l1, offset)
        h0 = 2 * c
        h1 = h0 + 1
        if g == 0:
            if h0 < G:
                sh_m[warp, h0] = m[0]
                sh_l[warp, h0] = l0
            if h1 < G:
                sh_m[warp, h1] = m[1]
                sh_l[warp, h1] = l1
        for mt in range(KSTEPS):
            d = g * (D // 8) + 2 * mt
            if h0 < G:
                sh_o[warp, h0, d] = acc[mt, 0]
                sh_o[warp, h0, d + 1] = acc[mt, 2]
            if h1 < G:
                sh_o[warp, h1, d] = acc[mt, 1]
                sh_o[warp, h1, d + 1] = acc[mt, 3]
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def key_phase(sh_x, sh_kv, sh_m, sh_l, sh_o, kc, page_stride, page_tables, table, page_shift, head_off, v_off,
                  start, staged, end, warp, lane, scale):
        qh = cuda.local.array((KSTEPS, 2), uint32)
        ql = cuda.local.array((KSTEPS, 2), uint32)
        acc = cuda.local.array((KSTEPS, 4), float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        empty(acc, m, l)
        q_fragments(qh, ql, sh_x, lane)
        key_loop(qh, ql, acc, m, l, sh_kv, kc, page_stride, page_tables, table, page_shift, head_off, v_off, start,
                 staged, end, warp, lane, scale)
        stash(sh_m, sh_l, sh_o, m, l, acc, warp, lane)

    return key_phase
