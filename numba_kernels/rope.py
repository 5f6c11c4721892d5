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

from numba_kernels.common import F32P, I32P, U16P, bf16_to_f32, f32_to_bf16, warp_sum


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


def make_rope_kv(store, load_qkv=load_f32, store_q=store_f32):
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
                a[p] = load_qkv(qkv, row * width + col)
                b[p] = load_qkv(qkv, row * width + col + half)
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
                    store_q(qkv, row * width + col, a[p])
                    store_q(qkv, row * width + col + half, b[p])
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


_META = {"heads_per_block": HEADS_PER_BLOCK, "threads": 32 * HEADS_PER_BLOCK}
KERNELS = {
    "rope_kv_bf16": (make_rope_kv(store_bf16), _signature(U16P), _META),
    # The cuBLASLt prefill's: qkv in bf16 as its GEMM wrote it, q written back in bf16 (what the
    # tensor-core attention reads; it rounded q to bf16 itself before).
    "rope_kv_bf16_qkv_bf16": (make_rope_kv(store_bf16, load_bf16, store_bf16), (U16P,) + _signature(U16P)[1:],
                              _META),
    "rope_kv_f32": (make_rope_kv(store_f32), _signature(F32P), _META),
}
