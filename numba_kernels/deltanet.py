"""Gated DeltaNet kernels: the depthwise causal conv and the gated delta rule (hybrid models).

Both run over *sequences*: ``n_seqs`` groups of ``seq_rows`` consecutive activation rows, sequence
``s`` continuing from the state of StateImage slot ``lanes[s]``. The decode kernels (conv, rule,
step) write the new state to slot ``lanes_out[s]``: the same slot in a prefill, the lane's other
image in a decode step, so a step launched ahead of the Engine can be dropped for a lane whose
state must stay as it was (``ninfer/backends/lane_slots.py``). A decode step is
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
``deltanet_step_k{DK}_v{DV}`` is a decode step's conv and rule in one launch on the rule's grid
(``make_step``: each block convolves the channels it reads; tickets order the shared q/k tails'
update after every reader), the same results (bit for bit in the simulator, to fp32 rounding on the
GPU). ``deltanet_rule_s{S}_k{DK}_v{DV}`` is a decode step's rule with each head's columns over S
blocks (``make_rule_split``: grid ``(v_heads, n_seqs, S)``, the gated norm's scale applied by the
head's last block), to fp32 rounding.

Prefill takes three launches instead, so the sequential part does only the recurrence:
``deltanet_prep_k{DK}`` (grid ``(rows, k_heads + 1)``) writes the normalised q | k ``[rows, 2
key_dim]`` and beta | decay ``[rows, 2 v_heads]``; ``deltanet_scan_k{DK}_v{DV}`` (grid ``(v_heads,
SCAN_SPLITS, n_seqs)``, each block half the state columns, four lanes a column, q/k of the next
token staged in shared memory while this one computes: one barrier a token) writes the ungated
output; ``deltanet_gated_norm_v{DV}`` (grid ``(rows, v_heads)``) applies ``norm(o) * w * silu(z)``.
That scan is the per-token (recurrent) form.

The chunked form (the reference's ``chunked``, CHUNK = 64 tokens; off by default,
``HybridForward.chunked_rule``) replaces the scan with two launches, fp32 on CUDA cores (no tensor
cores yet). ``deltanet_chunk_prep_k{DK}_v{DV}`` (grid ``(v_heads, ceil(seq_rows / 64), n_seqs)``,
128 threads) works on every chunk at once: g recomputed from the projection (``gates`` holds e^g),
its cumulative sum, ``A = (beta k) k^T`` and ``P = q k^T`` (times ``e^(cum_i - cum_j)``, A strictly
and P inclusively lower) over key dims staged 16 at a time, then the forward substitution ``(I + A)
x = [v beta | k beta e^cum]`` a column a thread with x in shared memory (the reference's
``_unit_lower_solve``), giving U and W. It writes, per (sequence, value head, chunk), ``cum [64] | W
[64, DK] | U [64, DV] | P [64, 64]`` (``chunk_floats``; rows past a partial chunk's end are left
unwritten and never read). ``deltanet_chunk_scan_k{DK}_v{DV}`` (grid ``(v_heads, DV / 16,
n_seqs)``, 128 threads) walks the chunks in order, each block owning 16 columns of one head's state
(eight adjacent lanes a column, rows ``g, g + 8, ...`` in registers; partial dot products meet by
three shuffles): ``V' = U - W S``, ``o = (q e^cum) S + P V'`` into ``o_raw`` as the scan writes it,
``S = e^cum_end S + (k e^(cum_end - cum))^T V'``, the staged matrix (W, q, P, k in turn) sharing
one shared buffer; the state is read from and written back to the StateImage as the scan does.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64

from numba_kernels.common import F32P, I32P, block_sum, grid_dependency_wait, last_to_finish, launch_dependents

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


@cuda.jit(device=True, inline=True)
def conv_tap(s0, s1, s2, v, w0, w1, w2, w3):
    """The conv's SiLU'd output for input ``v`` after the tail ``s0, s1, s2`` (oldest first)."""
    y = s0 * w0 + s1 * w1 + s2 * w2 + v * w3  # the reference's tap order
    return y * sigmoid(y)


@cuda.jit(device=True, inline=True)
def conv_channel(states, at, channels, x, weight, c):
    """Channel ``c``'s output for input ``x`` from the tail at ``states[at + i * channels]``; returns it
    with the tail's two newer values (the new tail is those and ``x``)."""
    s1 = states[at + channels]
    s2 = states[at + 2 * channels]
    w = c * CONV_KERNEL
    return conv_tap(states[at], s1, s2, x, weight[w], weight[w + 1], weight[w + 2], weight[w + 3]), s1, s2


