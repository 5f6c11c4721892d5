"""Gated DeltaNet kernels: the depthwise causal conv and the gated delta rule (hybrid models).

Both run over *sequences*: ``n_seqs`` groups of ``seq_rows`` consecutive activation rows, sequence
``s`` continuing from and updating the state of StateImage slot ``lanes[s]``. A decode step is
``rows`` sequences of one row, a prefill chunk one sequence of ``rows`` rows: one kernel serves
both, and in a prefill the state stays in registers for the whole chunk. The state pointer is
the layer's part of slot 0; slot ``s`` lies ``slot_stride`` floats further (one StateImage is one
contiguous block: for each DeltaNet layer its conv tail then its delta-rule state, see
``ninfer/backends/cuda/hybrid_state.py``).

``deltanet_conv``: conv (kernel 4, compile-time) over [conv tail | new rows] then SiLU, per
channel; the tail becomes the last three input rows. Input ``x`` is the first ``channels`` columns
of the in-projection (row stride ``x_stride``). Grid ``(ceil(channels / 128), n_seqs)``, block 128.

``deltanet_rule_k{DK}_v{DV}`` (DK = DV): per (value head, sequence) one block of ``2 * DV``
threads; the two adjacent lanes ``2j, 2j + 1`` hold column ``j`` of the head's ``[DK, DV]`` fp32
state in registers, half the rows each (partial sums meet by one shuffle). Per token (its inputs loaded during the previous one): q, k
of the head's key head L2-normalised by block sums (q also scaled by ``DK ** -0.5``) into shared memory,
``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, then the recurrent step
(decay, ``S^T k``, delta write, ``o = S^T q``) and the gated RMSNorm ``norm(o) * w * silu(z)`` over
the head, fused so ``o`` never leaves the block. Grid ``(v_heads, n_seqs)``. Decode uses it; it
serves a prefill sequence too, but one block per head walks every token with seven barriers each.

Prefill takes three launches instead, so the sequential part does only the recurrence:
``deltanet_prep_k{DK}`` (grid ``(rows, k_heads + 1)``) writes the normalised q | k ``[rows, 2
key_dim]`` and beta | decay ``[rows, 2 v_heads]``; ``deltanet_scan_k{DK}_v{DV}`` (grid ``(v_heads,
SCAN_SPLITS, n_seqs)``, each block half the state columns, four lanes a column, q/k of the next
token staged in shared memory while this one computes: one barrier a token) writes the ungated
output; ``deltanet_gated_norm_v{DV}`` (grid ``(rows, v_heads)``) applies ``norm(o) * w * silu(z)``.
This is still the per-token (recurrent) form, on CUDA cores; the chunked tensor-core form is not
built yet.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64

from numba_kernels.common import F32P, I32P, block_sum, grid_dependency_wait, launch_dependents

CONV_KERNEL = 4
CONV_THREADS = 128
HEAD_DIMS = (16, 32, 64, 128)  # DK = DV variants built
L2_EPS = float32(1e-6)
SCAN_SPLITS = 2  # blocks per head in the prefill scan, each owning half the state columns


@cuda.jit(device=True, inline=True)
def sigmoid(x):
    # The reference's overflow-free form.
    return float32(0.5) + float32(0.5) * math.tanh(float32(0.5) * x)


@cuda.jit(device=True, inline=True)
def softplus(x):
    """log(1 + e^x) without overflow, as np.logaddexp(0, x)."""
    return max(x, float32(0.0)) + math.log1p(math.exp(-abs(x)))


def deltanet_conv(out, x, x_stride, states, slot_stride, lanes, seq_rows, channels, weight):
    launch_dependents()  # programmatic dependent launch: common.py
    grid_dependency_wait()
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    seq = cuda.blockIdx.y
    if c >= channels:
        return
    base = int64(lanes[seq]) * slot_stride + c
    s0 = states[base]
    s1 = states[base + channels]
    s2 = states[base + 2 * channels]
    w0 = weight[c * CONV_KERNEL]
    w1 = weight[c * CONV_KERNEL + 1]
    w2 = weight[c * CONV_KERNEL + 2]
    w3 = weight[c * CONV_KERNEL + 3]
    for t in range(seq_rows):
        r = int64(seq * seq_rows + t)
        v = x[r * x_stride + c]
        y = s0 * w0 + s1 * w1 + s2 * w2 + v * w3  # the reference's tap order
        out[r * channels + c] = y * sigmoid(y)
        s0, s1, s2 = s1, s2, v
    states[base] = s0
    states[base + channels] = s1
    states[base + 2 * channels] = s2


def make_rule(DK, DV):
    scale = float32(np.float32(DK) ** np.float32(-0.5))
    HALF = DK // 2  # state rows per thread: two threads (adjacent lanes) share a column

    def rule(mixed, proj, out, states, slot_stride, lanes, seq_rows, n_k, n_v, in_stride, dt_bias, a_log,
             norm_w, eps):
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
        sh_q = cuda.shared.array(DK, float32)
        sh_k = cuda.shared.array(DK, float32)
        scratch = cuda.shared.array(32, float32)
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        j = cuda.threadIdx.x >> 1  # column of the state, dim of v and z
        half = cuda.threadIdx.x & 1  # rows half * HALF .. + HALF of the column
        owner = half == 0  # the thread that loads q_j, k_j and writes out_j
        key_dim = n_k * DK
        conv_dim = 2 * key_dim + n_v * DV
        value_dim = n_v * DV
        q_col = (head // (n_v // n_k)) * DK + j  # value head h reads key head h // (n_v / n_k)
        v_col = 2 * key_dim + head * DV + j
        z_col = conv_dim + head * DV + j
        b_col = conv_dim + value_dim + head
        row0 = half * HALF
        base = int64(lanes[seq]) * slot_stride + int64(head) * DK * DV + row0 * DV + j
        col = cuda.local.array(HALF, float32)
        for i in range(HALF):
            col[i] = states[base + i * DV]
        w = norm_w[j]
        neg_a = -math.exp(a_log[head])
        bias = dt_bias[head]
        # Token t's inputs are loaded during token t - 1: global latency hides behind the math.
        r = int64(seq * seq_rows)
        q_next = k_next = float32(0.0)
        if owner:
            q_next = mixed[r * conv_dim + q_col]
            k_next = mixed[r * conv_dim + key_dim + q_col]
        v_next = mixed[r * conv_dim + v_col]
        z_next = proj[r * in_stride + z_col]
        b_next = proj[r * in_stride + b_col]
        a_next = proj[r * in_stride + b_col + n_v]
        for t in range(seq_rows):
            q, k, v, z, b, a = q_next, k_next, v_next, z_next, b_next, a_next
            r = int64(seq * seq_rows + t)
            if t + 1 < seq_rows:
                n = r + 1
                if owner:
                    q_next = mixed[n * conv_dim + q_col]
                    k_next = mixed[n * conv_dim + key_dim + q_col]
                v_next = mixed[n * conv_dim + v_col]
                z_next = proj[n * in_stride + z_col]
                b_next = proj[n * in_stride + b_col]
                a_next = proj[n * in_stride + b_col + n_v]
            q_inv = float32(1.0) / math.sqrt(block_sum(q * q, scratch) + L2_EPS)
            k_inv = float32(1.0) / math.sqrt(block_sum(k * k, scratch) + L2_EPS)
            if owner:
                sh_q[j] = q * q_inv * scale
                sh_k[j] = k * k_inv
            cuda.syncthreads()
            beta = sigmoid(b)
            decay = math.exp(neg_a * softplus(a + bias))
            predicted = float32(0.0)
            for i in range(HALF):
                col[i] *= decay
                predicted += sh_k[row0 + i] * col[i]
            predicted += cuda.shfl_xor_sync(0xFFFFFFFF, predicted, 1)
            d = (v - predicted) * beta
            o = float32(0.0)
            for i in range(HALF):
                col[i] += sh_k[row0 + i] * d
                o += sh_q[row0 + i] * col[i]
            o += cuda.shfl_xor_sync(0xFFFFFFFF, o, 1)
            # block_sum synchronises: every thread is done with sh_q / sh_k before the next token.
            total = block_sum(o * o if owner else float32(0.0), scratch)
            if owner:
                normed = o / math.sqrt(total / float32(DV) + eps) * w
                out[r * value_dim + head * DV + j] = normed * (z * sigmoid(z))
        for i in range(HALF):
            states[base + i * DV] = col[i]

    return rule


def make_prep(DK):
    scale = float32(np.float32(DK) ** np.float32(-0.5))

    def prep(qk, gates, mixed, proj, n_k, n_v, in_stride, dt_bias, a_log):
        scratch = cuda.shared.array(32, float32)
        row = int64(cuda.blockIdx.x)
        kh = cuda.blockIdx.y
        j = cuda.threadIdx.x
        key_dim = n_k * DK
        value_dim = n_v * DK
        conv_dim = 2 * key_dim + value_dim
        if kh < n_k:  # uniform per block: every thread reaches the block sums
            q = mixed[row * conv_dim + kh * DK + j] if j < DK else float32(0.0)
            k = mixed[row * conv_dim + key_dim + kh * DK + j] if j < DK else float32(0.0)
            q_inv = float32(1.0) / math.sqrt(block_sum(q * q, scratch) + L2_EPS)
            k_inv = float32(1.0) / math.sqrt(block_sum(k * k, scratch) + L2_EPS)
            if j < DK:
                qk[row * 2 * key_dim + kh * DK + j] = q * q_inv * scale
                qk[row * 2 * key_dim + key_dim + kh * DK + j] = k * k_inv
            return
        for h in range(j, n_v, cuda.blockDim.x):
            b = proj[row * in_stride + conv_dim + value_dim + h]
            a = proj[row * in_stride + conv_dim + value_dim + n_v + h]
            gates[row * 2 * n_v + h] = sigmoid(b)
            gates[row * 2 * n_v + n_v + h] = math.exp(-math.exp(a_log[h]) * softplus(a + dt_bias[h]))

    return prep


def make_scan(DK, DV):
    PARTS = 4  # threads per state column; thread part p holds rows p, p + 4, ... (distinct banks)
    ROWS = DK // PARTS
    COLS = DV // SCAN_SPLITS  # state columns per block

    def scan(qk, gates, mixed, o_out, states, slot_stride, lanes, seq_rows, n_k, n_v):
        sh = cuda.shared.array((2, 2, DK), float32)  # [buffer][q | k][dim]: token t in buffer t & 1
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        j = cuda.blockIdx.y * COLS + tid // PARTS
        part = tid % PARTS
        stager = tid < 2 * DK  # stages element tid % DK of q (tid < DK) or k of the next token
        key_dim = n_k * DK
        value_dim = n_v * DV
        conv_dim = 2 * key_dim + value_dim
        qk_col = (tid // DK) * key_dim + (head // (n_v // n_k)) * DK + tid % DK
        v_col = 2 * key_dim + head * DV + j
        base = int64(lanes[seq]) * slot_stride + int64(head) * DK * DV + part * DV + j
        col = cuda.local.array(ROWS, float32)
        for i in range(ROWS):
            col[i] = states[base + i * PARTS * DV]
        r = int64(seq * seq_rows)
        if stager:
            sh[0, tid // DK, tid % DK] = qk[r * 2 * key_dim + qk_col]
        v_next = mixed[r * conv_dim + v_col]
        beta_next = gates[r * 2 * n_v + head]
        decay_next = gates[r * 2 * n_v + n_v + head]
        cuda.syncthreads()
        for t in range(seq_rows):
            buf = t & 1
            r = int64(seq * seq_rows + t)
            v, beta, decay = v_next, beta_next, decay_next
            staged = float32(0.0)
            if t + 1 < seq_rows:  # the next token's loads fly while this one computes
                n = r + 1
                if stager:
                    staged = qk[n * 2 * key_dim + qk_col]
                v_next = mixed[n * conv_dim + v_col]
                beta_next = gates[n * 2 * n_v + head]
                decay_next = gates[n * 2 * n_v + n_v + head]
            predicted = float32(0.0)
            for i in range(ROWS):
                col[i] *= decay
                predicted += sh[buf, 1, i * PARTS + part] * col[i]
            predicted += cuda.shfl_xor_sync(0xFFFFFFFF, predicted, 1)
            predicted += cuda.shfl_xor_sync(0xFFFFFFFF, predicted, 2)
            d = (v - predicted) * beta
            o = float32(0.0)
            for i in range(ROWS):
                col[i] += sh[buf, 1, i * PARTS + part] * d
                o += sh[buf, 0, i * PARTS + part] * col[i]
            o += cuda.shfl_xor_sync(0xFFFFFFFF, o, 1)
            o += cuda.shfl_xor_sync(0xFFFFFFFF, o, 2)
            if part == 0:
                o_out[r * value_dim + head * DV + j] = o
            if stager and t + 1 < seq_rows:
                sh[1 - buf, tid // DK, tid % DK] = staged
            cuda.syncthreads()  # the next buffer is written; this one is free for token t + 2
        for i in range(ROWS):
            states[base + i * PARTS * DV] = col[i]

    return scan


def make_gated_norm(DV):
    def gated_norm(out, o_in, proj, in_stride, n_k, n_v, norm_w, eps):
        scratch = cuda.shared.array(32, float32)
        row = int64(cuda.blockIdx.x)
        head = cuda.blockIdx.y
        j = cuda.threadIdx.x
        value_dim = n_v * DV
        conv_dim = 2 * n_k * DV + value_dim  # DK = DV
        o = o_in[row * value_dim + head * DV + j] if j < DV else float32(0.0)
        total = block_sum(o * o, scratch)
        if j < DV:
            z = proj[row * in_stride + conv_dim + head * DV + j]
            normed = o / math.sqrt(total / float32(DV) + eps) * norm_w[j]
            out[row * value_dim + head * DV + j] = normed * (z * sigmoid(z))

    return gated_norm


KERNELS = {
    "deltanet_conv": (deltanet_conv, (F32P, F32P, int32, F32P, int64, I32P, int32, int32, F32P),
                      {"threads": CONV_THREADS, "kernel": CONV_KERNEL, "grid_wait": 1}),
}
for _d in HEAD_DIMS:
    KERNELS[f"deltanet_rule_k{_d}_v{_d}"] = (
        make_rule(_d, _d),
        (F32P, F32P, F32P, F32P, int64, I32P, int32, int32, int32, int32, F32P, F32P, F32P, float32),
        {"threads": 2 * _d, "grid_wait": 1})
    KERNELS[f"deltanet_prep_k{_d}"] = (make_prep(_d), (F32P, F32P, F32P, F32P, int32, int32, int32, F32P, F32P),
                                       {"threads": max(32, _d)})
    KERNELS[f"deltanet_scan_k{_d}_v{_d}"] = (
        make_scan(_d, _d), (F32P, F32P, F32P, F32P, F32P, int64, I32P, int32, int32, int32),
        {"threads": 4 * _d // SCAN_SPLITS, "splits": SCAN_SPLITS})
    KERNELS[f"deltanet_gated_norm_v{_d}"] = (make_gated_norm(_d), (F32P, F32P, F32P, int32, int32, int32, F32P, float32),
                                             {"threads": max(32, _d)})
