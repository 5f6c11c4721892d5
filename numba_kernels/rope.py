"""q/k/v post-processing after the fused qkv GEMM, and the paged KV append.

Grid ``(rows, ceil((H + 2 KV) / meta["heads_per_block"]))`` over the qkv activation
``[rows, (H + 2 KV) * D]``, block ``meta["threads"]``: one warp a head, lane l owning the rotate-half
pairs ``(i, i + D/2)`` for i = l, l + 32, ... (D a multiple of 64 up to 256: the CUDA backend's
``HEAD_DIMS``). In order: optional qkv bias (Llama variants), optional per-head RMSNorm of q and k
(Qwen3), RoPE on q and k (Hugging Face rotate-half form, angle from the cos/sin tables
``[max_context, D/2]`` that the reference backend defines, attention factor included), then q is
written back in place and k / v go into their KV page: rounded to bf16 (``rope_kv_bf16``) or kept
fp32 (``rope_kv_f32``, bit-comparable with the reference pool).

KV pool layout (elements): ``[page][layer][K|V][kv_head][page_size][D]``, so one page of
every layer is contiguous (page copies and pause snapshots move one block). The launcher passes
``kc`` = pool + layer offset; V of that layer starts ``kv_heads * page_size * D`` after K.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64

from numba_kernels.common import (F32P, I32P, U16P, bf16_hi, bf16_lo, bf16_to_f32, f32_to_bf16, load_f32x4,
                                  load_u32x4, store_u32x4, warp_sum)
from numba_kernels.mma import pack_bf16x2


@cuda.jit(device=True, inline=True)
def store_bf16(pool, index, value):
    pool[index] = f32_to_bf16(value)


@cuda.jit(device=True, inline=True)
def store_f32(pool, index, value):
    pool[index] = value


HEADS_PER_BLOCK = 8  # one warp a head
MAX_PAIRS = 4  # rotate-half pairs a lane owns: head_dim up to 256


@cuda.jit(device=True, inline=True)
def load_f32(values, index):
    return values[index]


@cuda.jit(device=True, inline=True)
def load_bf16(values, index):
    return bf16_to_f32(values[index])


def make_rope_kv(store):
    def rope_kv(qkv, bias, q_norm, k_norm, cos_t, sin_t, kc, page_stride, page_tables, max_pages,
                row_table, positions, n_heads, n_kv, head_dim, page_size, has_bias, has_norm, eps):
        row = cuda.blockIdx.x
        head = cuda.blockIdx.y * HEADS_PER_BLOCK + (cuda.threadIdx.x >> 5)
        if head >= n_heads + 2 * n_kv:
            return
        lane = cuda.threadIdx.x & 31
        half = head_dim // 2
        pairs = half // 32  # lane owns pairs (i, i + half) for i = lane + 32 p
        width = (n_heads + 2 * n_kv) * head_dim
        base_col = head * head_dim + lane
        a = cuda.local.array(MAX_PAIRS, float32)
        b = cuda.local.array(MAX_PAIRS, float32)
        for p in range(MAX_PAIRS):
            if p < pairs:
                col = base_col + 32 * p
                a[p] = qkv[row * width + col]
                b[p] = qkv[row * width + col + half]
                if has_bias != 0:
                    a[p] += bias[col]
                    b[p] += bias[col + half]
        is_v = head >= n_heads + n_kv
        if has_norm != 0 and not is_v:
            # Each 32 pairs summed over the warp, then those sums in pair order.
            total = float32(0.0)
            for p in range(MAX_PAIRS):
                if p < pairs:
                    total += warp_sum(a[p] * a[p] + b[p] * b[p])
            inv = float32(1.0) / math.sqrt(total / float32(head_dim) + eps)
            weight = q_norm if head < n_heads else k_norm
            for p in range(MAX_PAIRS):
                if p < pairs:
                    i = lane + 32 * p
                    a[p] = a[p] * inv * weight[i]
                    b[p] = b[p] * inv * weight[i + half]
        pos = positions[row]
        if not is_v:
            for p in range(MAX_PAIRS):
                if p < pairs:
                    i = lane + 32 * p
                    c = cos_t[pos * half + i]
                    s = sin_t[pos * half + i]
                    a[p], b[p] = a[p] * c - b[p] * s, b[p] * c + a[p] * s
        if head < n_heads:
            for p in range(MAX_PAIRS):
                if p < pairs:
                    col = base_col + 32 * p
                    qkv[row * width + col] = a[p]
                    qkv[row * width + col + half] = b[p]
            return
        table = row_table[row]
        page = int64(page_tables[table * max_pages + pos // page_size])
        slot = pos % page_size
        kv_head = head - n_heads
        base = page * page_stride
        if is_v:
            kv_head -= n_kv
            base += int64(n_kv) * page_size * head_dim
        dst = base + (int64(kv_head) * page_size + slot) * head_dim + lane
        for p in range(MAX_PAIRS):
            if p < pairs:
                store(kc, dst + 32 * p, a[p])
                store(kc, dst + 32 * p + half, b[p])

    return rope_kv


def _signature(pool):
    return (F32P, F32P, F32P, F32P, F32P, F32P, pool, int64, I32P, int32, I32P, I32P,
            int32, int32, int32, int32, int32, int32, float32)


ROPE_CHUNK_THREADS = 128  # rope_kv_chunks_bf16's block: Qwen3-8B's 48 heads x 8 lanes a row are 3 blocks


def rope_kv_chunks_bf16(qkv, bias, q_norm, k_norm, cos_t, sin_t, kc, page_stride, page_tables, max_pages,
                        row_table, positions, n_heads, n_kv, head_dim, page_size, has_bias, has_norm, eps, n_rows):
    """The cuBLASLt prefill's rope: qkv in bf16 as its GEMM wrote it, q written back in bf16 (what
    the tensor-core attention reads), k / v into a bf16 pool; the same steps as ``rope_kv``.

    A thread a 16-byte chunk ``c`` of a head (8 dims) and its rotate-half partner ``c + D / 16``, so
    ``D / 16`` consecutive lanes hold a head (their shuffles sum its squares) and every load and
    store is 16 bytes. Blocks along x cover a row's heads, along y its rows (``rope_chunks_grid``),
    so a thread finds its head, chunk and row with shifts, not divisions: three 64-bit divisions a
    thread had cost about a third of the kernel. The squares add in another order than ``rope_kv``'s,
    so a value may land one bf16 step from its result. ``D`` a multiple of 16 that divides 512;
    ``page_size`` a power of two."""
    lanes = head_dim >> 4
    lane_shift = 0
    while (1 << lane_shift) < lanes:
        lane_shift += 1
    page_shift = 0
    while (1 << page_shift) < page_size:
        page_shift += 1
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    heads = n_heads + 2 * n_kv
    c = t & (lanes - 1)
    head = t >> lane_shift
    valid = head < heads  # whole lane groups: the shuffles stay inside a head's lanes
    half = head_dim >> 1
    is_q = head < n_heads
    is_v = head >= n_heads + n_kv
    x = cuda.local.array(16, float32)  # dims 8c..8c+7, then their partners half + 8c..
    cs = cuda.local.array(16, float32)  # cos (8), then sin (8) of dims 8c..8c+7
    for row in range(cuda.blockIdx.y, n_rows, cuda.gridDim.y):
        at = int64(row) * (heads * head_dim) + head * head_dim + 8 * c  # element index of the first chunk
        dst = int64(0)
        if valid:
            for h in range(2):
                w0, w1, w2, w3 = load_u32x4(qkv, at + h * half)
                x[8 * h], x[8 * h + 1] = bf16_lo(w0), bf16_hi(w0)
                x[8 * h + 2], x[8 * h + 3] = bf16_lo(w1), bf16_hi(w1)
                x[8 * h + 4], x[8 * h + 5] = bf16_lo(w2), bf16_hi(w2)
                x[8 * h + 6], x[8 * h + 7] = bf16_lo(w3), bf16_hi(w3)
            pos = positions[row]
            if not is_q:  # where k / v go: [page][layer][K|V][kv_head][slot][D]
                page = int64(page_tables[row_table[row] * max_pages + (pos >> page_shift)])
                kv_head = head - n_heads - (n_kv if is_v else 0)
                base = page * page_stride + (int64(n_kv) * page_size * head_dim if is_v else int64(0))
                dst = base + (int64(kv_head) * page_size + (pos & (page_size - 1))) * head_dim + 8 * c
            if has_bias != 0:
                col = head * head_dim + 8 * c
                for e in range(16):
                    x[e] += bias[col + (e >> 3) * half + (e & 7)]
        else:
            for e in range(16):
                x[e] = float32(0.0)
        # Every lane shuffles (the heads of a warp may be q, k and v at once); only q and k use the sum.
        total = float32(0.0)
        for e in range(16):
            total += x[e] * x[e]
        offset = 1
        while offset < lanes:
            total += cuda.shfl_xor_sync(0xFFFFFFFF, total, offset)
            offset <<= 1
        if valid:
            if has_norm != 0 and not is_v:
                inv = float32(1.0) / math.sqrt(total / float32(head_dim) + eps)
                weight = q_norm if is_q else k_norm
                for q4 in range(4):  # weights of dims 8c + 4 q4.. (low half), then half + 8c + ..
                    w0, w1, w2, w3 = load_f32x4(weight, (q4 >> 1) * half + 8 * c + 4 * (q4 & 1))
                    x[4 * q4] = x[4 * q4] * inv * w0
                    x[4 * q4 + 1] = x[4 * q4 + 1] * inv * w1
                    x[4 * q4 + 2] = x[4 * q4 + 2] * inv * w2
                    x[4 * q4 + 3] = x[4 * q4 + 3] * inv * w3
            if not is_v:
                # cos / sin loaded here, after the shuffles: held across them they cost 16 registers a
                # thread, and the registers held the kernel to 6 blocks an SM.
                for q4 in range(2):
                    c0, c1, c2, c3 = load_f32x4(cos_t, pos * half + 8 * c + 4 * q4)
                    cs[4 * q4], cs[4 * q4 + 1], cs[4 * q4 + 2], cs[4 * q4 + 3] = c0, c1, c2, c3
                    s0, s1, s2, s3 = load_f32x4(sin_t, pos * half + 8 * c + 4 * q4)
                    cs[8 + 4 * q4], cs[9 + 4 * q4], cs[10 + 4 * q4], cs[11 + 4 * q4] = s0, s1, s2, s3
                for e in range(8):
                    a, b = x[e], x[8 + e]
                    x[e], x[8 + e] = a * cs[e] - b * cs[8 + e], b * cs[e] + a * cs[8 + e]
            for h in range(2):
                w0 = pack_bf16x2(x[8 * h], x[8 * h + 1])
                w1 = pack_bf16x2(x[8 * h + 2], x[8 * h + 3])
                w2 = pack_bf16x2(x[8 * h + 4], x[8 * h + 5])
                w3 = pack_bf16x2(x[8 * h + 6], x[8 * h + 7])
                if is_q:  # back in place
                    store_u32x4(qkv, at + h * half, w0, w1, w2, w3)
                else:
                    store_u32x4(kc, dst + h * half, w0, w1, w2, w3)


_META = {"heads_per_block": HEADS_PER_BLOCK, "threads": 32 * HEADS_PER_BLOCK}
KERNELS = {
    "rope_kv_bf16": (make_rope_kv(store_bf16), _signature(U16P), _META),
    "rope_kv_bf16_qkv_bf16": (rope_kv_chunks_bf16, (U16P,) + _signature(U16P)[1:] + (int32,),
                              {"threads": ROPE_CHUNK_THREADS, "dims_per_thread": 16}),
    "rope_kv_f32": (make_rope_kv(store_f32), _signature(F32P), _META),
}