@cuda.jit(device=True, inline=True)
def shift_tail(states, at, channels, s1, s2, x):
    states[at] = s1
    states[at + channels] = s2
    states[at + 2 * channels] = x


def deltanet_conv(out, x, x_stride, states, slot_stride, lanes, lanes_out, seq_rows, channels, weight):
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
        out[r * channels + c] = conv_tap(s0, s1, s2, v, w0, w1, w2, w3)
        s0, s1, s2 = s1, s2, v
    shift_tail(states, int64(lanes_out[seq]) * slot_stride + c, channels, s0, s1, s2)  # the last three inputs


def make_half_column(DK, DV):
    """(load, store): a thread's half of a state column between the StateImage and the thread's
    registers (``rule``, ``rule_split``, ``step``). ``load(col, states, state, head, half, j)``: rows
    ``half * DK / 2 ..`` of column ``j`` of ``head``'s ``[DK, DV]`` state, the heads' states from
    ``state``; returns where they start, for ``store(states, base, col)``."""
    HALF = DK // 2

    @cuda.jit(device=True, inline=True)
    def load(col, states, state, head, half, j):
        base = state + int64(head) * DK * DV + half * HALF * DV + j
        for i in range(HALF):
            col[i] = states[base + i * DV]
        return base

    @cuda.jit(device=True, inline=True)
    def store(states, base, col):
        for i in range(HALF):
            states[base + i * DV] = col[i]

    return load, store


def make_token(DK, DV):
    """One token of the delta rule for the thread's half column (``rule``'s loop body, shared with
    ``step``): q, k L2-normalised by block sums into shared memory, the decayed state's delta write,
    ``o = S^T q``, and the gated RMSNorm into ``out[at]`` by the column's owner."""
    scale = float32(np.float32(DK) ** np.float32(-0.5))
    HALF = DK // 2

    @cuda.jit(device=True, inline=True)
    def token(col, q, k, v, z, b, a, neg_a, bias, w, eps, out, at):
        sh_q = cuda.shared.array(DK, float32)
        sh_k = cuda.shared.array(DK, float32)
        scratch = cuda.shared.array(32, float32)
        j = cuda.threadIdx.x >> 1
        row0 = (cuda.threadIdx.x & 1) * HALF
        owner = (cuda.threadIdx.x & 1) == 0
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
            out[at] = normed * (z * sigmoid(z))

    return token


def make_rule(DK, DV):
    HALF = DK // 2  # state rows per thread: two threads (adjacent lanes) share a column
    token = make_token(DK, DV)
    load_column, store_column = make_half_column(DK, DV)

    def rule(mixed, proj, out, states, slot_stride, lanes, lanes_out, seq_rows, n_k, n_v, in_stride, dt_bias,
             a_log, norm_w, eps):
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
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
        col = cuda.local.array(HALF, float32)
        base = load_column(col, states, int64(lanes[seq]) * slot_stride, head, half, j)
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
            token(col, q, k, v, z, b, a, neg_a, bias, w, eps, out, r * value_dim + head * DV + j)
        store_column(states, base + (int64(lanes_out[seq]) - lanes[seq]) * slot_stride, col)

    return rule


