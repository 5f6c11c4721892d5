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

import math

import numpy as np
from llvmlite import ir
from numba import cuda, float32, int32, int64, types, uint32, uint64
from numba.cuda import libdevice
from numba.cuda.extending import intrinsic

from numba_kernels.common import (F32P, I32P, U16P, U32P, U64P, bf16_hi, bf16_lo, bf16_to_f32, cp_async16,
                                  cp_async_commit, cp_async_wait, global_address, grid_dependency_wait,
                                  launch_dependents, lds_u32x4, load_f32x4, prefetch_block_share, shared_address,
                                  warp_sum)
from numba_kernels.deltanet import CONV_KERNEL, conv_tap, shift_tail, split_norm_inverse
from numba_kernels.mma import mma_bf16_16816, pack_bf16x2, split_bf16x2

GEMV_ROWS = tuple(range(1, 9))
CONV_GEMV_ROWS = (1, 2)  # the rows whose decode in_proj is the fp32 GEMV (forward.DECODE_GEMMS)


GEMV_THREADS = 128
GEMV_WARPS = GEMV_THREADS // 32


@intrinsic
def load_weights_u64x2(typingctx, ptr, index):
    """16 bytes of weights, read once per step: non-coherent path, not kept in L1."""
    sig = types.UniTuple(uint64, 2)(ptr, index)

    def codegen(context, builder, signature, args):
        base, idx = args
        addr = builder.ptrtoint(builder.gep(base, [idx]), ir.IntType(64))
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.LiteralStructType([i64, i64]), [i64])
        call = builder.call(ir.InlineAsm(fnty, "ld.global.nc.L1::no_allocate.v2.u64 {$0, $1}, [$2];", "=l,=l,l"),
                            [addr])
        parts = [builder.extract_value(call, i) for i in range(2)]
        return context.make_tuple(builder, signature.return_type, parts)

    return sig, codegen


@cuda.jit(device=True, inline=True)
def load_activations(x, at, norm_w, norm_at, normed, xr, i):
    """``x[at .. at + 8]`` (16-byte aligned) into ``xr[i, 0..7]``, times ``norm_w[norm_at ..]`` when
    ``normed``; returns the eight values' sum of squares before that scaling (0 when not normed)."""
    x0, x1, x2, x3 = load_f32x4(x, at)
    x4, x5, x6, x7 = load_f32x4(x, at + 4)
    squares = float32(0.0)
    if normed:  # every load out before the first use
        n0, n1, n2, n3 = load_f32x4(norm_w, norm_at)
        n4, n5, n6, n7 = load_f32x4(norm_w, norm_at + 4)
        squares = x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3 + x4 * x4 + x5 * x5 + x6 * x6 + x7 * x7
        x0, x1, x2, x3, x4, x5, x6, x7 = x0 * n0, x1 * n1, x2 * n2, x3 * n3, x4 * n4, x5 * n5, x6 * n6, x7 * n7
    xr[i, 0], xr[i, 1], xr[i, 2], xr[i, 3] = x0, x1, x2, x3
    xr[i, 4], xr[i, 5], xr[i, 6], xr[i, 7] = x4, x5, x6, x7
    return squares


@cuda.jit(device=True, inline=True)
def keep_normed(kept, x, norm_w, inv, rows, k, tid, threads):
    """This block's columns (a 1 / gridDim share, in 4-column steps) of ``kept = x / rms * norm_w``
    (``inv``: each row's 1 / rms), written by the block's ``threads`` threads."""
    share = (((k + 3) >> 2) + cuda.gridDim.x - 1) // cuda.gridDim.x * 4
    first = cuda.blockIdx.x * share
    width = min(share, k - first)
    for idx in range(tid, rows * max(width, 0), threads):
        r = idx // width
        kk = first + idx % width
        at = int64(r) * k + kk
        kept[at] = x[at] * inv[r] * norm_w[kk]


def make_weight_row(COLS: int, SWIGLU: bool):
    """``weight_row(c, n, first_row, tile)``: weight row ``c`` of an fp32 GEMV's column tile ``tile`` (a
    block's ``COLS`` rows; most GEMVs' block ``b`` takes tile ``b``) of a matrix of n output rows from
    ``first_row`` (-1: past it); with ``SWIGLU`` the first COLS / 2 are gate rows, the rest the matching
    up rows, n further on."""
    OUT = COLS // 2 if SWIGLU else COLS

    @cuda.jit(device=True, inline=True)
    def weight_row(c, n, first_row, tile):
        if SWIGLU:
            j = tile * OUT + c % OUT
            return first_row + int64(j) + (int64(n) if c >= OUT else int64(0)) if j < n else int64(-1)
        f = tile * COLS + c
        return first_row + int64(f) if f < n else int64(-1)

    return weight_row


def make_gemv_step(M: int, COLS: int, SWIGLU: bool):
    """(weight_rows, load, accumulate): the fp32 GEMVs' block of ``COLS`` weight rows (with ``SWIGLU``
    the first COLS / 2 are gate rows, the rest the matching up rows) and one 16-byte step of them
    against ``M`` activation rows (``make_gemv``, numba_kernels/moe.py ``make_grouped_gemv``)."""
    weight_row = make_weight_row(COLS, SWIGLU)

    @cuda.jit(device=True, inline=True)
    def weight_rows(row_of, n, first_row, tile):
        """Column tile ``tile``'s weight rows of a matrix of n output rows from ``first_row``
        (``make_weight_row``)."""
        for c in range(COLS):
            row_of[c] = weight_row(c, n, first_row, tile)

    @cuda.jit(device=True, inline=True)
    def load(w, row_of, words, chunks, j, raw):
        """16-byte chunk ``j`` of each weight row (``row_of``: rows of ``words`` u64 words) as raw bf16
        pairs (zero past the matrix or past k). They widen to fp32 only where they are multiplied: that
        keeps the dense GEMV at 64 registers, two more blocks an SM than widening them here."""
        for c in range(COLS):
            if j < chunks and row_of[c] >= 0:
                a, b = load_weights_u64x2(w, row_of[c] * words + 2 * j)
                raw[c, 0] = uint32(a & uint64(0xFFFFFFFF))
                raw[c, 1] = uint32(a >> uint64(32))
                raw[c, 2] = uint32(b & uint64(0xFFFFFFFF))
                raw[c, 3] = uint32(b >> uint64(32))
            else:
                for e in range(4):
                    raw[c, e] = uint32(0)

    @cuda.jit(device=True, inline=True)
    def accumulate(acc, raw, xr):
        """``acc[r, c] += xr[r] . weights of row c`` over the step's 8 k, in fp32."""
        for c in range(COLS):
            w0, w1 = bf16_lo(raw[c, 0]), bf16_hi(raw[c, 0])
            w2, w3 = bf16_lo(raw[c, 1]), bf16_hi(raw[c, 1])
            w4, w5 = bf16_lo(raw[c, 2]), bf16_hi(raw[c, 2])
            w6, w7 = bf16_lo(raw[c, 3]), bf16_hi(raw[c, 3])
            for r in range(M):
                acc[r, c] += (xr[r, 0] * w0 + xr[r, 1] * w1 + xr[r, 2] * w2 + xr[r, 3] * w3
                              + xr[r, 4] * w4 + xr[r, 5] * w5 + xr[r, 6] * w6 + xr[r, 7] * w7)

    return weight_rows, load, accumulate


