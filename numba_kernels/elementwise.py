"""Row-wise kernels of the decoder: embedding gather, RMSNorm (+ residual add), SiLU-mul, counts.

Activations are fp32 ``[rows, width]`` row-major; weights of norms are fp32 (widened at upload).
Launch: grid ``(rows,)``, block 1024 (any multiple of 32 up to 1024) unless noted.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64, uint32

from numba_kernels.common import (F32P, I32P, U16P, U32P, bf16_hi, bf16_lo, bf16_to_f32, block_sum, f32_to_bf16,
                                  grid_dependency_wait, launch_dependents, load_f32x4, load_u32x4, store_u32x4,
                                  warp_sum)
from numba_kernels.mma import pack_bf16x2
from numba_kernels.rope import store_bf16, store_f32


def embed(out, table, tokens, hidden):
    """out[r, :] = bf16 table[tokens[r], :] widened to fp32. Grid ``(ceil(hidden / 256), rows)``."""
    launch_dependents()
    grid_dependency_wait()  # may follow a kernel of the previous step that still reads ``out``
    row = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < hidden:
        out[row * hidden + i] = bf16_to_f32(table[tokens[row] * hidden + i])


# Elements of a row each thread of a norm keeps in registers: with 1024 threads, rows up to 8192 wide
# are read once, with every load of the thread in flight together (a decode step's norm is one block
# a row, a chain of latencies); wider rows finish in a loop that reads x again.
NORM_ITEMS = 8


@cuda.jit(device=True, inline=True)
def load_items(values, src, base, hidden):
    """``values[j] = src[base + i]`` for the thread's items ``i = tid + j * blockDim`` (0 past ``hidden``)."""
    for j in range(NORM_ITEMS):
        i = cuda.threadIdx.x + j * cuda.blockDim.x
        values[j] = src[base + i] if i < hidden else float32(0.0)


def make_norm_store(store):
    """``(out, x, xs, weight, ws, base, hidden, total, eps)``: ``out = x / sqrt(mean(x^2) + eps) *
    weight`` through ``store`` from the thread's items, then any wider rest."""

    @cuda.jit(device=True, inline=True)
    def norm_store(out, x, xs, weight, ws, base, hidden, total, eps):
        inv = float32(1.0) / math.sqrt(total / float32(hidden) + eps)
        for j in range(NORM_ITEMS):
            i = cuda.threadIdx.x + j * cuda.blockDim.x
            if i < hidden:
                store(out, base + i, xs[j] * inv * ws[j])
        for i in range(cuda.threadIdx.x + NORM_ITEMS * cuda.blockDim.x, hidden, cuda.blockDim.x):
            store(out, base + i, x[base + i] * inv * weight[i])

    return norm_store


def make_rmsnorm(store):
    norm_store = make_norm_store(store)

    def rmsnorm(out, x, weight, hidden, eps):
        """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight."""
        launch_dependents()  # programmatic dependent launch: common.py
        ws = cuda.local.array(NORM_ITEMS, float32)
        load_items(ws, weight, 0, hidden)  # weights: no kernel of the step writes them, so before the wait
        grid_dependency_wait()
        scratch = cuda.shared.array(32, float32)
        base = cuda.blockIdx.x * hidden
        xs = cuda.local.array(NORM_ITEMS, float32)
        load_items(xs, x, base, hidden)
        acc = float32(0.0)
        for j in range(NORM_ITEMS):
            acc += xs[j] * xs[j]
        for i in range(cuda.threadIdx.x + NORM_ITEMS * cuda.blockDim.x, hidden, cuda.blockDim.x):
            v = x[base + i]
            acc += v * v
        norm_store(out, x, xs, weight, ws, base, hidden, block_sum(acc, scratch), eps)

    return rmsnorm


# rmsnorm_rows_bf16: warps a block, float4s a lane has in flight per pass step, and the most blocks
# a launch (two an SM of the H200: the rows in flight between a warp's two passes stay in L2).
ROW_NORM_WARPS = 8
ROW_NORM_QUADS = 8
ROW_NORM_OCTETS = 4  # the second pass: 8-element octets a lane loads before it stores any
ROW_NORM_BLOCKS = 264