def make_rule_split(DK, DV, S, UNSCALED=False):
    """``deltanet_rule_s{S}_k{DK}_v{DV}``: a decode step's delta rule (one token a sequence) with each
    head's state columns split over ``S`` blocks, grid ``(v_heads, n_seqs, S)``, ``2 * DV / S``
    threads: two lanes a column as ``rule``. A batch-1 step of ``rule`` runs one block a head (32 on a
    35B-A3B), each streaming the head's whole state; split, the same bytes come from S times as many
    SMs. Each block loads its columns of the state before the grid wait (the step's earlier kernels
    never write the rule's state), then q and k of the key head (every block needs all of them),
    and writes its columns' ``o * w * silu(z)`` and its share of the head's ``sum(o^2)``
    (``partials[(seq * n_v + head) * S + split]``); the last of the head's S blocks to take a ticket
    (``tickets[seq * n_v + head]``, zero between launches) scales the head's outputs by
    ``1 / sqrt(sum / DV + eps)``: ``rule``'s gated RMSNorm to fp32 rounding.

    ``UNSCALED`` (``deltanet_rule_s{S}u_k{DK}_v{DV}``, no ``tickets`` argument): the blocks stop after
    their outputs and partial sums, leaving the scaling to the out projection's GEMV, which reads the
    partials itself (numba_kernels/gemm.py ``make_gemv``'s ``HEAD_NORM``): no ticket, no last block."""
    C = DV // S  # state columns a block
    THREADS = 2 * C
    HALF = DK // 2
    scale = float32(np.float32(DK) ** np.float32(-0.5))
    assert C * S == DV and THREADS >= 32 and THREADS % 32 == 0  # block_sum's warps are whole
    load_column, store_column = make_half_column(DK, DV)

    def rule_split(mixed, proj, out, states, slot_stride, lanes, lanes_out, n_k, n_v, in_stride, dt_bias, a_log,
                   norm_w, eps, partials, tickets):
        launch_dependents()  # programmatic dependent launch: common.py
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        split = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        j = split * C + (tid >> 1)  # the thread's state column, dim of v and z
        half = tid & 1
        owner = half == 0
        row0 = half * HALF
        col = cuda.local.array(HALF, float32)
        base = load_column(col, states, int64(lanes[seq]) * slot_stride, head, half, j)
        w = norm_w[j]
        neg_a = -math.exp(a_log[head])
        bias = dt_bias[head]
        grid_dependency_wait()  # mixed and proj are the step's
        sh_q = cuda.shared.array(DK, float32)
        sh_k = cuda.shared.array(DK, float32)
        scratch = cuda.shared.array(32, float32)
        key_dim = n_k * DK
        conv_dim = 2 * key_dim + n_v * DV
        value_dim = n_v * DV
        row = int64(seq) * conv_dim
        qk = row + (head // (n_v // n_k)) * DK  # value head h reads key head h // (n_v / n_k)
        qq = kk = float32(0.0)
        for i in range(tid, DK, THREADS):
            q = mixed[qk + i]
            k = mixed[qk + key_dim + i]
            sh_q[i] = q
            sh_k[i] = k
            qq += q * q
            kk += k * k
        q_scale = float32(1.0) / math.sqrt(block_sum(qq, scratch) + L2_EPS) * scale  # its barriers: sh_q, sh_k out
        k_inv = float32(1.0) / math.sqrt(block_sum(kk, scratch) + L2_EPS)
        b_col = int64(seq) * in_stride + conv_dim + value_dim + head
        beta = sigmoid(proj[b_col])
        decay = math.exp(neg_a * softplus(proj[b_col + n_v] + bias))
        v = mixed[row + 2 * key_dim + head * DV + j]
        z = proj[int64(seq) * in_stride + conv_dim + head * DV + j]
        predicted = float32(0.0)
        for i in range(HALF):
            col[i] *= decay
            predicted += sh_k[row0 + i] * col[i]
        predicted += cuda.shfl_xor_sync(0xFFFFFFFF, predicted, 1)
        d = (v - predicted * k_inv) * beta * k_inv  # the write's k is k * k_inv as well
        o = float32(0.0)
        for i in range(HALF):
            col[i] += sh_k[row0 + i] * d
            o += sh_q[row0 + i] * col[i]
        o = (o + cuda.shfl_xor_sync(0xFFFFFFFF, o, 1)) * q_scale
        store_column(states, base + (int64(lanes_out[seq]) - lanes[seq]) * slot_stride, col)
        at = int64(seq) * value_dim + head * DV
        if owner:
            out[at + j] = o * w * (z * sigmoid(z))
        total = block_sum(o * o if owner else float32(0.0), scratch)
        cell = seq * n_v + head
        if tid == 0:
            partials[cell * S + split] = total
        if UNSCALED:
            return
        if last_to_finish(tickets, cell, S):  # every split's outputs and partial sum are out
            inv = split_norm_inverse(partials, cell, S, DV, eps)
            for i in range(tid, DV, THREADS):
                out[at + i] *= inv

    if UNSCALED:
        body = cuda.jit(device=True, inline=True)(rule_split)

        def unscaled(mixed, proj, out, states, slot_stride, lanes, lanes_out, n_k, n_v, in_stride, dt_bias, a_log,
                     norm_w, eps, partials):
            body(mixed, proj, out, states, slot_stride, lanes, lanes_out, n_k, n_v, in_stride, dt_bias, a_log,
                 norm_w, eps, partials, partials)

        return unscaled
    return rule_split


@cuda.jit(device=True, inline=True)
def split_norm_inverse(partials, cell, splits, dim, eps):
    """``1 / sqrt(sum / dim + eps)`` of a head's gated RMSNorm from its ``splits`` partial sums of squares
    at ``partials[cell * splits ..]``, added in split order (``deltanet_rule_s{S}`` and the GEMV that
    scales its unscaled build's outputs compute the same bits)."""
    total = float32(0.0)
    for i in range(splits):
        total += partials[cell * splits + i]
    return float32(1.0) / math.sqrt(total / float32(dim) + eps)


def rule_splits(DV):
    """The column splits ``deltanet_rule_s{S}`` is built with for head dim ``DV`` (whole warps a block)."""
    return [s for s in (2, 4, 8) if 2 * DV // s >= 32]


def make_step(DK, DV):
    """``deltanet_step_k{DK}_v{DV}``: a decode step's conv and delta rule in one launch (``rule`` of one
    token a sequence, fed by the conv instead of ``mixed``). Block (value head, sequence) as ``rule``;
    ``states`` is the layer's part of slot 0 (conv tail, then the rule's state). Each thread convolves
    what it reads: its value channel (both threads of a column) and, the column's owner, the q and k
    channels of the head's key head. The value channels are the block's own, so it writes their tails.
    The q/k channels are read by the ``n_v / n_k`` blocks of one key head: each reads the old tail,
    then takes a ticket (``tickets[sequence * n_k + key head]``, zero between launches, the last block
    resets it); the last to arrive, whose fence follows every block's reads, writes the new tail."""
    HALF = DK // 2
    token = make_token(DK, DV)
    load_column, store_column = make_half_column(DK, DV)

    def step(proj, out, states, slot_stride, lanes, lanes_out, n_k, n_v, in_stride, conv_w, dt_bias, a_log, norm_w,
             eps, tickets):
        launch_dependents()  # programmatic dependent launch: common.py
        grid_dependency_wait()
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.y
        j = cuda.threadIdx.x >> 1
        half = cuda.threadIdx.x & 1
        owner = half == 0
        key_dim = n_k * DK
        conv_dim = 2 * key_dim + n_v * DV
        value_dim = n_v * DV
        group = n_v // n_k
        key_head = head // group
        q_col = key_head * DK + j
        v_col = 2 * key_dim + head * DV + j
        z_col = conv_dim + head * DV + j
        b_col = conv_dim + value_dim + head
        slot = int64(lanes[seq]) * slot_stride
        slot_out = int64(lanes_out[seq]) * slot_stride
        row = int64(seq) * in_stride
        col = cuda.local.array(HALF, float32)
        base = load_column(col, states, slot + (CONV_KERNEL - 1) * conv_dim, head, half, j)
        x_v = proj[row + v_col]
        v, v1, v2 = conv_channel(states, slot + v_col, conv_dim, x_v, conv_w, v_col)
        q = k = q1 = q2 = x_q = k1 = k2 = x_k = float32(0.0)
        k_col = key_dim + q_col
        if owner:
            x_q = proj[row + q_col]
            x_k = proj[row + k_col]
            q, q1, q2 = conv_channel(states, slot + q_col, conv_dim, x_q, conv_w, q_col)
            k, k1, k2 = conv_channel(states, slot + k_col, conv_dim, x_k, conv_w, k_col)
        last = last_to_finish(tickets, seq * n_k + key_head, group)  # its barriers: every tail read is done
        if owner:
            shift_tail(states, slot_out + v_col, conv_dim, v1, v2, x_v)  # the block's own channel
            if last:  # every block of the key head has read the q/k tails
                shift_tail(states, slot_out + q_col, conv_dim, q1, q2, x_q)
                shift_tail(states, slot_out + k_col, conv_dim, k1, k2, x_k)
        token(col, q, k, v, proj[row + z_col], proj[row + b_col], proj[row + b_col + n_v], -math.exp(a_log[head]),
              dt_bias[head], norm_w[j], eps, out, int64(seq) * value_dim + head * DV + j)
        store_column(states, base + slot_out - slot, col)

    return step


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


CHUNK = 64  # tokens per chunk of the chunked form (the reference's CHUNK)
CHUNK_THREADS = 128  # both chunked kernels
CHUNK_COLS = 16  # state columns a chunk_scan block owns
CHUNK_LANES = 8  # adjacent lanes sharing one state column in chunk_scan (rows g, g + 8, ...)
CHUNK_SLICE = 16  # key dims staged per step of chunk_prep's q k^T


def chunk_floats(DK, DV):
    """Scratch floats per (sequence, value head, chunk): cum [C] | W [C, DK] | U [C, DV] | P [C, C]."""
    return CHUNK + CHUNK * DK + CHUNK * DV + CHUNK * CHUNK


def make_chunk_offsets(DK, DV):
    """``offsets(seq, head, n_v, n_chunks, chunk)``: where a (sequence, value head, chunk)'s scratch
    and its W, U and P parts start (``chunk_floats``' layout; cum comes first)."""
    FLOATS = chunk_floats(DK, DV)

    @cuda.jit(device=True, inline=True)
    def offsets(seq, head, n_v, n_chunks, chunk):
        at = (int64(seq * n_v + head) * n_chunks + chunk) * FLOATS
        w_at = at + CHUNK
        u_at = w_at + CHUNK * DK
        return at, w_at, u_at, u_at + CHUNK * DV

    return offsets


def make_chunk_prep(DK, DV):
    """Per (value head, chunk, sequence) what the sequential pass needs (the reference's ``chunked``):
    ``cum`` (cumulative log decay), ``W`` and ``U`` (forward substitution of ``(I + A) x = [k beta
    e^cum | v beta]``, the U columns first as the reference's rhs) and ``P`` (q k^T times the decay
    ratios, causal with the diagonal). Rows past the end of a partial chunk are not written."""
    offsets = make_chunk_offsets(DK, DV)
    SOLVE = min(CHUNK_THREADS, DK + DV)  # columns solved per pass, one a thread
    PASSES = (DK + DV) // SOLVE
    SLICE = min(CHUNK_SLICE, DK)
    HALF = CHUNK // 2  # P / A columns per thread: thread tid owns row tid % C, columns of half tid // C
    PACKED = CHUNK * (CHUNK - 1) // 2  # A strictly lower, row i at i (i - 1) / 2
    REGION = max(CHUNK * SOLVE, 2 * CHUNK * (SLICE + 1))  # the solve's x tile, or the staged k | q slices
    STAGE = CHUNK * (SLICE + 1)  # k slice [C][SLICE + 1] then q slice: padded rows, no bank conflicts

    def chunk_prep(scratch, qk, gates, mixed, proj, in_stride, dt_bias, a_log, seq_rows, n_k, n_v):
        sh_cum = cuda.shared.array(CHUNK, float32)
        sh_beta = cuda.shared.array(CHUNK, float32)
        sh_a = cuda.shared.array(PACKED, float32)
        sh = cuda.shared.array(REGION, float32)
        head = cuda.blockIdx.x
        chunk = cuda.blockIdx.y
        seq = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        n_chunks = (seq_rows + CHUNK - 1) // CHUNK
        n = min(CHUNK, seq_rows - chunk * CHUNK)  # tokens in this chunk
        key_dim = n_k * DK
        value_dim = n_v * DV
        conv_dim = 2 * key_dim + value_dim
        q_col = (head // (n_v // n_k)) * DK  # value head h reads key head h // (n_v / n_k)
        v_col = 2 * key_dim + head * DV
        row0 = int64(seq) * seq_rows + chunk * CHUNK
        out, w_at, u_at, p_at = offsets(seq, head, n_v, n_chunks, chunk)
        # g from the projection as the reference computes it (gates hold e^g, whose log loses
        # the small decays), beta from gates; the cumulative sum in token order, as np.cumsum.
        if tid < n:
            r = row0 + tid
            a = proj[r * in_stride + conv_dim + value_dim + n_v + head]
            sh_cum[tid] = -math.exp(a_log[head]) * softplus(a + dt_bias[head])
            sh_beta[tid] = gates[r * 2 * n_v + head]
        cuda.syncthreads()
        if tid == 0:
            total = float32(0.0)
            for t in range(n):
                total += sh_cum[t]
                sh_cum[t] = total
        cuda.syncthreads()
        if tid < n:
            scratch[out + tid] = sh_cum[tid]
        # A[i, j] = (beta_i k_i) . k_j e^(cum_i - cum_j) (j < i) and P[i, j] = q_i . k_j e^(cum_i - cum_j)
        # (j <= i): thread tid owns row i, columns half * HALF .., over DK in slices staged in shared.
        i = tid % CHUNK
        half = tid // CHUNK
        acc_k = cuda.local.array(HALF, float32)
        acc_q = cuda.local.array(HALF, float32)
        for jj in range(HALF):
            acc_k[jj] = float32(0.0)
            acc_q[jj] = float32(0.0)
        beta_i = sh_beta[i] if i < n else float32(0.0)
        for d0 in range(0, DK, SLICE):
            for e in range(tid, CHUNK * SLICE, CHUNK_THREADS):
                t = e // SLICE
                d = e % SLICE
                k_e = q_e = float32(0.0)
                if t < n:
                    r = row0 + t
                    q_e = qk[r * 2 * key_dim + q_col + d0 + d]
                    k_e = qk[r * 2 * key_dim + key_dim + q_col + d0 + d]
                sh[t * (SLICE + 1) + d] = k_e
                sh[STAGE + t * (SLICE + 1) + d] = q_e
            cuda.syncthreads()
            for d in range(SLICE):
                kb = sh[i * (SLICE + 1) + d] * beta_i  # k_beta = k * beta, as the reference
                q_i = sh[STAGE + i * (SLICE + 1) + d]
                for jj in range(HALF):
                    k_j = sh[(half * HALF + jj) * (SLICE + 1) + d]
                    acc_k[jj] += kb * k_j
                    acc_q[jj] += q_i * k_j
            cuda.syncthreads()
        if i < n:
            cum_i = sh_cum[i]
            for jj in range(HALF):
                j = half * HALF + jj
                p = float32(0.0)
                if j <= i:
                    ratio = math.exp(cum_i - sh_cum[j])
                    p = acc_q[jj] * ratio
                    if j < i:
                        sh_a[i * (i - 1) // 2 + j] = acc_k[jj] * ratio
                scratch[p_at + i * CHUNK + j] = p
        cuda.syncthreads()
        # (I + A) x = rhs by forward substitution, a column a thread, x in shared: the reference's
        # x_i = rhs_i - sum_{j < i} A[i, j] x_j with the sum in token order. Columns 0 .. DV are U.
        if tid < SOLVE:
            for part in range(PASSES):
                col = part * SOLVE + tid
                for t in range(n):
                    r = row0 + t
                    if col < DV:
                        rhs = mixed[r * conv_dim + v_col + col] * sh_beta[t]
                    else:
                        rhs = (qk[r * 2 * key_dim + key_dim + q_col + col - DV] * sh_beta[t]) * math.exp(sh_cum[t])
                    acc = float32(0.0)
                    row = t * (t - 1) // 2
                    for j in range(t):
                        acc += sh_a[row + j] * sh[j * SOLVE + tid]
                    x = rhs - acc
                    sh[t * SOLVE + tid] = x
                    if col < DV:
                        scratch[u_at + t * DV + col] = x
                    else:
                        scratch[w_at + t * DK + col - DV] = x

    return chunk_prep


def make_chunk_scan(DK, DV):
    """Sequential over the chunks of one sequence, a block per (value head, CHUNK_COLS columns of its
    state): ``V' = U - W S``, ``o = (q e^cum) S + P V'``, ``S = e^cum_end S + (k e^(cum_end - cum))^T V'``
    (the reference's ``chunked`` loop). Lanes ``8c .. 8c + 7`` hold column ``c``, lane ``g`` its rows
    ``g, g + 8, ...`` in registers; their partial dot products meet by three shuffles."""
    offsets = make_chunk_offsets(DK, DV)
    G = CHUNK_LANES
    ROWS = DK // G
    COLS = CHUNK_COLS
    STRIDE = COLS + 4  # padded rows of the [C][COLS] tiles: lanes g, columns c hit distinct banks
    WIDE = max(DK, CHUNK)  # the staged matrix: W, q e^cum, P, then k e^(cum_end - cum)
    PSTEPS = CHUNK // G
    M_SIZE = CHUNK * WIDE
    TILE = CHUNK * STRIDE

    @cuda.jit(device=True, inline=True)
    def row_times_column(m, t, s, g):
        """Row ``t`` of the staged ``[n, DK]`` matrix ``m`` times this lane group's state column: each
        lane its rows ``g, g + 8, ...``, the eight partial sums met by three shuffles."""
        part = float32(0.0)
        for r in range(ROWS):
            part += m[t * DK + g + r * G] * s[r]
        part += cuda.shfl_xor_sync(0xFFFFFFFF, part, 1)
        part += cuda.shfl_xor_sync(0xFFFFFFFF, part, 2)
        part += cuda.shfl_xor_sync(0xFFFFFFFF, part, 4)
        return part

    def chunk_scan(scratch, qk, o_out, states, slot_stride, lanes, seq_rows, n_k, n_v):
        sh_cum = cuda.shared.array(CHUNK, float32)
        sh_m = cuda.shared.array(M_SIZE, float32)
        sh_v = cuda.shared.array(TILE, float32)  # V'
        sh_o = cuda.shared.array(TILE, float32)  # (q e^cum) S
        head = cuda.blockIdx.x
        seq = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        c = tid // G
        g = tid % G
        j = cuda.blockIdx.y * COLS + c  # the state column (value dim) this lane works on
        n_chunks = (seq_rows + CHUNK - 1) // CHUNK
        key_dim = n_k * DK
        value_dim = n_v * DV
        q_col = (head // (n_v // n_k)) * DK
        base = int64(lanes[seq]) * slot_stride + int64(head) * DK * DV + g * DV + j
        s = cuda.local.array(ROWS, float32)
        upd = cuda.local.array(ROWS, float32)
        for r in range(ROWS):
            s[r] = states[base + r * G * DV]
        for chunk in range(n_chunks):
            n = min(CHUNK, seq_rows - chunk * CHUNK)
            row0 = int64(seq) * seq_rows + chunk * CHUNK
            at, w_at, u_at, p_at = offsets(seq, head, n_v, n_chunks, chunk)
            if tid < n:
                sh_cum[tid] = scratch[at + tid]
            for e in range(tid, n * DK, CHUNK_THREADS):
                sh_m[e] = scratch[w_at + e]
            cuda.syncthreads()
            # V' = U - W S
            for t in range(n):
                part = row_times_column(sh_m, t, s, g)
                if g == 0:
                    sh_v[t * STRIDE + c] = scratch[u_at + t * DV + j] - part
            cuda.syncthreads()
            for e in range(tid, n * DK, CHUNK_THREADS):
                t = e // DK
                sh_m[e] = qk[(row0 + t) * 2 * key_dim + q_col + e % DK] * math.exp(sh_cum[t])
            cuda.syncthreads()
            # (q e^cum) S
            for t in range(n):
                part = row_times_column(sh_m, t, s, g)
                if g == 0:
                    sh_o[t * STRIDE + c] = part
            cuda.syncthreads()
            for e in range(tid, n * CHUNK, CHUNK_THREADS):
                sh_m[e] = scratch[p_at + e]
            cuda.syncthreads()
            # o = (q e^cum) S + P V': lane g takes tokens g, g + 8, ... of each row's causal sum
            for t in range(n):
                part = float32(0.0)
                for m in range(PSTEPS):
                    jt = g + m * G
                    if jt <= t:
                        part += sh_m[t * CHUNK + jt] * sh_v[jt * STRIDE + c]
                part += cuda.shfl_xor_sync(0xFFFFFFFF, part, 1)
                part += cuda.shfl_xor_sync(0xFFFFFFFF, part, 2)
                part += cuda.shfl_xor_sync(0xFFFFFFFF, part, 4)
                if g == 0:
                    o_out[(row0 + t) * value_dim + head * DV + j] = sh_o[t * STRIDE + c] + part
            cuda.syncthreads()
            end = sh_cum[n - 1]  # a partial chunk ends at its last token (the reference pads with g = 0)
            for e in range(tid, n * DK, CHUNK_THREADS):
                t = e // DK
                sh_m[e] = qk[(row0 + t) * 2 * key_dim + key_dim + q_col + e % DK] * math.exp(end - sh_cum[t])
            cuda.syncthreads()
            # S = e^end S + (k e^(end - cum))^T V'
            for r in range(ROWS):
                upd[r] = float32(0.0)
            for t in range(n):
                v = sh_v[t * STRIDE + c]
                for r in range(ROWS):
                    upd[r] += sh_m[t * DK + g + r * G] * v
            chunk_decay = math.exp(end)
            for r in range(ROWS):
                s[r] = s[r] * chunk_decay + upd[r]
            cuda.syncthreads()  # sh_m, sh_v and sh_cum are rewritten by the next chunk
        for r in range(ROWS):
            states[base + r * G * DV] = s[r]

    return chunk_scan


KERNELS = {
    "deltanet_conv": (deltanet_conv, (F32P, F32P, int32, F32P, int64, I32P, I32P, int32, int32, F32P),
                      {"threads": CONV_THREADS, "kernel": CONV_KERNEL, "grid_wait": 1}),
}
for _d in HEAD_DIMS:
    KERNELS[f"deltanet_rule_k{_d}_v{_d}"] = (
        make_rule(_d, _d),
        (F32P, F32P, F32P, F32P, int64, I32P, I32P, int32, int32, int32, int32, F32P, F32P, F32P, float32),
        {"threads": 2 * _d, "grid_wait": 1})
    for _s in rule_splits(_d):
        KERNELS[f"deltanet_rule_s{_s}_k{_d}_v{_d}"] = (
            make_rule_split(_d, _d, _s),
            (F32P, F32P, F32P, F32P, int64, I32P, I32P, int32, int32, int32, F32P, F32P, F32P, float32, F32P, I32P),
            {"threads": 2 * _d // _s, "splits": _s, "grid_wait": 1})
    for _s in rule_splits(_d)[:1] if _d in (32, 128) else ():  # the MoE hybrids' split (MOE_RULE_SPLITS) at
        # the 35B-A3B's head dim and the tests', outputs left unscaled
        KERNELS[f"deltanet_rule_s{_s}u_k{_d}_v{_d}"] = (
            make_rule_split(_d, _d, _s, UNSCALED=True),
            (F32P, F32P, F32P, F32P, int64, I32P, I32P, int32, int32, int32, F32P, F32P, F32P, float32, F32P),
            {"threads": 2 * _d // _s, "splits": _s, "unscaled": 1, "grid_wait": 1})
    KERNELS[f"deltanet_step_k{_d}_v{_d}"] = (
        make_step(_d, _d),
        (F32P, F32P, F32P, int64, I32P, I32P, int32, int32, int32, F32P, F32P, F32P, F32P, float32, I32P),
        {"threads": 2 * _d, "grid_wait": 1})
    KERNELS[f"deltanet_prep_k{_d}"] = (make_prep(_d), (F32P, F32P, F32P, F32P, int32, int32, int32, F32P, F32P),
                                       {"threads": max(32, _d)})
    KERNELS[f"deltanet_scan_k{_d}_v{_d}"] = (
        make_scan(_d, _d), (F32P, F32P, F32P, F32P, F32P, int64, I32P, int32, int32, int32),
        {"threads": 4 * _d // SCAN_SPLITS, "splits": SCAN_SPLITS})
    KERNELS[f"deltanet_chunk_prep_k{_d}_v{_d}"] = (
        make_chunk_prep(_d, _d), (F32P, F32P, F32P, F32P, F32P, int32, F32P, F32P, int32, int32, int32),
        {"threads": CHUNK_THREADS, "chunk": CHUNK, "chunk_floats": chunk_floats(_d, _d)})
    KERNELS[f"deltanet_chunk_scan_k{_d}_v{_d}"] = (
        make_chunk_scan(_d, _d), (F32P, F32P, F32P, F32P, int64, I32P, int32, int32, int32),
        {"threads": CHUNK_THREADS, "splits": _d // CHUNK_COLS, "chunk": CHUNK, "chunk_floats": chunk_floats(_d, _d)})
    KERNELS[f"deltanet_gated_norm_v{_d}"] = (make_gated_norm(_d), (F32P, F32P, F32P, int32, int32, int32, F32P, float32),
                                             {"threads": max(32, _d)})