def make_gemv(M, COLS, normed=False, epilogue="store", PRELOAD=1, HEAD_NORM=False, KEEP=False, NEXT=False):
    """``COLS`` weight rows per block: each x value loaded serves that many rows.

    ``PRELOAD`` (name suffix ``p{PRELOAD}``): each thread's first PRELOAD steps of weights, not one, are
    in flight before the wait for the previous kernel. The registers cost blocks an SM, so it pays only
    where every block of the grid is resident at once anyway and the kernel before leaves DRAM idle
    (the MoE hybrid's one-row o projection, after the delta rule or attention: Forward.preload_o).

    ``normed`` / ``epilogue`` are the decode fusions of ``mma_gemv`` below (same meaning; with
    "swiglu" the block's first COLS / 2 rows are gate rows and the rest the matching up rows).
    ``epilogue`` "conv" (a hybrid's DeltaNet in_proj, ``gemv_normed_conv_m{M}``): output columns below
    ``channels`` are the conv's inputs, so instead of storing them the GEMV runs ``deltanet_conv``'s
    step on them (the same arithmetic): SiLU(conv) of row r's channel into ``mixed``, its tail read
    from StateImage slot ``lanes[r]`` and written, shifted, to ``lanes_out[r]`` (numba_kernels/deltanet.py);
    columns from ``channels`` on are stored. One launch a DeltaNet layer fewer.
    ``HEAD_NORM`` (a DeltaNet out projection, ``gemv_residual_headnorm_m{M}``; last arguments ``partials,
    splits, head_dim``): x is the unscaled output of ``deltanet_rule_s{S}u`` (numba_kernels/deltanet.py),
    and the GEMV finishes its gated RMSNorm: each value of row r, head h (``head_dim`` wide) is scaled by
    ``1 / sqrt(sum / head_dim + eps)`` of the head's ``splits`` partial sums of squares at
    ``partials[(r * heads + h) * splits ..]`` as it is loaded: the split rule's scaling, bit for bit,
    without its ticket and last block.
    ``NEXT`` (name suffix ``n``; last arguments ``next_w, next_bytes``) is ``make_mma_gemv``'s: thread 0
    asks L2 for the block's share of the first ``next_bytes`` of ``next_w`` once the block has streamed
    its rows (a MoE hybrid's one-row o / out GEMV asking for the layer's router,
    HybridForward.router_prefetch). ``KEEP`` (normed, "store", with NEXT; ``kept`` before the NEXT
    arguments; the MoE router of a one-row step, ``gemv_normed_keep_store_m1c{COLS}p{PRELOAD}n``,
    CudaMoe.router_gemv) is its ``keep``: each block also writes its share of ``kept = rmsnorm(x) *
    norm_w`` (``keep_normed``).
    Weights come through ``ld.global.nc.L1::no_allocate`` (a plain ``ld.global`` measured 0.2-1.7%
    slower on the H200). Also timed and dropped (tools/bench_decode_gemm.py, one row): 2 or 4 chunks
    of each row in flight a thread (96 / 168 registers: fewer blocks, 3-25% slower), and thread 0
    prefetching the block's rows into L2 one or two steps ahead (8-12% slower)."""
    SWIGLU = epilogue == "swiglu"
    CONV = epilogue == "conv"
    assert not HEAD_NORM or (epilogue == "residual" and not normed)
    assert not KEEP or (NEXT and normed and epilogue == "store")
    assert not NEXT or epilogue in ("store", "residual")
    OUT_COLS = COLS // 2 if SWIGLU else COLS
    weight_rows, load_weights, accumulate = make_gemv_step(M, COLS, SWIGLU)

    @cuda.jit(device=True, inline=True)
    def row_activations(x, norm_w, k, j, r, xr, eps, partials, splits, head_dim):
        """Row r's activations of step j (with HEAD_NORM scaled by their head's norm); returns their squares."""
        squares = load_activations(x, int64(r) * k + 8 * j, norm_w, 8 * j, normed, xr, r)
        if HEAD_NORM:  # the 8 values share a head: head_dim % 8 == 0
            inv = split_norm_inverse(partials, r * (k // head_dim) + 8 * j // head_dim, splits, head_dim, eps)
            for e in range(8):
                xr[r, e] *= inv
        return squares

    @cuda.jit(device=True, inline=True)
    def held_activations(x, norm_w, rows, k, j, chunks, ss, xr, eps, partials, splits, head_dim):
        """A held step j's activations of every row (zeros past ``rows`` or past k); adds each row's
        squares to ``ss``."""
        for r in range(M):
            if r < rows and j < chunks:
                ss[r] += row_activations(x, norm_w, k, j, r, xr, eps, partials, splits, head_dim)
            else:
                for e in range(8):
                    xr[r, e] = float32(0.0)

    def gemv(y, x, w, norm_w, rows, n, k, ldy, eps, mixed, states, slot_stride, lanes, lanes_out, channels, conv_w,
             partials, splits, head_dim, kept, next_w, next_bytes):
        red = cuda.shared.array((GEMV_WARPS, M, COLS), float32)
        red_ss = cuda.shared.array((GEMV_WARPS, M), float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        acc = cuda.local.array((M, COLS), float32)
        ss = cuda.local.array(M, float32)
        for r in range(M):
            ss[r] = float32(0.0)
            for c in range(COLS):
                acc[r, c] = float32(0.0)
        row_of = cuda.local.array(COLS, int64)  # weight row of each block column (-1: past the matrix)
        weight_rows(row_of, n, int64(0), cuda.blockIdx.x)
        raw = cuda.local.array((COLS, 4), uint32)
        xr = cuda.local.array((M, 8), float32)
        chunks = k >> 3  # 16-byte chunks: 8 bf16 weights, 8 fp32 activations (two loads)
        words = k >> 2
        # The whole block walks K together: 128 threads read 2 KiB of each weight row per step. The
        # first step's weights are in flight before the wait for the previous kernel (common.py,
        # "programmatic dependent launch"): weights never depend on it. They are issued before
        # ``launch_dependents``: issued after it, ptxas sank them below the wait (the SASS had every
        # LDG after ACQBULK), as it does not for loads that precede the trigger.
        first = tid
        s0 = s1 = s2 = float32(0.0)
        if CONV and tid < M * OUT_COLS:  # the conv tail of this thread's output, before the wait as the weights:
            r = tid // OUT_COLS  # no kernel of the step writes the slots it reads (lanes_out differ)
            col = cuda.blockIdx.x * OUT_COLS + tid % OUT_COLS
            if r < rows and col < channels:
                tail = int64(lanes[r]) * slot_stride + col
                s0 = states[tail]
                s1 = states[tail + channels]
                s2 = states[tail + 2 * channels]
        if PRELOAD > 1:  # the first PRELOAD steps' (constant indices: registers), consumed after the wait
            held = cuda.local.array((PRELOAD, COLS, 4), uint32)
            for s in range(PRELOAD):
                load_weights(w, row_of, words, chunks, tid + s * GEMV_THREADS, raw)
                for c in range(COLS):
                    for e in range(4):
                        held[s, c, e] = raw[c, e]
            launch_dependents()
            grid_dependency_wait()
            for s in range(PRELOAD):
                for c in range(COLS):
                    for e in range(4):
                        raw[c, e] = held[s, c, e]
                held_activations(x, norm_w, rows, k, tid + s * GEMV_THREADS, chunks, ss, xr, eps, partials, splits,
                                 head_dim)
                accumulate(acc, raw, xr)
            first = tid + PRELOAD * GEMV_THREADS
            load_weights(w, row_of, words, chunks, first, raw)
        else:
            load_weights(w, row_of, words, chunks, tid, raw)
            launch_dependents()
            grid_dependency_wait()
        for j in range(first, chunks, GEMV_THREADS):
            # The step's activations first, their loads out together (x and norm_w sit in L2).
            for r in range(M):
                if r < rows:
                    ss[r] += row_activations(x, norm_w, k, j, r, xr, eps, partials, splits, head_dim)
                else:
                    for e in range(8):
                        xr[r, e] = float32(0.0)
            accumulate(acc, raw, xr)
            # The registers are free again: the next step's weights go out now.
            load_weights(w, row_of, words, chunks, j + GEMV_THREADS, raw)
        if NEXT and tid == 0:
            prefetch_block_share(next_w, next_bytes)
        for r in range(M):
            for c in range(COLS):
                v = acc[r, c]
                for offset in (16, 8, 4, 2, 1):
                    v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
                if lane == 0:
                    red[warp, r, c] = v
            if normed:
                v = ss[r]
                for offset in (16, 8, 4, 2, 1):
                    v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
                if lane == 0:
                    red_ss[warp, r] = v
        cuda.syncthreads()
        if KEEP:  # every thread writes kept values: each row's 1 / rms through shared memory
            inv_kept = cuda.shared.array(M, float32)
            if tid < M:
                sq = float32(0.0)
                for wp in range(GEMV_WARPS):
                    sq += red_ss[wp, tid]
                inv_kept[tid] = float32(1.0) / math.sqrt(sq / float32(k) + eps)
            cuda.syncthreads()
            keep_normed(kept, x, norm_w, inv_kept, rows, k, tid, GEMV_THREADS)
        if tid < M * OUT_COLS:
            r = tid // OUT_COLS
            c = tid % OUT_COLS
            col = cuda.blockIdx.x * OUT_COLS + c
            if r < rows and col < n:
                total = float32(0.0)
                for wp in range(GEMV_WARPS):
                    total += red[wp, r, c]
                if normed:
                    sq = float32(0.0)
                    for wp in range(GEMV_WARPS):
                        sq += red_ss[wp, r]
                    inv = float32(1.0) / math.sqrt(sq / float32(k) + eps)
                    total *= inv
                at = int64(r) * ldy + col
                if SWIGLU:
                    up = float32(0.0)
                    for wp in range(GEMV_WARPS):
                        up += red[wp, r, c + OUT_COLS]
                    if normed:
                        up *= inv
                    sig = float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * total)
                    y[at] = total * sig * up
                elif epilogue == "residual":
                    y[at] += total
                elif CONV and col < channels:  # deltanet_conv of one token, from the sum it would have read
                    c4 = col * CONV_KERNEL
                    mixed[int64(r) * channels + col] = conv_tap(s0, s1, s2, total, conv_w[c4], conv_w[c4 + 1],
                                                                conv_w[c4 + 2], conv_w[c4 + 3])
                    shift_tail(states, int64(lanes_out[r]) * slot_stride + col, channels, s1, s2, total)
                else:
                    y[at] = total

    body = cuda.jit(device=True, inline=True)(gemv)
    if CONV:
        def conv(y, x, w, norm_w, rows, n, k, ldy, eps, mixed, states, slot_stride, lanes, lanes_out, channels,
                 conv_w):
            body(y, x, w, norm_w, rows, n, k, ldy, eps, mixed, states, slot_stride, lanes, lanes_out, channels,
                 conv_w, y, 0, 0, y, y, 0)

        return conv
    if HEAD_NORM and NEXT:
        def head_normed_next(y, x, w, norm_w, rows, n, k, ldy, eps, partials, splits, head_dim, next_w, next_bytes):
            no_lanes = cuda.local.array(1, int32)  # the conv's arguments: unused
            body(y, x, w, norm_w, rows, n, k, ldy, eps, y, y, int64(0), no_lanes, no_lanes, 0, y, partials, splits,
                 head_dim, y, next_w, next_bytes)

        return head_normed_next
    if HEAD_NORM:
        def head_normed(y, x, w, norm_w, rows, n, k, ldy, eps, partials, splits, head_dim):
            no_lanes = cuda.local.array(1, int32)  # the conv's arguments: unused
            body(y, x, w, norm_w, rows, n, k, ldy, eps, y, y, int64(0), no_lanes, no_lanes, 0, y, partials, splits,
                 head_dim, y, y, 0)

        return head_normed
    if KEEP:
        def kept_next(y, x, w, norm_w, rows, n, k, ldy, eps, kept, next_w, next_bytes):
            no_lanes = cuda.local.array(1, int32)  # the conv's arguments: unused
            body(y, x, w, norm_w, rows, n, k, ldy, eps, y, y, int64(0), no_lanes, no_lanes, 0, y, y, 0, 0, kept, next_w,
                 next_bytes)

        return kept_next
    if NEXT:
        def fused_next(y, x, w, norm_w, rows, n, k, ldy, eps, next_w, next_bytes):
            no_lanes = cuda.local.array(1, int32)  # the conv's arguments: unused
            body(y, x, w, norm_w, rows, n, k, ldy, eps, y, y, int64(0), no_lanes, no_lanes, 0, y, y, 0, 0, y, next_w,
                 next_bytes)

        return fused_next
    if normed or epilogue != "store":
        def fused(y, x, w, norm_w, rows, n, k, ldy, eps):
            no_lanes = cuda.local.array(1, int32)  # the conv's arguments: unused
            body(y, x, w, norm_w, rows, n, k, ldy, eps, y, y, int64(0), no_lanes, no_lanes, 0, y, y, 0, 0, y, y, 0)

        return fused

    def plain(y, x, w, rows, n, k, ldy):  # the undecorated product (prefill tails, the LM head of prefill)
        no_lanes = cuda.local.array(1, int32)
        body(y, x, w, x, rows, n, k, ldy, float32(0.0), y, y, int64(0), no_lanes, no_lanes, 0, y, y, 0, 0, y, y, 0)

    return plain


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
# "grid_wait": the kernel keeps common.py's rules for programmatic dependent launch.
KERNELS = {f"gemv_m{m}": (make_gemv(m, 8), GEMV_SIG, {"cols": 8, "threads": GEMV_THREADS, "grid_wait": 1})
           for m in GEMV_ROWS}
# Narrower variants: fewer registers, more resident blocks; tools/gpu_bench.py times both.
KERNELS.update({f"gemv_m{m}_c4": (make_gemv(m, 4), GEMV_SIG, {"cols": 4, "threads": GEMV_THREADS, "grid_wait": 1})
                for m in GEMV_ROWS})
KERNELS["gemm_tiled"] = (gemm_tiled, (F32P, F32P, U16P, int32, int32, int32, int32))


# -- decode GEMM on the tensor cores ----------------------------------------------------------------
# ``mma_gemv_*``: the same product for 1..8 rows (``rows`` is a runtime argument) with mma.sync
# m16n8k16: the weights are the A operand (16 output features x 16 k per fragment) and the rows'
# activations the B operand (16 k x 8 rows, zero past ``rows``), accumulated in fp32. The k order
# inside a fragment is ours to choose as long as A and B agree, so each lane reads 16 contiguous
# bytes (8 bf16) of weight rows g and g + 8 and the 8 matching fp32 activations of row g: k slots
# 2t, 2t+1 | 2t+8, 2t+9 of the first MMA hold k = 8t+0,1 | 8t+2,3, the second MMA's k = 8t+4..7.
# Activations stay fp32-faithful: each is split into TERMS bf16 parts (big, its remainder, ...),
# one MMA per part against the same weight fragment (two parts keep ~16 bits, three all 24).
# A block of W warps owns T tiles of 16 weight rows; its warps split K (warp w takes 32-k steps
# w, w + W, ...; U steps' loads are issued before any MMA) and meet in shared memory, where the
# sum over warps runs in a fixed order (deterministic). Each warp reuses one activation fragment
# for its T tiles, so at 8 rows the L2 reads of x shrink to 1/T of the weight bytes.
#
# Fusions (compile-time), which remove the RMSNorm and SiLU launches from a decode step:
# - ``normed``: y = rmsnorm(x, norm_w) @ W.T. The B operand is x * norm_w; the block sees every k
#   of its rows anyway, so it sums x^2 on the way and scales the result by 1 / rms at the end.
# - ``residual``: y += x @ W.T (y is the residual stream; each element has one writer).
# - ``swiglu``: tile rows 0..7 are gate rows j..j+7, rows 8..15 the matching up rows n + j..; the
#   epilogue writes y[r, j] = silu(gate) * up, so n is the FFN width and W has 2n rows.
# Launch: grid ``(ceil(n / (T * cols)),)`` with cols = 16 (8 for swiglu), block ``32 * W``;
# ``k % 8 == 0``, 16-byte aligned rows; ``norm_w`` and ``eps`` are read only when normed.

MMA_EPILOGUES = ("store", "residual", "swiglu")


@cuda.jit(device=True, inline=True)
def split3_bf16x2(lo, hi):
    """Three bf16 pairs whose sum is (lo, hi) to fp32 precision: big, remainder, remainder's remainder."""
    big, small = split_bf16x2(lo, hi)
    lo_rest = lo - bf16_lo(big) - bf16_lo(small)
    hi_rest = hi - bf16_hi(big) - bf16_hi(small)
    return big, small, pack_bf16x2(lo_rest, hi_rest)


@cuda.jit(device=True, inline=True)
def put_fragment_words(wr, u, tt, h, a, b):
    """16 loaded bytes (two 64-bit words) as the four 32-bit A-fragment registers ``wr[u, tt, h]``."""
    wr[u, tt, h, 0] = uint32(a & uint64(0xFFFFFFFF))
    wr[u, tt, h, 1] = uint32(a >> uint64(32))
    wr[u, tt, h, 2] = uint32(b & uint64(0xFFFFFFFF))
    wr[u, tt, h, 3] = uint32(b >> uint64(32))


def make_weight_fragments(T: int, load):
    """``(w, row_at, k, kk, u, wr)``: a lane's A fragments of one 32-k step (its 8 k from ``kk``) into
    ``wr[u]``: T tiles of two weight rows at element offsets ``row_at[tt, h]`` (-1: past the matrix,
    zeros), 16 bytes a row through ``load``. Shared by the tensor-core GEMMs."""

    @cuda.jit(device=True, inline=True)
    def weight_fragments(w, row_at, k, kk, u, wr):
        for tt in range(T):
            for h in range(2):
                if kk < k and row_at[tt, h] >= 0:
                    a, b = load(w, (row_at[tt, h] + kk) >> 2)
                    put_fragment_words(wr, u, tt, h, a, b)
                else:
                    for e in range(4):
                        wr[u, tt, h, e] = uint32(0)

    return weight_fragments


def make_mma_gemv(normed: bool, epilogue: str, T: int, W: int, U: int, TERMS: int, keep: bool = False, RING: int = 0,
                  chain: str = "", hold: bool = False, early: bool = False, NEXT: bool = False, FRAG: bool = False):
    """``chain`` passes the next GEMM's RMSNorm from a residual GEMM to its consumer (batched decode):
    "out" (epilogue "residual"; last arguments ``xn, part``): besides ``y += .`` the block writes
    ``xn = y * norm_w`` (``norm_w``: the next norm's weights) and, per row, the sum of squares of its
    columns of y into ``part[8 * block + row]``. "in" (not ``normed``; last arguments ``part, parts``):
    x is such an ``xn``, so the loop holds no norm weights; an extra warp sums the producer's ``parts``
    blocks of ``part`` (in a fixed order) into each row's ``1 / rms`` while the others stream the
    weights, and the epilogue scales by it, as a normed kernel does.

    ``hold``: each round's first MMA waits (through a term that adds +0.0) for every weight word of the
    round, so ptxas cannot sink half of the round's loads below the MMAs of the other half (it did for
    the t4 shapes without the norm's loads, taking their loop from one memory round trip to two).

    ``keep`` (with ``normed``): a last argument ``kept`` takes rmsnorm(x) * norm_w too, each block
    writing its share of every row's columns, for the kernels after this one that read the
    normalised rows (the MoE router: its routing and expert GEMMs), so no norm launch precedes it.

    ``early`` (the register loop): the first round's weights are loaded before the wait for the
    previous kernel, as the fp32 GEMV's are (more registers: the MoE router's shape, whose one round
    is all of K, takes it, and its 16 blocks stream the router while the kernel before it runs).

    ``RING`` (with ``U == 1``): the operands come through a ring of RING slots of 64 k in shared
    memory (``ring_bytes``, dynamic) instead of registers. Each warp copies its own slots with
    ``cp.async`` RING slots ahead: the weight rows as whole 128-byte lines (8 lanes a row, 4 rows an
    instruction, where the register path's lanes read 64 bytes of each of 16 rows), the slot's
    activations (zeros past ``rows``) and norm weights; then reads its fragments back after a warp
    barrier. The first RING slots' weights go out before the wait for the previous kernel.

    ``NEXT`` (last arguments ``next_w, next_bytes``, after ``kept`` with ``keep``): once warp 0 has
    streamed its share, thread 0 asks L2 for the block's share of the first ``next_bytes`` of ``next_w``,
    the next GEMM's weights, which then stream in over this kernel's tail and the launch gap.

    ``FRAG``: W is in fragment order (``fragment_order``): a warp's 32-k step of its block's tiles is
    512 contiguous bytes a tile half, lane l's 16 bytes at 16 l, so a step reads T kilobytes in whole
    lines instead of 64 bytes of each of 16 T rows (a ring slot, two steps, 2 T contiguous kilobytes
    instead of 16 T lines a row apart). The reordered copy holds zeros past the matrix's rows and K, so
    the loads need no bounds of their own."""
    assert normed or not keep
    assert not (FRAG and early)
    assert not (NEXT and chain)
    assert chain in ("", "in", "out") and not (chain == "in" and normed) and (chain != "out" or epilogue == "residual")
    assert chain != "out" or (T == 1 and W >= 4)  # NORM_OUT: an output a thread, a row's columns a half-warp
    NORM_IN = chain == "in"
    NORM_OUT = chain == "out"
    SCALED = normed or NORM_IN  # the epilogue multiplies by each row's 1 / rms
    assert not RING or (U == 1 and 2 <= RING <= len(cp_async_wait))
    assert not (hold and RING)  # hold orders the register loop's loads; a ring's copies need no such hold
    assert not (early and (RING or chain == "in"))  # the ring loads early anyway; NORM_IN's extra warp waits
    wait_slot = cp_async_wait[RING - 1] if RING else None
    SLOT = ring_slot_bytes(T, normed)
    X_AT = 16 * T * 128  # the slot's activations: 8 rows of 64 fp32 (256 bytes), after the weight rows
    NORM_AT = X_AT + 8 * 256  # then 64 fp32 norm weights
    THREADS = 32 * (W + 1 if NORM_IN else W)  # NORM_IN: warp W sums the norm's partials
    SWIGLU = epilogue == "swiglu"
    COLS = 8 if SWIGLU else 16  # output columns per 16-row tile
    OUTS = T * COLS * 8  # (column, row) outputs per block

    load_weights = make_weight_fragments(T, load_weights_u64x2)

    @cuda.jit(device=True, inline=True)
    def load_fragments(w, steps, step, u, wr, lane):
        """FRAG: the lane's A fragments of 32-k step ``step`` of the block's tiles into ``wr[u]``."""
        for tt in range(T):
            for h in range(2):
                chunk = ((int64(cuda.blockIdx.x) * steps + min(step, steps - 1)) * T + tt) * 2 + h
                a, b = load_weights_u64x2(w, (chunk * 32 + lane) * 2)
                if step >= steps:  # past K (the last round of a warp): read in bounds, used as zeros
                    a = uint64(0)
                    b = uint64(0)
                put_fragment_words(wr, u, tt, h, a, b)

    @cuda.jit(device=True, inline=True)
    def step_mmas(acc, wr, u, xr, xu):
        """One 32-k step's MMAs: the lane's weight fragments ``wr[u]`` against its activations ``xr[xu]``."""
        for half in range(2):  # k = 8t+0..3, then 8t+4..7
            e = 4 * half
            if TERMS == 3:
                p0, q0, r0 = split3_bf16x2(xr[xu, e], xr[xu, e + 1])
                p1, q1, r1 = split3_bf16x2(xr[xu, e + 2], xr[xu, e + 3])
            else:
                p0, q0 = split_bf16x2(xr[xu, e], xr[xu, e + 1])
                p1, q1 = split_bf16x2(xr[xu, e + 2], xr[xu, e + 3])
            for tt in range(T):
                a0 = wr[u, tt, 0, 2 * half]
                a1 = wr[u, tt, 1, 2 * half]
                a2 = wr[u, tt, 0, 2 * half + 1]
                a3 = wr[u, tt, 1, 2 * half + 1]
                c0, c1, c2, c3 = acc[tt, 0], acc[tt, 1], acc[tt, 2], acc[tt, 3]
                if TERMS == 3:  # smallest part first: it is added before the big products
                    c0, c1, c2, c3 = mma_bf16_16816(a0, a1, a2, a3, r0, r1, c0, c1, c2, c3)
                c0, c1, c2, c3 = mma_bf16_16816(a0, a1, a2, a3, q0, q1, c0, c1, c2, c3)
                c0, c1, c2, c3 = mma_bf16_16816(a0, a1, a2, a3, p0, p1, c0, c1, c2, c3)
                acc[tt, 0], acc[tt, 1], acc[tt, 2], acc[tt, 3] = c0, c1, c2, c3

    @cuda.jit(device=True, inline=True)
    def weight_row(tt, i, n, k):
        """Element offset of row ``i`` (0..15) of the block's tile ``tt`` in W (-1: past the matrix)."""
        if SWIGLU:  # rows 0..7: gate rows j..j+7; 8..15: the matching up rows
            j = (cuda.blockIdx.x * T + tt) * 8 + (i & 7)
            return (int64(j) + (i >> 3) * int64(n)) * k if j < n else int64(-1)
        f = (cuda.blockIdx.x * T + tt) * 16 + i
        return int64(f) * k if f < n else int64(-1)

    @cuda.jit(device=True, inline=True)
    def copy_weights(slot_at, w_at, n, k, k0, lane):
        """Start copying the block's weight rows ``[k0, k0 + 64)`` into a slot: row r (tile-major) at
        ``r * 128``, its 16-byte chunk q at ``q ^ (4 * (r & 1))`` (rows 2i and 2i + 1, which one
        fragment load reads together, on different banks). FRAG: the slot's two steps as they lie in W,
        2 T chunks of 512 bytes (step, tile, half), zeros past K's last step."""
        if FRAG:
            steps = (k + 31) >> 5
            for c in range(4 * T):
                step = (k0 >> 5) + c // (2 * T)
                chunk = (int64(cuda.blockIdx.x) * steps + step) * (2 * T) + c % (2 * T)
                inside = step < steps
                src = w_at + uint64((chunk * 32 + lane) * 16) if inside else w_at
                cp_async16(slot_at + uint32(c * 512 + lane * 16), src, uint32(16) if inside else uint32(0))
            return
        q = lane & 7
        for c in range(4 * T):
            r = 4 * c + (lane >> 3)
            at = weight_row(r >> 4, r & 15, n, k)
            inside = at >= 0 and k0 + 8 * q < k
            src = w_at + uint64(at + k0 + 8 * q) * uint64(2) if inside else w_at
            cp_async16(slot_at + uint32(r * 128 + ((q ^ (4 * (r & 1))) << 4)), src, uint32(16) if inside else uint32(0))

    @cuda.jit(device=True, inline=True)
    def copy_activations(slot_at, x_at, norm_at, rows, k, k0, lane):
        """Start copying x ``[0:8, k0:k0 + 64)`` (zeros past ``rows`` or k; row r at ``X_AT + 256 r``,
        chunk q at ``q ^ (r & 1)``) and, when normed, the norm weights of those k into a slot."""
        q = lane & 15
        for c in range(4):
            r = 2 * c + (lane >> 4)
            inside = r < rows and k0 + 4 * q < k
            src = x_at + uint64(int64(r) * k + k0 + 4 * q) * uint64(4) if inside else x_at
            dst = slot_at + uint32(X_AT + r * 256 + ((q ^ (r & 1)) << 4))
            cp_async16(dst, src, uint32(16) if inside else uint32(0))
        if normed and lane < 16:
            inside = k0 + 4 * q < k
            src = norm_at + uint64(k0 + 4 * q) * uint64(4) if inside else norm_at
            cp_async16(slot_at + uint32(NORM_AT + (q << 4)), src, uint32(16) if inside else uint32(0))

    @cuda.jit(device=True, inline=True)
    def ring_loop(acc, w, x, norm_w, rows, n, k, warp, lane):
        """The warp's slots (64 k each: ``warp``, ``warp + W``, ...) through its ring; returns the
        lane's sum of squares of its activations (0 when not normed)."""
        sh = cuda.shared.array(0, uint32, alignment=16)
        ring = shared_address(sh) + uint32(warp * RING * SLOT)
        w_at = global_address(w)
        g = lane >> 2
        t = lane & 3
        mine = (((k + 63) >> 6) - warp + W - 1) // W  # this warp's slots
        for i in range(RING):  # the weights never depend on the previous kernel: before the wait
            if i < mine:
                copy_weights(ring + uint32(i * SLOT), w_at, n, k, (warp + i * W) * 64, lane)
            cp_async_commit()
        launch_dependents()
        grid_dependency_wait()
        x_at = global_address(x)
        norm_at = global_address(norm_w)
        for i in range(RING):
            if i < mine:
                copy_activations(ring + uint32(i * SLOT), x_at, norm_at, rows, k, (warp + i * W) * 64, lane)
            cp_async_commit()
        wr = cuda.local.array((1, T, 2, 4), uint32)
        xr = cuda.local.array((1, 8), float32)
        ss = float32(0.0)
        for i in range(mine):
            slot_at = ring + uint32((i % RING) * SLOT)
            wait_slot()  # this lane's copies of slot i have landed (groups are uniform: RING - 1 newer)
            cuda.syncwarp()  # ... and every lane's
            for j in range(2):  # the slot's two 32-k steps: chunk 4j + t of rows g, g + 8 of each tile
                for tt in range(T):
                    for h in range(2):
                        if FRAG:  # the slot as copy_weights lays it out: (step, tile, half), lane-major
                            at = slot_at + uint32(((j * T + tt) * 2 + h) * 512 + lane * 16)
                        else:
                            r = 16 * tt + 8 * h + g
                            at = slot_at + uint32(r * 128 + (((4 * j + t) ^ (4 * (r & 1))) << 4))
                        wr[0, tt, h, 0], wr[0, tt, h, 1], wr[0, tt, h, 2], wr[0, tt, h, 3] = lds_u32x4(at)
                for half in range(2):  # x[g, 32j + 8t + 4 half ..]: chunk 8j + 2t + half
                    at = slot_at + uint32(X_AT + g * 256 + (((8 * j + 2 * t + half) ^ (g & 1)) << 4))
                    a, b, c, d = lds_u32x4(at)
                    e = 4 * half
                    xr[0, e] = libdevice.int_as_float(int32(a))
                    xr[0, e + 1] = libdevice.int_as_float(int32(b))
                    xr[0, e + 2] = libdevice.int_as_float(int32(c))
                    xr[0, e + 3] = libdevice.int_as_float(int32(d))
                    if normed:
                        ss += (xr[0, e] * xr[0, e] + xr[0, e + 1] * xr[0, e + 1] + xr[0, e + 2] * xr[0, e + 2]
                               + xr[0, e + 3] * xr[0, e + 3])
                        a, b, c, d = lds_u32x4(slot_at + uint32(NORM_AT + ((8 * j + 2 * t + half) << 4)))
                        xr[0, e] *= libdevice.int_as_float(int32(a))
                        xr[0, e + 1] *= libdevice.int_as_float(int32(b))
                        xr[0, e + 2] *= libdevice.int_as_float(int32(c))
                        xr[0, e + 3] *= libdevice.int_as_float(int32(d))
                step_mmas(acc, wr, 0, xr, 0)
            cuda.syncwarp()  # every lane has read the slot: refill it
            nxt = i + RING
            if nxt < mine:
                k0 = (warp + nxt * W) * 64
                copy_weights(slot_at, w_at, n, k, k0, lane)
                copy_activations(slot_at, x_at, norm_at, rows, k, k0, lane)
            cp_async_commit()
        return ss

    @cuda.jit(device=True, inline=True)
    def register_loop(acc, w, x, norm_w, rows, n, k, warp, lane):
        """The warp's 32-k steps (``warp``, ``warp + W``, ...), U steps' weights loaded into registers
        before their MMAs; returns the lane's sum of squares of its activations (0 when not normed)."""
        g = lane >> 2
        t = lane & 3
        # Element offsets of this lane's two weight rows in each tile (-1: past the matrix).
        row_at = cuda.local.array((T, 2), int64)
        for tt in range(T):
            for h in range(2):
                row_at[tt, h] = weight_row(tt, g + 8 * h, n, k)
        ss = float32(0.0)
        x_row = int64(g) * k
        has_row = g < rows
        steps = (k + 31) >> 5
        wr = cuda.local.array((U, T, 2, 4), uint32)
        xr = cuda.local.array((U, 8), float32)
        # Programmatic dependent launch (common.py). Loading the first round's weights before the wait,
        # as the fp32 GEMV does, took t1w16u4 from 48 to 71 registers (one block an SM instead of two):
        # only ``early`` builds do.
        if early:
            for u in range(U):
                load_weights(w, row_at, k, (warp + u * W) * 32 + 8 * t, u, wr)
        launch_dependents()
        grid_dependency_wait()
        for s0 in range(warp, steps, W * U):
            if FRAG:
                for u in range(U):
                    load_fragments(w, steps, s0 + u * W, u, wr, lane)
            elif not early or s0 != warp:  # the first round's are in flight already
                for u in range(U):  # every load of U steps before the first MMA: U * T * 32 bytes a lane in flight
                    load_weights(w, row_at, k, (s0 + u * W) * 32 + 8 * t, u, wr)
            for u in range(U):
                kk = (s0 + u * W) * 32 + 8 * t
                if kk < k and has_row:
                    ss += load_activations(x, x_row + kk, norm_w, kk, normed, xr, u)
                else:
                    for e in range(8):
                        xr[u, e] = float32(0.0)
            if hold:  # the first MMA waits for every weight word of the round: ptxas cannot sink a load below it
                dep = uint32(0)
                for u in range(U):
                    for tt in range(T):
                        for h in range(2):
                            for e in range(4):
                                dep ^= wr[u, tt, h, e]
                acc[0, 0] += libdevice.int_as_float(int32(dep) & (int32(rows) >> int32(31)))  # + 0.0: rows >= 0
            for u in range(U):
                step_mmas(acc, wr, u, xr, u)
        return ss

    @cuda.jit(device=True, inline=True)
    def inverse_rms(inv, part, parts, rows, k, eps, lane):
        """``inv[r] = 1 / rms`` of each row from the producer's ``parts`` blocks of squares (one warp:
        lane l takes blocks l, l + 32, ..., two blocks' loads in flight; then a shuffle tree)."""
        total = cuda.local.array(8, float32)
        sums = cuda.local.array((2, 8), float32)
        for r in range(8):
            total[r] = float32(0.0)
        for b0 in range(lane, parts, 64):
            for j in range(2):  # every load out before the first add
                at = int64(min(b0 + 32 * j, parts - 1)) * 8  # past the end: a valid address, its sums unused
                sums[j, 0], sums[j, 1], sums[j, 2], sums[j, 3] = load_f32x4(part, at)
                sums[j, 4], sums[j, 5], sums[j, 6], sums[j, 7] = load_f32x4(part, at + 4)
            for j in range(2):
                if b0 + 32 * j < parts:
                    for r in range(8):
                        total[r] += sums[j, r]
        for r in range(8):
            total[r] = warp_sum(total[r])
        if lane < rows:
            inv[lane] = float32(1.0) / math.sqrt(total[lane] / float32(k) + eps)

    @cuda.jit(device=True, inline=True)
    def body(y, x, w, norm_w, rows, n, k, ldy, eps, kept, xn, part, parts, next_w, next_bytes):
        red = cuda.shared.array((W, T, 16, 8), float32)
        red_ss = cuda.shared.array((W, 8), float32)
        inv = cuda.shared.array(8, float32)
        tid = cuda.threadIdx.x
        lane = tid & 31
        warp = tid >> 5
        g = lane >> 2
        t = lane & 3
        acc = cuda.local.array((T, 4), float32)
        for tt in range(T):
            for e in range(4):
                acc[tt, e] = float32(0.0)
        ss = float32(0.0)
        if NORM_IN and warp == W:
            launch_dependents()
            grid_dependency_wait()
            inverse_rms(inv, part, parts, rows, k, eps, lane)
        elif RING:
            ss = ring_loop(acc, w, x, norm_w, rows, n, k, warp, lane)
        else:
            ss = register_loop(acc, w, x, norm_w, rows, n, k, warp, lane)
        if NEXT and tid == 0:
            prefetch_block_share(next_w, next_bytes)
        if not NORM_IN or warp < W:
            for tt in range(T):
                red[warp, tt, g, 2 * t] = acc[tt, 0]
                red[warp, tt, g, 2 * t + 1] = acc[tt, 1]
                red[warp, tt, g + 8, 2 * t] = acc[tt, 2]
                red[warp, tt, g + 8, 2 * t + 1] = acc[tt, 3]
        if normed:
            ss += cuda.shfl_xor_sync(0xFFFFFFFF, ss, 1)
            ss += cuda.shfl_xor_sync(0xFFFFFFFF, ss, 2)
            if t == 0:
                red_ss[warp, g] = ss
        cuda.syncthreads()
        if normed and tid < 8:
            total = float32(0.0)
            for wp in range(W):
                total += red_ss[wp, tid]
            inv[tid] = float32(1.0) / math.sqrt(total / float32(k) + eps)
        if normed:
            cuda.syncthreads()
        if keep:
            keep_normed(kept, x, norm_w, inv, rows, k, tid, THREADS)
        # One output per thread: consecutive threads take consecutive columns of one row.
        for idx in range(tid, OUTS, THREADS):
            r = idx // (T * COLS)
            col = idx % (T * COLS)
            tt = col // COLS
            i = col % COLS
            out_col = cuda.blockIdx.x * T * COLS + col
            square = float32(0.0)
            if r < rows and out_col < n:
                v = float32(0.0)
                for wp in range(W):
                    v += red[wp, tt, i, r]
                if SCALED:
                    v *= inv[r]
                at = int64(r) * ldy + out_col
                if SWIGLU:
                    up = float32(0.0)
                    for wp in range(W):
                        up += red[wp, tt, i + 8, r]
                    if SCALED:
                        up *= inv[r]
                    sig = float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * v)
                    y[at] = v * sig * up
                elif epilogue == "residual":
                    v += y[at]
                    y[at] = v
                    if NORM_OUT:
                        xn[at] = v * norm_w[out_col]
                        square = v * v
                else:
                    y[at] = v
            if NORM_OUT:  # a row's 16 columns are a half-warp's lanes: its sum of squares by a shuffle tree
                for offset in (8, 4, 2, 1):
                    square += cuda.shfl_xor_sync(0xFFFFFFFF, square, offset)
                if i == 0 and r < rows:
                    part[cuda.blockIdx.x * 8 + r] = square

    if keep and NEXT:
        def mma_gemv(y, x, w, norm_w, rows, n, k, ldy, eps, kept, next_w, next_bytes):
            body(y, x, w, norm_w, rows, n, k, ldy, eps, kept, y, y, 0, next_w, next_bytes)
    elif keep:
        def mma_gemv(y, x, w, norm_w, rows, n, k, ldy, eps, kept):
            body(y, x, w, norm_w, rows, n, k, ldy, eps, kept, y, y, 0, y, 0)
    elif NORM_OUT:
        def mma_gemv(y, x, w, norm_w, rows, n, k, ldy, eps, xn, part):
            body(y, x, w, norm_w, rows, n, k, ldy, eps, y, xn, part, 0, y, 0)
    elif NORM_IN:
        def mma_gemv(y, x, w, norm_w, rows, n, k, ldy, eps, part, parts):
            body(y, x, w, norm_w, rows, n, k, ldy, eps, y, y, part, parts, y, 0)
    elif NEXT:
        def mma_gemv(y, x, w, norm_w, rows, n, k, ldy, eps, next_w, next_bytes):
            body(y, x, w, norm_w, rows, n, k, ldy, eps, y, y, y, 0, next_w, next_bytes)
    else:
        def mma_gemv(y, x, w, norm_w, rows, n, k, ldy, eps):
            body(y, x, w, norm_w, rows, n, k, ldy, eps, y, y, y, 0, y, 0)

    return mma_gemv


MMA_SIG = (F32P, F32P, U64P, F32P, int32, int32, int32, int32, float32)


def mma_kernel_name(normed: bool, epilogue: str, T: int, W: int, U: int, TERMS: int, keep: bool = False,
                    RING: int = 0, chain: str = "", hold: bool = False, early: bool = False, NEXT: bool = False,
                    FRAG: bool = False) -> str:
    ring = (f"r{RING}" if RING else "h" if hold else "e" if early else "") + ("f" if FRAG else "")  # f: fragment order
    ring += "n" if NEXT else ""
    norm = "normed_" if normed else "normin_" if chain == "in" else ""
    fusion = f"{norm}{'keep_' if keep else ''}{epilogue}{'_normout' if chain == 'out' else ''}"
    return f"mma_gemv_{fusion}_t{T}w{W}u{U}s{TERMS}{ring}"


def fragment_order(w: np.ndarray, T: int, swiglu: bool) -> np.ndarray:
    """W ([rows, K] bf16 bits, row-major) in the order a ``FRAG`` build of T tiles reads it: for each
    block, each 32-k step, each tile and half, the 32 lanes' 16 bytes (lane 4g + t: row g + 8 half of
    the tile, k 8t..8t+7 of the step), i.e. [block, step, tile, half, g, t, 8]. Rows past the matrix
    (a last partial tile; for swiglu, whose tiles pair 8 gate rows with their 8 up rows, past
    ``rows / 2``) and k past K are zeros, as the row-major loads make them."""
    rows, k = w.shape
    cols = rows // 2 if swiglu else rows
    blocks, steps = -(-cols // (T * (8 if swiglu else 16))), -(-k // 32)
    padded = np.zeros((rows + 1, steps * 32), w.dtype)  # row ``rows``: the zeros past the matrix
    padded[:rows, :k] = w
    block, tile, i = np.meshgrid(np.arange(blocks), np.arange(T), np.arange(16), indexing="ij")
    if swiglu:
        j = (block * T + tile) * 8 + (i & 7)
        row = np.where(j < cols, j + (i >> 3) * cols, rows)
    else:
        f = (block * T + tile) * 16 + i
        row = np.where(f < cols, f, rows)
    parts = padded.reshape(rows + 1, steps, 4, 8)[row]  # [block, tile, 16 rows, step, t, 8]
    return np.ascontiguousarray(parts.reshape(blocks, T, 2, 8, steps, 4, 8).transpose(0, 4, 1, 2, 3, 5, 6))


@cuda.jit
def fragment_order_bf16(dst, src, rows, k, T, swiglu, chunks):
    """``fragment_order`` on the device: thread i writes 16-byte chunk i of the reordered matrix (lane
    i % 32 of tile half i // 32) from the row-major ``src`` ([rows, k] bf16, k a multiple of 8), zeros
    past the matrix. ``chunks``: the reordered matrix's 16-byte chunks."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= chunks:
        return
    lane = i & 31
    half = (i >> 5) & 1
    rest = (i >> 6) // T  # (block, step)
    tile = (i >> 6) % T
    steps = (k + 31) >> 5
    step = rest % steps
    block = rest // steps
    r = (lane >> 2) + 8 * half  # the tile's row
    cols = rows // 2 if swiglu else rows
    row = int64(-1)
    if swiglu:
        j = (block * T + tile) * 8 + (r & 7)
        if j < cols:
            row = int64(j) + (r >> 3) * int64(cols)
    else:
        f = (block * T + tile) * 16 + r
        if f < cols:
            row = int64(f)
    k0 = step * 32 + 8 * (lane & 3)
    a = uint64(0)
    b = uint64(0)
    if row >= 0 and k0 < k:
        at = (row * k + k0) >> 2  # in 8-byte words
        a = src[at]
        b = src[at + 1]
    dst[2 * int64(i)] = a
    dst[2 * int64(i) + 1] = b


def ring_slot_bytes(T: int, normed: bool) -> int:
    """One slot of a RING shape's ring: 16 T weight rows and 8 activation rows of 64 k, the norm's 64."""
    return 16 * T * 128 + 8 * 256 + (256 if normed else 0)


def ring_bytes(normed: bool, T: int, W: int, RING: int) -> int:
    """Dynamic shared memory of a RING shape: each warp's RING slots."""
    return W * RING * ring_slot_bytes(T, normed)


# The shapes forward.DECODE_GEMMS uses, from tools/bench_decode_gemm.py on the H200: 16 warps with
# 4 steps in flight for the 4096-row matrices (too few tiles to fill 132 SMs otherwise), 4 tiles a
# warp for gate/up (x read once per 64 weight rows), 4 tiles x 8 warps for the LM head (its 151936
# rows fill the GPU anyway: 3809 GB/s at 8 rows against 3204 for (1, 8, 2)). Also timed there and
# dropped: (1, 8, 4), (1, 16, 2), (4, 4, 2), (8, 4, 1), and 2 tiles (x shared by 32 weight rows) with
# 8 or 16 warps and 2 or 4 steps, slower on every matrix (fewer blocks, not less L2 traffic, decides);
# 2 bf16 parts instead of 3 were about 3% faster. Timed and dropped in the tenth session: each lane
# reading 2 or 4 contiguous 16-byte vectors of its rows a step (a lane quad covering 128-256 bytes of
# a row instead of 64; slower on every matrix), and the shapes held by ``.maxnreg`` to fewer registers
# (more blocks an SM, with spills: 5-45% slower).
MMA_SHAPES = [(1, 8, 2, 3), (1, 16, 4, 3), (4, 4, 1, 3), (4, 8, 1, 3)]
# (T, W, RING) of the ring shapes (U = 1, three terms).
# (T, W, U, TERMS, RING) of the ring shapes: t1w8 with 3 slots streams down at batch 8 at 3500 GB/s
# against 3316 for t1w16u4s3 (tools/bench_decode_gemm.py); see forward.DECODE_GEMMS.
RING_SHAPES = [(1, 8, 1, 3, 3)]
FUSIONS = ((False, "store"), (True, "store"), (False, "residual"), (True, "swiglu"))
for _shape in [_s + (0,) for _s in MMA_SHAPES] + RING_SHAPES:
    _t, _w, _u, _terms, _ring = _shape
    for _normed, _epilogue in FUSIONS:
        _meta = {"threads": 32 * _w, "cols": _t * (8 if _epilogue == "swiglu" else 16),
                 "epilogue": _epilogue, "normed": int(_normed), "terms": _terms, "max_rows": 8, "grid_wait": 1}
        if _ring:
            _meta["shared"] = ring_bytes(_normed, _t, _w, _ring)
        KERNELS[mma_kernel_name(_normed, _epilogue, _t, _w, _u, _terms, RING=_ring)] = (
            make_mma_gemv(_normed, _epilogue, _t, _w, _u, _terms, RING=_ring), MMA_SIG, _meta)
# Batched decode's q/k/v, o, gate/up and down shapes (forward.DECODE_GEMMS) asking L2 for the next GEMM's
# first weights at their tail (``NEXT``; forward.Forward.gemm_prefetch).
NEXT_GEMMS = [(True, "store", (1, 8, 2, 3, 0)), (False, "residual", (1, 16, 4, 3, 0)),
              (True, "swiglu", (4, 4, 1, 3, 0)), (False, "residual", (1, 8, 1, 3, 3))]
for _normed, _epilogue, (_t, _w, _u, _terms, _ring) in NEXT_GEMMS:
    _meta = {"threads": 32 * _w, "cols": _t * (8 if _epilogue == "swiglu" else 16), "epilogue": _epilogue,
             "normed": int(_normed), "terms": _terms, "max_rows": 8, "grid_wait": 1, "next": 1}
    if _ring:
        _meta["shared"] = ring_bytes(_normed, _t, _w, _ring)
    KERNELS[mma_kernel_name(_normed, _epilogue, _t, _w, _u, _terms, RING=_ring, NEXT=True)] = (
        make_mma_gemv(_normed, _epilogue, _t, _w, _u, _terms, RING=_ring, NEXT=True), MMA_SIG + (U32P, int32), _meta)
# Batched decode's q/k/v, o / down and gate/up shapes reading their weights in fragment order
# (``FRAG``, ``fragment_order``): whole 128-byte lines, a warp step's bytes contiguous. Alone at 8 rows
# on the Qwen3-8B matrices (H100, .devq-style script against the builds above, bit-identical outputs),
# GB/s: gate/up 2768-2777 -> 3056-3065, q/k/v 2225-2229 -> 2558-2570, down 2616-2622 -> 2881-2890, o
# 2431-2445 -> 2558-2561. In a batch-8 step (tools/bench_decode_step.py --cases 8x512 --gemms
# qkv=t1w8u2s3f+gate_up=t4w4u1s3f: the row-major weights read in fragment order, which times the same)
# 6.054-6.062 -> 5.751 ms. They read a second, reordered copy of the weights beside the row-major one
# that cuBLASLt and the one-row GEMVs read (CudaRunner._fragment_copies, forward.FRAGMENT_ORDER).
# The ring shape of o and down (their staged launches at 7 and 8 rows) copies each slot's 2 KB whole.
# Each but q/k/v's (which asks L2 for nothing) has a NEXT build too, as their row-major shapes do.
FRAG_GEMMS = [(True, "store", (1, 8, 2, 3, 0), False), (False, "residual", (1, 16, 4, 3, 0), True),
              (True, "swiglu", (4, 4, 1, 3, 0), True), (False, "residual", (1, 8, 1, 3, 3), True)]
KERNELS["fragment_order_bf16"] = (fragment_order_bf16, (U64P, U64P, int32, int32, int32, int32, int32),
                                  {"threads": 256})
for _normed, _epilogue, (_t, _w, _u, _terms, _ring), _next in FRAG_GEMMS:
    for _n in (False, True) if _next else (False,):
        _meta = {"threads": 32 * _w, "cols": _t * (8 if _epilogue == "swiglu" else 16), "epilogue": _epilogue,
                 "normed": int(_normed), "terms": _terms, "max_rows": 8, "grid_wait": 1, "frag": 1, "tiles": _t}
        if _ring:
            _meta["shared"] = ring_bytes(_normed, _t, _w, _ring)
        if _n:
            _meta["next"] = 1
        KERNELS[mma_kernel_name(_normed, _epilogue, _t, _w, _u, _terms, RING=_ring, NEXT=_n, FRAG=True)] = (
            make_mma_gemv(_normed, _epilogue, _t, _w, _u, _terms, RING=_ring, NEXT=_n, FRAG=True),
            MMA_SIG + ((U32P, int32) if _n else ()), _meta)
# The chained norm of batched decode (``make_mma_gemv``'s ``chain``; forward.CHAIN_IN_GEMMS): the
# residual GEMMs that write the next norm's input (o, down) and the GEMMs that read it (q/k/v, gate/up,
# LM head). ``tools/bench_decode_gemm.py --rows 8`` on the H200, GB/s, the normed kernel it replaces in
# brackets: q/k/v t1w8u2s3 2781 (2567), gate/up t4w4u1s3h 3615 (3616), LM head t4w4u1s3h 3845 (3792
# for t4w8u1s3); o t1w16u4s3 2878 (2896), down t1w16u4s3 3427 (3490 for the ring shape, whose chained
# epilogue read 3388). Without ``hold`` the t4 shapes read 2575 (gate/up) and 3062 (LM head): ptxas
# sank half of a round's weight loads below its first MMAs. ``hold`` on the t1 shapes was slower (o
# t1w16u4s3 2087: 70 registers, one block an SM). The other chained shapes timed: q/k/v t1w16u4s3
# 2598, gate/up t1w16u4s3 3322 and t1w8u2s3h 3395.
CHAIN_KERNELS = [("out", "residual", (1, 16, 4, 3), False), ("in", "store", (1, 8, 2, 3), False),
                 ("in", "swiglu", (4, 4, 1, 3), True), ("in", "store", (4, 4, 1, 3), True)]
for _chain, _epilogue, (_t, _w, _u, _terms), _hold in CHAIN_KERNELS:
    KERNELS[mma_kernel_name(False, _epilogue, _t, _w, _u, _terms, chain=_chain, hold=_hold)] = (
        make_mma_gemv(False, _epilogue, _t, _w, _u, _terms, chain=_chain, hold=_hold),
        MMA_SIG + ((F32P, F32P) if _chain == "out" else (F32P, int32)),
        {"threads": 32 * (_w + 1 if _chain == "in" else _w), "cols": _t * (8 if _epilogue == "swiglu" else 16),
         "epilogue": _epilogue, "normed": 0, "chain": _chain, "terms": _terms, "max_rows": 8, "grid_wait": 1})
# The MoE router's decode GEMM (ninfer/backends/cuda/moe.py ROUTER_NORMED_DECODE_GEMM): normalises x
# itself and keeps the normalised rows for the routing and the expert GEMMs. 16 warps of 4 steps load
# a 2048-wide row in one round: 35B-A3B b1 329.5-331.0 tok/s against 317.9-320.0 with (1, 8, 2), four
# rounds (tools/gpu_bench_hybrid.py, alternating runs).
ROUTER_SHAPE = (1, 16, 4, 3)
for _early in (False, True):  # ninfer/backends/cuda/moe.py ROUTER_NORMED_DECODE_GEMM, CudaMoe.early_router
    KERNELS[mma_kernel_name(True, "store", *ROUTER_SHAPE, keep=True, early=_early)] = (
        make_mma_gemv(True, "store", *ROUTER_SHAPE, keep=True, early=_early), MMA_SIG + (F32P,),
        {"threads": 32 * ROUTER_SHAPE[1], "cols": 16, "epilogue": "store", "normed": 1, "keep": 1, "terms": 3,
         "max_rows": 8, "grid_wait": 1})


# The fp32 GEMV with the same fusions and arguments (terms 0: exact fp32 products), for few rows.
for _m in GEMV_ROWS:
    for _normed, _epilogue in FUSIONS[1:]:
        KERNELS[f"gemv_{'normed_' if _normed else ''}{_epilogue}_m{_m}"] = (
            make_gemv(_m, 4, _normed, _epilogue), MMA_SIG,
            {"threads": GEMV_THREADS, "cols": 2 if _epilogue == "swiglu" else 4, "epilogue": _epilogue,
             "normed": int(_normed), "terms": 0, "max_rows": _m, "grid_wait": 1})
# The normed one- and two-row GEMV with a DeltaNet in_proj's conv in its epilogue (HybridForward.conv_in_gemv).
for _m in CONV_GEMV_ROWS:
    KERNELS[f"gemv_normed_conv_m{_m}"] = (
        make_gemv(_m, 4, True, "conv"), MMA_SIG + (F32P, F32P, int64, I32P, I32P, int32, F32P),
        {"threads": GEMV_THREADS, "cols": 4, "epilogue": "conv", "normed": 1, "terms": 0, "max_rows": _m,
         "grid_wait": 1})
# The one-row residual GEMV holding its first 4 steps before the wait (a 4096-wide row's whole share a
# thread): Forward.preload_o (ninfer/backends/cuda/forward.py PRELOADED_O_GEMV), on for MoE hybrids.
KERNELS["gemv_residual_m1p4"] = (make_gemv(1, 4, False, "residual", PRELOAD=4), MMA_SIG, {
    "threads": GEMV_THREADS, "cols": 4, "epilogue": "residual", "normed": 0, "terms": 0, "max_rows": 1,
    "grid_wait": 1})
# Its build asking L2 at its tail for the next GEMM's first weights (a MoE layer's router:
# HybridForward.router_prefetch).
KERNELS["gemv_residual_m1p4n"] = (make_gemv(1, 4, False, "residual", PRELOAD=4, NEXT=True), MMA_SIG + (U32P, int32),
                                  {**KERNELS["gemv_residual_m1p4"][2], "next": 1})
# A one-row DeltaNet out projection finishing the split delta rule's gated RMSNorm
# (HybridForward.rule_norm_in_gemv), and its build holding four steps (Forward.preload_o).
HEAD_NORM_SIG = MMA_SIG + (F32P, int32, int32)
for _preload, _next in ((1, False), (4, False), (4, True)):  # and the preloaded one asking L2 for the router
    KERNELS["gemv_residual_headnorm_m1" + (f"p{_preload}" if _preload > 1 else "") + ("n" if _next else "")] = (
        make_gemv(1, 4, False, "residual", PRELOAD=_preload, HEAD_NORM=True, NEXT=_next),
        HEAD_NORM_SIG + ((U32P, int32) if _next else ()),
        {"threads": GEMV_THREADS, "cols": 4, "epilogue": "residual", "normed": 0, "head_norm": 1, "terms": 0,
         "max_rows": 1, "grid_wait": 1, **({"next": 1} if _next else {})})
# The one-row MoE router as an fp32 GEMV (CudaMoe.router_gemv): two steps a thread (a 2048-wide row's
# whole share) held before the wait, in blocks small enough to sit beside the o / out GEMV that runs
# before it, so its weights stream during that GEMV instead of after it (the tensor-core router's
# blocks of 512 threads wait for SMs the GEMV leaves); it keeps the normalised row and asks L2 for the
# next layer's first weights as the tensor-core router's ``en`` build does (``next_bytes`` 0: nothing).
ROUTER_GEMV_COLS = (2, 4)
for _cols in ROUTER_GEMV_COLS:
    KERNELS[f"gemv_normed_keep_store_m1c{_cols}p2n"] = (
        make_gemv(1, _cols, True, "store", PRELOAD=2, KEEP=True, NEXT=True), MMA_SIG + (F32P, U32P, int32),
        {"threads": GEMV_THREADS, "cols": _cols, "epilogue": "store", "normed": 1, "keep": 1, "terms": 0,
         "max_rows": 1, "grid_wait": 1, "next": 1})
# The MoE router's early build asking L2, once its weights are in, for the first bytes of the next layer's
# first GEMM (CudaMoe.next_prefetch): DRAM would idle through the routing that follows.
KERNELS[mma_kernel_name(True, "store", *ROUTER_SHAPE, keep=True, early=True, NEXT=True)] = (
    make_mma_gemv(True, "store", *ROUTER_SHAPE, keep=True, early=True, NEXT=True), MMA_SIG + (F32P, U32P, int32),
    {**KERNELS[mma_kernel_name(True, "store", *ROUTER_SHAPE, keep=True, early=True)][2], "next": 1})