@cuda.jit(device=True, inline=True)
def load_octet(dst, j, src, at):
    """Elements ``at .. at + 7`` of ``src`` (fp32, 16-byte aligned) into ``dst[j, 0..7]``."""
    dst[j, 0], dst[j, 1], dst[j, 2], dst[j, 3] = load_f32x4(src, at)
    dst[j, 4], dst[j, 5], dst[j, 6], dst[j, 7] = load_f32x4(src, at + 4)


@cuda.jit(device=True, inline=True)
def store_normed_octet(out, at, xs, ws, j, inv):
    """bf16(xs[j, e] * inv * ws[j, e]) for e = 0..7 as four bf16 pairs at word ``at`` of ``out``."""
    w0 = pack_bf16x2(xs[j, 0] * inv * ws[j, 0], xs[j, 1] * inv * ws[j, 1])
    w1 = pack_bf16x2(xs[j, 2] * inv * ws[j, 2], xs[j, 3] * inv * ws[j, 3])
    w2 = pack_bf16x2(xs[j, 4] * inv * ws[j, 4], xs[j, 5] * inv * ws[j, 5])
    w3 = pack_bf16x2(xs[j, 6] * inv * ws[j, 6], xs[j, 7] * inv * ws[j, 7])
    store_u32x4(out, at, w0, w1, w2, w3)


@cuda.jit(device=True, inline=True)
def normalize_row(out, x, weight, row, lane, hidden, eps):
    """rmsnorm_rows_bf16's work on one row (its warp's)."""
    base = int64(row) * hidden
    quads = hidden >> 2
    acc = float32(0.0)
    for q0 in range(lane, quads, 32 * ROW_NORM_QUADS):
        for j in range(ROW_NORM_QUADS):
            q = q0 + 32 * j
            if q < quads:
                a, b, c, d = load_f32x4(x, base + 4 * q)
                acc += a * a + b * b + c * c + d * d
    inv = float32(1.0) / math.sqrt(warp_sum(acc) / float32(hidden) + eps)
    if hidden % 8 == 0:  # 8 elements a lane and octet: one 16-byte store, a warp's 512 bytes whole
        # ROW_NORM_OCTETS octets' loads go out before any store: the compiler cannot tell that the
        # stores miss x, so it would otherwise wait for each octet's loads after the previous store.
        octets = hidden >> 3
        xs = cuda.local.array((ROW_NORM_OCTETS, 8), float32)
        ws = cuda.local.array((ROW_NORM_OCTETS, 8), float32)
        for o0 in range(lane, octets, 32 * ROW_NORM_OCTETS):
            for j in range(ROW_NORM_OCTETS):
                o = o0 + 32 * j
                if o < octets:
                    load_octet(xs, j, x, base + 8 * o)
                    load_octet(ws, j, weight, 8 * o)
            for j in range(ROW_NORM_OCTETS):
                o = o0 + 32 * j
                if o < octets:
                    store_normed_octet(out, (base >> 1) + 4 * o, xs, ws, j, inv)
    else:
        for q in range(lane, quads, 32):
            a, b, c, d = load_f32x4(x, base + 4 * q)
            wa, wb, wc, wd = load_f32x4(weight, 4 * q)
            at = (base >> 1) + 2 * q
            out[at] = pack_bf16x2(a * inv * wa, b * inv * wb)
            out[at + 1] = pack_bf16x2(c * inv * wc, d * inv * wd)


