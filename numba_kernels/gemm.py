"""Matrix products against bf16 weights ``W [N, K]`` (Hugging Face ``[out, in]``): ``y = x @ W.T``.

``gemv_m{M}``: the decode shape, ``rows <= M`` activation rows (M = 1..8 compile-time, so the
accumulators stay in registers). One block of 128 threads per ``cols`` output columns (8; the
manifest's ``meta``); the block streams those weight rows in 16-byte vector loads (8 bf16; x likewise as two
``ld.v4.f32``), so weights are read exactly once per step for all rows and each x value loaded
serves ``cols`` columns; warp shuffles then shared memory reduce the partial sums in a fixed order.
Launch: grid ``(ceil(N / cols),)``, block 128; ``K % 8 == 0`` and 16-byte aligned rows.

``gemm_tiled``: the prefill shape (any ``rows``): 64x64 output tiles, K in steps of 16 through shared
memory, 256 threads each owning a strided 4x4 block of outputs, fp32 FMA (no tensor cores yet).
Launch: grid ``(ceil(N / 64), ceil(rows / 64))``, block 256.
"""

from __future__ import annotations

from numba import cuda, float32, int32, int64, uint32, uint64

from numba_kernels.common import F32P, U16P, U64P, bf16_hi, bf16_lo, bf16_to_f32, load_f32x4, load_u64x2

GEMV_ROWS = tuple(range(1, 9))


GEMV_THREADS = 128
GEMV_WARPS = GEMV_THREADS // 32


def make_gemv(M, COLS):
    """``COLS`` output columns per block: each x value loaded serves that many columns."""

    def gemv(y, x, w, rows, n, k, ldy):
        red = cuda.shared.array((GEMV_WARPS, M, COLS), float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        col0 = cuda.blockIdx.x * COLS
        acc = cuda.local.array((M, COLS), float32)
        for r in range(M):
            for c in range(COLS):
                acc[r, c] = float32(0.0)
        wv = cuda.local.array((COLS, 8), float32)
        chunks = k >> 3  # 16-byte chunks: 8 bf16 weights, 8 fp32 activations (two loads)
        words = k >> 2
        # The whole block walks K together: 128 threads read 2 KiB of each weight row per step.
        for j in range(tid, chunks, GEMV_THREADS):
            for c in range(COLS):
                if col0 + c < n:
                    a, b = load_u64x2(w, int64(col0 + c) * words + 2 * j)
                    for h in range(2):
                        word = a if h == 0 else b
                        lo = uint32(word & uint64(0xFFFFFFFF))
                        hi = uint32(word >> uint64(32))
                        wv[c, 4 * h] = bf16_lo(lo)
                        wv[c, 4 * h + 1] = bf16_hi(lo)
                        wv[c, 4 * h + 2] = bf16_lo(hi)
                        wv[c, 4 * h + 3] = bf16_hi(hi)
                else:
                    for e in range(8):
                        wv[c, e] = float32(0.0)
            for r in range(M):
                if r < rows:
                    xb = int64(r) * k + 8 * j
                    x0, x1, x2, x3 = load_f32x4(x, xb)
                    x4, x5, x6, x7 = load_f32x4(x, xb + 4)
                    for c in range(COLS):
                        acc[r, c] += (x0 * wv[c, 0] + x1 * wv[c, 1] + x2 * wv[c, 2] + x3 * wv[c, 3]
                                      + x4 * wv[c, 4] + x5 * wv[c, 5] + x6 * wv[c, 6] + x7 * wv[c, 7])
        for r in range(M):
            for c in range(COLS):
                v = acc[r, c]
                for offset in (16, 8, 4, 2, 1):
                    v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
                if lane == 0:
                    red[warp, r, c] = v
        cuda.syncthreads()
        if tid < M * COLS:
            r = tid // COLS
            c = tid % COLS
            if r < rows and col0 + c < n:
                total = float32(0.0)
                for wp in range(GEMV_WARPS):
                    total += red[wp, r, c]
                y[int64(r) * ldy + col0 + c] = total

    return gemv


TILE = 64
BK = 16
TILE_PAD = TILE + 1  # a padded row keeps the transposed tile stores off one bank


def gemm_tiled(y, x, w, rows, n, k, ldy):
    xs = cuda.shared.array((BK, TILE_PAD), float32)
    ws = cuda.shared.array((BK, TILE_PAD), float32)
    tid = cuda.threadIdx.x
    tx = tid & 15
    ty = tid >> 4
    col0 = cuda.blockIdx.x * TILE
    row0 = cuda.blockIdx.y * TILE
    acc = cuda.local.array((4, 4), float32)
    for i in range(4):
        for j in range(4):
            acc[i, j] = float32(0.0)
    for k0 in range(0, k, BK):
        for q in range(4):
            idx = tid + 256 * q
            r = idx >> 4
            kk = idx & 15
            xv = float32(0.0)
            if row0 + r < rows and k0 + kk < k:
                xv = x[int64(row0 + r) * k + k0 + kk]
            xs[kk, r] = xv
            wv = float32(0.0)
            if col0 + r < n and k0 + kk < k:
                wv = bf16_to_f32(w[int64(col0 + r) * k + k0 + kk])
            ws[kk, r] = wv
        cuda.syncthreads()
        for kk in range(BK):
            a0 = xs[kk, ty]
            a1 = xs[kk, ty + 16]
            a2 = xs[kk, ty + 32]
            a3 = xs[kk, ty + 48]
            for j in range(4):
                b = ws[kk, tx + 16 * j]
                acc[0, j] += a0 * b
                acc[1, j] += a1 * b
                acc[2, j] += a2 * b
                acc[3, j] += a3 * b
        cuda.syncthreads()
    for i in range(4):
        r = row0 + ty + 16 * i
        if r < rows:
            for j in range(4):
                c = col0 + tx + 16 * j
                if c < n:
                    y[int64(r) * ldy + c] = acc[i, j]


GEMV_SIG = (F32P, F32P, U64P, int32, int32, int32, int32)
KERNELS = {f"gemv_m{m}": (make_gemv(m, 8), GEMV_SIG, {"cols": 8, "threads": GEMV_THREADS}) for m in GEMV_ROWS}
# Narrower variants: fewer registers, more resident blocks; tools/gpu_bench.py times both.
KERNELS.update({f"gemv_m{m}_c4": (make_gemv(m, 4), GEMV_SIG, {"cols": 4, "threads": GEMV_THREADS})
                for m in GEMV_ROWS})
KERNELS["gemm_tiled"] = (gemm_tiled, (F32P, F32P, U16P, int32, int32, int32, int32))
