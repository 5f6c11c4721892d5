"""q/k/v post-processing after the fused qkv GEMM, and the paged KV append.

One block per (row, head) of the qkv activation ``[rows, (H + 2 KV) * D]``; ``D / 2`` threads, each
owning the rotate-half pair ``(i, i + D/2)``. In order: optional qkv bias (Llama variants), optional
per-head RMSNorm of q and k (Qwen3), RoPE on q and k (Hugging Face rotate-half form, angle
from the cos/sin tables ``[max_context, D/2]`` that the reference backend defines, attention
factor included), then q is written back in place and k / v go into their KV page: rounded to
bf16 (``rope_kv_bf16``) or kept fp32 (``rope_kv_f32``, bit-comparable with the reference pool).

KV pool layout (elements): ``[page][layer][K|V][kv_head][page_size][D]``, so one page of
every layer is contiguous (page copies and pause snapshots move one block). The launcher passes
``kc`` = pool + layer offset; V of that layer starts ``kv_heads * page_size * D`` after K.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64

from numba_kernels.common import F32P, I32P, U16P, block_sum, f32_to_bf16


@cuda.jit(device=True, inline=True)
def store_bf16(pool, index, value):
    pool[index] = f32_to_bf16(value)


@cuda.jit(device=True, inline=True)
def store_f32(pool, index, value):
    pool[index] = value


def make_rope_kv(store):
    def rope_kv(qkv, bias, q_norm, k_norm, cos_t, sin_t, kc, page_stride, page_tables, max_pages,
                row_table, positions, n_heads, n_kv, head_dim, page_size, has_bias, has_norm, eps):
        scratch = cuda.shared.array(32, float32)
        row = cuda.blockIdx.x
        head = cuda.blockIdx.y
        half = head_dim // 2
        i = cuda.threadIdx.x
        width = (n_heads + 2 * n_kv) * head_dim
        col = head * head_dim + i
        a = qkv[row * width + col]
        b = qkv[row * width + col + half]
        if has_bias != 0:
            a += bias[col]
            b += bias[col + half]
        is_v = head >= n_heads + n_kv
        if has_norm != 0 and not is_v:
            total = block_sum(a * a + b * b, scratch)
            inv = float32(1.0) / math.sqrt(total / float32(head_dim) + eps)
            if head < n_heads:
                a = a * inv * q_norm[i]
                b = b * inv * q_norm[i + half]
            else:
                a = a * inv * k_norm[i]
                b = b * inv * k_norm[i + half]
        pos = positions[row]
        if not is_v:
            c = cos_t[pos * half + i]
            s = sin_t[pos * half + i]
            a, b = a * c - b * s, b * c + a * s
        if head < n_heads:
            qkv[row * width + col] = a
            qkv[row * width + col + half] = b
            return
        table = row_table[row]
        page = int64(page_tables[table * max_pages + pos // page_size])
        slot = pos % page_size
        kv_head = head - n_heads
        base = page * page_stride
        if is_v:
            kv_head -= n_kv
            base += int64(n_kv) * page_size * head_dim
        dst = base + (int64(kv_head) * page_size + slot) * head_dim + i
        store(kc, dst, a)
        store(kc, dst + half, b)

    return rope_kv


def _signature(pool):
    return (F32P, F32P, F32P, F32P, F32P, F32P, pool, int64, I32P, int32, I32P, I32P,
            int32, int32, int32, int32, int32, int32, float32)


KERNELS = {
    "rope_kv_bf16": (make_rope_kv(store_bf16), _signature(U16P)),
    "rope_kv_f32": (make_rope_kv(store_f32), _signature(F32P)),
}
