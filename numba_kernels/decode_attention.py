"""A decode step's attention in one launch per layer: q/k post-processing, KV append, split-K attention
and the merge of the splits.

The prefill path needs three launches (``rope_kv``, ``attention_*``, ``attention_combine``) because
the rows of one sequence read each other's keys. In a decode step every row is its own sequence and
adds one key, so one kernel can do everything, and at batch 1 the two launches it saves per layer
are worth more than the work they did.

``decode_attention_g{G}_d{D}_{bf16|f32}``: grid ``(kv_heads, rows, n_splits)`` like ``attention_*``.
Each block

1. loads its row's ``G`` query heads (and, in the block whose split holds the row's position, the
   new key and value) from the fused qkv activation, and applies the optional bias, the optional
   per-head RMSNorm (Qwen3) and RoPE in shared memory, exactly as ``rope_kv`` does;
2. the block holding the new token writes its K/V into the pool (rounded as the pool stores them)
   and keeps the rounded values: its key loop stops one short and the new key joins in the merge;
3. runs the ``attention_*`` key loop over its split and merges its warps;
4. with one split holding keys, writes the output; else writes its partial, and the last block of
   the (row, kv head) to finish (an atomic ticket in ``counters``, reset by that block) merges every
   split's partial into the output.

``split_ptr`` (step inputs): the split length, and whether blocks ask L2 for their split's keys and
values before waiting for the previous kernel (set when the step's keys fit in L2).
``counters``: one int32 per (row, kv head), zero between launches. The pool is passed twice: as
32-bit words (the key loop's vector loads) and as its element type (the append's stores).
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64

from numba_kernels.attention import (VARIANTS, keys_in_flight, load_pair_bf16, load_pair_f32, load_quad_bf16,
                                     load_quad_f32, make_key_loop, make_warp_merge)
from numba_kernels.common import (F32P, I32P, NEG_BIG, U16P, U32P, atomic_add_i32, bf16_to_f32, f32_to_bf16,
                                  grid_dependency_wait, launch_dependents, prefetch_l2, warp_sum)
from numba_kernels.rope import store_bf16, store_f32

MERGE_BATCH = 4  # partials loaded per step of the final merge: independent loads in flight


@cuda.jit(device=True, inline=True)
def as_stored_bf16(value):
    return bf16_to_f32(f32_to_bf16(value))


@cuda.jit(device=True, inline=True)
def as_stored_f32(value):
    return value


def make_decode_attention(G, D, load_pair, load_quad, store, as_stored, U, WARPS, ITEM):
    E = D // 32
    WORD_SHIFT = 1 if ITEM == 2 else 0  # pool elements per 32-bit word of ``kc``: 2 (bf16) or 1
    HALF = D // 2
    THREADS = WARPS * 32
    ROWS = G + 2  # shared-array shapes must be plain constants
    ROPED = G + 1
    key_loop = make_key_loop(G, D, load_pair, load_quad, U, WARPS)
    empty, stash, merged = make_warp_merge(G, D, WARPS)

    @cuda.jit(device=True, inline=True)
    def row_dot(sh_x, a, b, lane):
        """``sh_x[a] . sh_x[b]`` summed over the warp; every lane gets it."""
        total = float32(0.0)
        for d in range(lane, D, 32):
            total += sh_x[a, d] * sh_x[b, d]
        return warp_sum(total)

    def decode_attention(qkv, bias, q_norm, k_norm, cos_t, sin_t, kc, kw, page_stride, page_tables, max_pages,
                         row_table, positions, out, part_o, part_ml, counters, n_heads, n_kv, page_shift, split_ptr,
                         n_splits, scale, has_bias, has_norm, eps):
        # Rows 0..G-1: the query heads; G: the new key; G + 1: the new value.
        sh_x = cuda.shared.array((ROWS, D), float32)
        sh_inv = cuda.shared.array(ROPED, float32)
        sh_s = cuda.shared.array(G, float32)  # the new key's scores
        sh_m = cuda.shared.array((WARPS, G), float32)
        sh_l = cuda.shared.array((WARPS, G), float32)
        sh_o = cuda.shared.array((WARPS, G, D), float32)
        sh_last = cuda.shared.array(1, int32)
        kvh = cuda.blockIdx.x
        row = cuda.blockIdx.y
        split = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        # Latency-bound and few blocks: let the output projection's blocks come in at once (common.py,
        # "programmatic dependent launch"). The step's inputs (positions, pages, split) and the keys
        # and values already in the pool do not depend on the previous kernel: with ``split_ptr[1]``
        # set (the step's keys fit in L2), ask L2 for this split's pages before waiting for the q/k/v.
        launch_dependents()
        pos = positions[row]
        length = pos + 1
        split_len = split_ptr[0]  # a step input, so one captured graph serves every context length
        start = split * split_len
        if split_ptr[1] != 0 and start < length:
            first = start >> page_shift
            pages = ((min(start + split_len, length) - 1) >> page_shift) - first + 1
            for i in range(tid, 2 * pages, THREADS):  # the K, then the V rows of each page
                page = int64(page_tables[row_table[row] * max_pages + first + (i >> 1)])
                at = page * page_stride + ((int64(kvh) + (i & 1) * n_kv) << page_shift) * D
                prefetch_l2(kc, at >> WORD_SHIFT, (D << page_shift) * ITEM)
        grid_dependency_wait()
        if start >= length:
            return  # neither a ticket nor a partial: ``active`` counts only the splits that hold keys
        end = min(start + split_len, length)
        active = min(n_splits, (length + split_len - 1) // split_len)
        owner = end == length  # this block appends the new token's K/V
        slots = G + 2 if owner else G
        width = (n_heads + 2 * n_kv) * D
        for idx in range(tid, slots * D, THREADS):
            slot = idx // D
            d = idx % D
            if slot < G:
                col = (kvh * G + slot) * D + d
            elif slot == G:
                col = (n_heads + kvh) * D + d
            else:
                col = (n_heads + n_kv + kvh) * D + d
            x = qkv[row * width + col]
            if has_bias != 0:
                x += bias[col]
            sh_x[slot, d] = x
        cuda.syncthreads()
        roped = G + 1 if owner else G  # q heads, then the key
        if has_norm != 0:
            for slot in range(warp, roped, WARPS):
                ss = row_dot(sh_x, slot, slot, lane)
                if lane == 0:
                    sh_inv[slot] = float32(1.0) / math.sqrt(ss / float32(D) + eps)
            cuda.syncthreads()
        page = int64(page_tables[row_table[row] * max_pages + (pos >> page_shift)])
        slot_off = (int64(kvh) << page_shift) + (pos & ((1 << page_shift) - 1))
        k_dst = page * page_stride + slot_off * D
        v_dst = k_dst + (int64(n_kv) << page_shift) * D
        for idx in range(tid, roped * HALF, THREADS):
            slot = idx // HALF
            i = idx % HALF
            a = sh_x[slot, i]
            b = sh_x[slot, i + HALF]
            if has_norm != 0:
                inv = sh_inv[slot]
                if slot < G:
                    a = a * inv * q_norm[i]
                    b = b * inv * q_norm[i + HALF]
                else:
                    a = a * inv * k_norm[i]
                    b = b * inv * k_norm[i + HALF]
            c = cos_t[pos * HALF + i]
            s = sin_t[pos * HALF + i]
            a, b = a * c - b * s, b * c + a * s
            if slot == G:  # the new key: into the pool, and kept as the pool holds it
                store(kw, k_dst + i, a)
                store(kw, k_dst + i + HALF, b)
                a = as_stored(a)
                b = as_stored(b)
            sh_x[slot, i] = a
            sh_x[slot, i + HALF] = b
        if owner:
            for d in range(tid, D, THREADS):
                v = sh_x[G + 1, d]
                store(kw, v_dst + d, v)
                sh_x[G + 1, d] = as_stored(v)
        cuda.syncthreads()
        q = cuda.local.array((G, E), float32)
        acc = cuda.local.array((G, E), float32)
        m = cuda.local.array(G, float32)
        l = cuda.local.array(G, float32)
        empty(acc, m, l)
        for g in range(G):
            for e in range(E):
                q[g, e] = sh_x[g, lane * E + e]
        head_off = (int64(kvh) << page_shift) * D
        v_off = (int64(n_kv) << page_shift) * D
        key_loop(q, acc, m, l, kc, page_stride, page_tables, row_table[row] * max_pages, page_shift, head_off, v_off,
                 start, end - 1 if owner else end, warp, lane, scale)
        if owner:
            for g in range(warp, G, WARPS):
                dot = row_dot(sh_x, g, G, lane)
                if lane == 0:
                    sh_s[g] = dot * scale
        stash(sh_m, sh_l, sh_o, m, l, acc, warp, lane)  # syncs the block (sh_s too)
        for idx in range(tid, G * D, THREADS):
            g = idx // D
            d = idx % D
            mm, ll, oo = merged(sh_m, sh_l, sh_o, g, d)
            if owner:  # the new key as one more softmax term
                s_new = sh_s[g]
                m_new = max(mm, s_new)
                alpha = math.exp(mm - m_new)
                p = math.exp(s_new - m_new)
                ll = ll * alpha + p
                oo = oo * alpha + p * sh_x[G + 1, d]
                mm = m_new
            h = kvh * G + g
            if active == 1:
                out[(row * n_heads + h) * D + d] = oo / ll
            else:
                cell = (row * n_heads + h) * n_splits + split
                part_o[cell * D + d] = oo
                if d == 0:
                    part_ml[cell * 2] = mm
                    part_ml[cell * 2 + 1] = ll
        if active == 1:
            return
        # The last block to finish merges: publish this block's partial, then take a ticket.
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            ticket = atomic_add_i32(counters, row * n_kv + kvh, 1)
            sh_last[0] = int32(ticket == active - 1)
            if ticket == active - 1:
                counters[row * n_kv + kvh] = 0  # every other split has its ticket: ready for the next launch
        cuda.syncthreads()
        if sh_last[0] == 0:
            return
        cuda.threadfence()
        ms = cuda.local.array(MERGE_BATCH, float32)
        ls = cuda.local.array(MERGE_BATCH, float32)
        os_ = cuda.local.array(MERGE_BATCH, float32)
        for idx in range(tid, G * D, THREADS):
            g = idx // D
            d = idx % D
            cell0 = (row * n_heads + kvh * G + g) * n_splits
            mm = NEG_BIG
            ll = float32(0.0)
            oo = float32(0.0)
            for sp0 in range(0, active, MERGE_BATCH):
                m_new = mm
                for j in range(MERGE_BATCH):
                    ms[j] = NEG_BIG
                    ls[j] = float32(0.0)
                    os_[j] = float32(0.0)
                    if sp0 + j < active:
                        ms[j] = part_ml[(cell0 + sp0 + j) * 2]
                        ls[j] = part_ml[(cell0 + sp0 + j) * 2 + 1]
                        os_[j] = part_o[(cell0 + sp0 + j) * D + d]
                        m_new = max(m_new, ms[j])
                alpha = math.exp(mm - m_new)
                ll *= alpha
                oo *= alpha
                for j in range(MERGE_BATCH):
                    f = math.exp(ms[j] - m_new) if ls[j] > float32(0.0) else float32(0.0)
                    ll += ls[j] * f
                    oo += os_[j] * f
                mm = m_new
            out[(row * n_heads + kvh * G + g) * D + d] = oo / ll

    return decode_attention


# Keys in flight per warp and warps per block where a shape has a tuned choice (tools/bench_decode_step.py
# on the H200, Qwen3-8B's group of 4 at head_dim 128: 2 keys x 8 warps, b=8 ctx 8192 12.21 ms a step vs
# 13.84 with 4 x 4 when this loop lived in ``attention_*``); the others take ``keys_in_flight`` x 4 warps.
BLOCKS = {(4, 128, "bf16"): (2, 8)}
POOLS = {"bf16": (U32P, U16P, load_pair_bf16, load_quad_bf16, store_bf16, as_stored_bf16, 2),
         "f32": (F32P, F32P, load_pair_f32, load_quad_f32, store_f32, as_stored_f32, 4)}


def _signature(read, write):
    return (F32P, F32P, F32P, F32P, F32P, F32P, read, write, int64, I32P, int32, I32P, I32P, F32P, F32P, F32P,
            I32P, int32, int32, int32, I32P, int32, float32, int32, int32, float32)


KERNELS = {}
for _g, _d in VARIANTS:
    for _dtype, (_read, _write, _pair, _quad, _store, _as_stored, _item) in POOLS.items():
        _u, _warps = BLOCKS.get((_g, _d, _dtype), (keys_in_flight(_g, _d), 4))
        KERNELS[f"decode_attention_g{_g}_d{_d}_{_dtype}"] = (
            make_decode_attention(_g, _d, _pair, _quad, _store, _as_stored, _u, _warps, _item), _signature(_read, _write),
            {"threads": 32 * _warps, "grid_wait": 1})