def rmsnorm_rows_bf16(out, x, weight, rows, hidden, eps):
    """A prefill's RMSNorm into the bf16 its next GEMM reads: out[r] = bf16(x[r] / sqrt(mean(x[r]^2) +
    eps) * weight), pairs of bf16 in uint32 words. ``hidden`` a multiple of 4.

    A warp a row and no block barrier: the squares are summed from 16-byte loads, ROW_NORM_QUADS a
    lane in flight, then the row is read again to scale and store. ``rmsnorm_bf16``'s block a row,
    with its two block-wide reductions, keeps too few loads in flight on thousands of rows. A warp
    takes every ``gridDim.x * ROW_NORM_WARPS``-th row: with a warp for each of 8192 rows all first
    passes ran before any second one, and the second read came from HBM again (the rows exceed L2).
    Launch: grid ``(min(ceil(rows / ROW_NORM_WARPS), meta["blocks"]),)``, block ``32 * ROW_NORM_WARPS``."""
    lane = cuda.threadIdx.x & 31
    warps = cuda.gridDim.x * ROW_NORM_WARPS
    for row in range(cuda.blockIdx.x * ROW_NORM_WARPS + (cuda.threadIdx.x >> 5), rows, warps):
        normalize_row(out, x, weight, row, lane, hidden, eps)


# rmsnorm_block_bf16: threads a block (a row at a time), 8-element octets a thread holds in registers
# (so rows up to 128 * 8 * 4 = 4096 wide), and the most blocks a launch (they loop over the rows).
BLOCK_NORM_THREADS = 128
BLOCK_NORM_OCTETS = 4
BLOCK_NORM_WARPS = BLOCK_NORM_THREADS // 32
BLOCK_NORM_BLOCKS = 1056


def rmsnorm_block_bf16(out, x, weight, rows, hidden, eps):
    """``rmsnorm_rows_bf16``'s result (``hidden`` a multiple of 8, at most BLOCK_NORM_THREADS * 8 *
    BLOCK_NORM_OCTETS) in one pass over x: a block takes a row at a time, each thread its octets
    ``tid + BLOCK_NORM_THREADS * j`` as 16-byte loads kept in registers, so the row is read once (the
    warp-a-row kernel reads it twice, the second time from L1 or L2) and the weights once a block.
    The warps' sums meet in shared memory (two slots, by row parity: one barrier a row). Launch: grid
    ``(min(rows, meta["blocks"]),)``, block BLOCK_NORM_THREADS."""
    tid = cuda.threadIdx.x
    lane = tid & 31
    warp = tid >> 5
    octets = hidden >> 3
    sums = cuda.shared.array((2, BLOCK_NORM_WARPS), float32)
    xs = cuda.local.array((BLOCK_NORM_OCTETS, 8), float32)
    ws = cuda.local.array((BLOCK_NORM_OCTETS, 8), float32)
    for j in range(BLOCK_NORM_OCTETS):
        o = tid + BLOCK_NORM_THREADS * j
        if o < octets:
            load_octet(ws, j, weight, 8 * o)
    parity = 0
    for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
        base = int64(row) * hidden
        for j in range(BLOCK_NORM_OCTETS):  # every load out before the first use
            o = tid + BLOCK_NORM_THREADS * j
            if o < octets:
                load_octet(xs, j, x, base + 8 * o)
        acc = float32(0.0)
        for j in range(BLOCK_NORM_OCTETS):
            if tid + BLOCK_NORM_THREADS * j < octets:
                for e in range(8):
                    acc += xs[j, e] * xs[j, e]
        acc = warp_sum(acc)
        if lane == 0:
            sums[parity, warp] = acc
        cuda.syncthreads()
        total = float32(0.0)
        for w in range(BLOCK_NORM_WARPS):
            total += sums[parity, w]
        inv = float32(1.0) / math.sqrt(total / float32(hidden) + eps)
        for j in range(BLOCK_NORM_OCTETS):
            o = tid + BLOCK_NORM_THREADS * j
            if o < octets:
                store_normed_octet(out, (base >> 1) + 4 * o, xs, ws, j, inv)
        parity ^= 1


