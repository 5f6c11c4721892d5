"""q/k/v post-processing after the fused qkv GEMM, and the paged KV append.

One block per (row, head) of the qkv activation ``[rows, (H + 2 KV) * D]``; ``D / 2`` threads, each
owning the rotate-half pair ``(i, i + D/2)``. In order: optional qkv bias (Llama variants), optional
per-head RMSNorm of q and k (Qwen3), RoPE on q and k (Hugging Face rotate-half form, angle
``pos * inv_freq[i]`` in fp32, cos/sin scaled by ``mscale`` for YaRN), then q is written back in
place and k / v are rounded to bf16 into their KV page.

KV pool layout (elements, bf16): ``[page][layer][K|V][kv_head][page_size][D]``, so one page of
every layer is contiguous (page copies and pause snapshots move one block). The launcher passes
``kc`` = pool + layer offset; V of that layer starts ``kv_heads * page_size * D`` after K.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64

from numba_kernels.common import F32P, I32P, U16P, block_sum, f32_to_bf16


def rope_kv(qkv, bias, q_norm, k_norm, inv_freq, kc, page_stride, page_tables, max_pages,
            row_table, positions, n_heads, n_kv, head_dim, page_size, has_bias, has_norm, eps,
            mscale):
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
        angle = float32(pos) * inv_freq[i]
        c = math.cos(angle) * mscale
        s = math.sin(angle) * mscale
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
    kc[dst] = f32_to_bf16(a)
    kc[dst + half] = f32_to_bf16(b)


KERNELS = {
    "rope_kv": (rope_kv, (F32P, F32P, F32P, F32P, F32P, U16P, int64, I32P, int32, I32P, I32P,
                          int32, int32, int32, int32, int32, int32, float32, float32)),
}