def make_add_rmsnorm(store):
    norm_store = make_norm_store(store)

    def add_rmsnorm(x, delta, out, weight, hidden, eps):
        """Residual stream update then norm: x[r] += delta[r]; out[r] = rmsnorm(x[r]) * weight."""
        launch_dependents()  # programmatic dependent launch: common.py
        ws = cuda.local.array(NORM_ITEMS, float32)
        load_items(ws, weight, 0, hidden)
        grid_dependency_wait()
        scratch = cuda.shared.array(32, float32)
        base = cuda.blockIdx.x * hidden
        xs = cuda.local.array(NORM_ITEMS, float32)
        ds = cuda.local.array(NORM_ITEMS, float32)
        load_items(xs, x, base, hidden)
        load_items(ds, delta, base, hidden)
        acc = float32(0.0)
        for j in range(NORM_ITEMS):
            i = cuda.threadIdx.x + j * cuda.blockDim.x
            v = xs[j] + ds[j]
            xs[j] = v
            if i < hidden:
                x[base + i] = v
            acc += v * v
        for i in range(cuda.threadIdx.x + NORM_ITEMS * cuda.blockDim.x, hidden, cuda.blockDim.x):
            v = x[base + i] + delta[base + i]
            x[base + i] = v
            acc += v * v
        norm_store(out, x, xs, weight, ws, base, hidden, block_sum(acc, scratch), eps)

    return add_rmsnorm


# silu_mul_bf16: 16-byte chunks (8 bf16) of gate and of up a thread has in flight.
SILU_CHUNKS = 2
SILU_WORDS = 4 * SILU_CHUNKS  # their bf16 pairs


@cuda.jit(device=True, inline=True)
def silu_times(g, u):
    # The reference's overflow-free sigmoid: (1 + tanh(g / 2)) / 2.
    return g * (float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * g)) * u


@cuda.jit(device=True, inline=True)
def silu_pair(gate, up):
    """Two bf16 gate and up elements (a word each) -> silu(gate) * up as a bf16 pair."""
    return pack_bf16x2(silu_times(bf16_lo(gate), bf16_lo(up)), silu_times(bf16_hi(gate), bf16_hi(up)))


def silu_mul_bf16(out, gate_up, ffn):
    """The prefill's SiLU-mul: gate and up as the bf16 its cuBLASLt GEMM wrote, out in bf16 for the
    down GEMM; out[r, i] = silu(gate[r, i]) * up[r, i], gate_up[r] = [gate (ffn) | up (ffn)].

    A thread takes SILU_CHUNKS chunks of 8 elements, 256 chunks apart, as 16-byte loads and stores
    (a 2-byte element a lane leaves most of each memory transaction's slots unused); a row whose
    ``ffn`` is not a multiple of 8 is not 16-byte aligned and takes the chunk element by element.
    Launch: grid ``(ceil(ffn / (256 * meta["items"])), rows)``, block 256."""
    row = cuda.blockIdx.y
    first = cuda.blockIdx.x * cuda.blockDim.x * SILU_CHUNKS + cuda.threadIdx.x
    gate_at = int64(row) * 2 * ffn
    up_at = gate_at + ffn
    out_at = int64(row) * ffn
    if ffn % 8 == 0:
        gs = cuda.local.array(SILU_WORDS, uint32)
        us = cuda.local.array(SILU_WORDS, uint32)
        for j in range(SILU_CHUNKS):
            i = 8 * (first + j * cuda.blockDim.x)
            if i < ffn:
                gs[4 * j], gs[4 * j + 1], gs[4 * j + 2], gs[4 * j + 3] = load_u32x4(gate_up, gate_at + i)
                us[4 * j], us[4 * j + 1], us[4 * j + 2], us[4 * j + 3] = load_u32x4(gate_up, up_at + i)
        for j in range(SILU_CHUNKS):
            i = 8 * (first + j * cuda.blockDim.x)
            if i < ffn:
                store_u32x4(out, out_at + i, silu_pair(gs[4 * j], us[4 * j]), silu_pair(gs[4 * j + 1], us[4 * j + 1]),
                            silu_pair(gs[4 * j + 2], us[4 * j + 2]), silu_pair(gs[4 * j + 3], us[4 * j + 3]))
    else:
        for j in range(SILU_CHUNKS):
            for e in range(8):
                i = 8 * (first + j * cuda.blockDim.x) + e
                if i < ffn:
                    out[out_at + i] = f32_to_bf16(silu_times(bf16_to_f32(gate_up[gate_at + i]),
                                                             bf16_to_f32(gate_up[up_at + i])))


def silu_mul(out, gate_up, ffn):
    """out[r, i] = silu(gate[r, i]) * up[r, i] in fp32, gate_up[r] = [gate (ffn) | up (ffn)].

    Launch: grid ``(ceil(ffn / 256), rows)``, block 256: a decode step has one to eight rows, so the
    row alone would leave all but a few SMs idle."""
    row = cuda.blockIdx.y
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < ffn:
        out[row * ffn + i] = silu_times(gate_up[row * 2 * ffn + i], gate_up[row * 2 * ffn + ffn + i])


def to_bf16(out, x, count):
    """out[i] = bf16(x[i]), round to nearest even: prefill activations for the tensor-core GEMM.

    Launch: grid ``(ceil(count / 256),)``, block 256."""
    i = cuda.grid(1)
    if i < count:
        out[i] = f32_to_bf16(x[i])


def count_tokens(counts, lanes, tokens, previous, follow, rows, vocab):
    """counts[lanes[r], tokens[r]] += 1: a decode input is the lane's previous output token.

    When ``follow[0]`` is set the step follows the one before it row for row, launched before the
    host read that step's tokens: row r's input is ``previous[r]`` (that step's sampled token,
    still in the sampler's output), written into ``tokens`` for the embedding to read.
    Rows of one batch hold distinct lanes, so no two threads touch one counter.
    Launch: grid ``(ceil(rows / 32),)``, block 32."""
    r = cuda.grid(1)
    if r < rows:
        token = tokens[r]
        if follow[0] != 0:
            token = previous[r]
            tokens[r] = token
        index = lanes[r] * vocab + token
        counts[index] = counts[index] + int32(1)


# Each norm and SiLU-mul writes fp32, or (``_bf16``) the bf16 a prefill's tensor-core GEMM reads
# next, rounded as ``to_bf16`` rounds: one pass over the activation instead of two.
KERNELS = {
    "embed": (embed, (F32P, U16P, I32P, int32), {"grid_wait": 1}),
    "rmsnorm": (make_rmsnorm(store_f32), (F32P, F32P, F32P, int32, float32), {"grid_wait": 1}),
    "add_rmsnorm": (make_add_rmsnorm(store_f32), (F32P, F32P, F32P, F32P, int32, float32), {"grid_wait": 1}),
    "silu_mul": (silu_mul, (F32P, F32P, int32), {"items": 1}),
    "rmsnorm_bf16": (make_rmsnorm(store_bf16), (U16P, F32P, F32P, int32, float32), {"grid_wait": 1}),
    "add_rmsnorm_bf16": (make_add_rmsnorm(store_bf16), (F32P, F32P, U16P, F32P, int32, float32), {"grid_wait": 1}),
    "rmsnorm_rows_bf16": (rmsnorm_rows_bf16, (U32P, F32P, F32P, int32, int32, float32),
                          {"threads": 32 * ROW_NORM_WARPS, "rows": ROW_NORM_WARPS, "blocks": ROW_NORM_BLOCKS}),
    "rmsnorm_block_bf16": (rmsnorm_block_bf16, (U32P, F32P, F32P, int32, int32, float32),
                           {"threads": BLOCK_NORM_THREADS, "blocks": BLOCK_NORM_BLOCKS,
                            "max_hidden": BLOCK_NORM_THREADS * 8 * BLOCK_NORM_OCTETS}),
    # The prefill's: gate and up as the bf16 its cuBLASLt GEMM wrote (half the bytes of fp32 both ways).
    "silu_mul_bf16": (silu_mul_bf16, (U16P, U16P, int32), {"items": 8 * SILU_CHUNKS}),
    "count_tokens": (count_tokens, (I32P, I32P, I32P, I32P, I32P, int32, int32)),
    "to_bf16": (to_bf16, (U16P, F32P, int32)),
}
