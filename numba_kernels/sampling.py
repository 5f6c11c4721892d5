"""Device sampling: the rule of ``ninfer.backends.sampling`` on the GPU, one block per row.

Penalised logit ``l[t] - presence * (count[t] > 0) - frequency * count[t]`` is computed on the fly
from the lane's counts. The block selects the ``k`` best candidates (value descending, index
ascending; ``k = 1`` for greedy) by ``k`` block-wide arg-max rounds, then thread 0 applies
temperature, softmax, top-p, min-p and the splitmix64 draw keyed by ``(seed, step)`` over at most
20 candidates. Only the chosen ids leave the device.

Per-row parameters: ``fparams[r*5 : r*5+5] = temperature, top_p, min_p, presence, frequency``;
``iparams[r*2 : r*2+2] = top_k, lane``; ``keys[r*2 : r*2+2] = seed (as u64), step``.
Launch: grid ``(rows,)``, block 1024 (``THREADS``).
"""

from __future__ import annotations

import math

from numba import cuda, float32, int32, int64, uint64

from numba_kernels.common import F32P, I32P, U64P, NEG_BIG

THREADS = 1024
TOP_K_CAP = 20
GOLDEN = uint64(0x9E3779B97F4A7C15)
MIX1 = uint64(0xBF58476D1CE4E5B9)
MIX2 = uint64(0x94D049BB133111EB)


@cuda.jit(device=True, inline=True)
def splitmix64(x):
    x = x + GOLDEN
    x = (x ^ (x >> uint64(30))) * MIX1
    x = (x ^ (x >> uint64(27))) * MIX2
    return x ^ (x >> uint64(31))


@cuda.jit(device=True, inline=True)
def better(v, i, bv, bi):
    """Candidate order: larger value first, then lower index."""
    return v > bv or (v == bv and i < bi)


def sample(out, logits, counts, fparams, iparams, keys, vocab):
    cand_v = cuda.shared.array(TOP_K_CAP, float32)
    cand_i = cuda.shared.array(TOP_K_CAP, int32)
    red_v = cuda.shared.array(32, float32)
    red_i = cuda.shared.array(32, int32)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    lane = tid & 31
    warp = tid >> 5
    temperature = fparams[row * 5]
    presence = fparams[row * 5 + 3]
    frequency = fparams[row * 5 + 4]
    top_k = iparams[row * 2]
    seq_lane = iparams[row * 2 + 1]
    k = 1
    if temperature > float32(0.0):
        k = top_k if 1 <= top_k <= TOP_K_CAP else TOP_K_CAP
    k = min(k, vocab)
    penalised = presence != float32(0.0) or frequency != float32(0.0)
    lbase = int64(row) * vocab
    cbase = int64(seq_lane) * vocab
    for rnd in range(k):
        bv = NEG_BIG
        bi = int32(0x7FFFFFFF)
        for t in range(tid, vocab, THREADS):
            v = logits[lbase + t]
            if penalised:
                c = counts[cbase + t]
                v = v - presence * float32(c > 0) - frequency * float32(c)
            taken = False
            for j in range(rnd):
                if cand_i[j] == t:
                    taken = True
            if not taken and better(v, t, bv, bi):
                bv = v
                bi = t
        for offset in (16, 8, 4, 2, 1):
            ov = cuda.shfl_xor_sync(0xFFFFFFFF, bv, offset)
            oi = cuda.shfl_xor_sync(0xFFFFFFFF, bi, offset)
            if better(ov, oi, bv, bi):
                bv = ov
                bi = oi
        if lane == 0:
            red_v[warp] = bv
            red_i[warp] = bi
        cuda.syncthreads()
        if tid == 0:
            bv = red_v[0]
            bi = red_i[0]
            for w in range(1, THREADS // 32):
                if better(red_v[w], red_i[w], bv, bi):
                    bv = red_v[w]
                    bi = red_i[w]
            cand_v[rnd] = bv
            cand_i[rnd] = bi
        cuda.syncthreads()
    if tid != 0:
        return
    if k == 1 or temperature <= float32(0.0):
        out[row] = cand_i[0]
        return
    probs = cuda.local.array(TOP_K_CAP, float32)
    top = cand_v[0] / temperature
    total = float32(0.0)
    for j in range(k):
        probs[j] = math.exp(cand_v[j] / temperature - top)
        total += probs[j]
    for j in range(k):
        probs[j] = probs[j] / total
    keep = k
    top_p = fparams[row * 5 + 1]
    if top_p < float32(1.0):
        threshold = top_p - float32(1e-6)
        cumulative = float32(0.0)
        below = 0
        for j in range(k):
            cumulative += probs[j]
            if cumulative < threshold:
                below += 1
        keep = min(max(1, below + 1), k)
    min_p = fparams[row * 5 + 2]
    if min_p > float32(0.0):
        floor = min_p * probs[0]
        kept = 0
        for j in range(keep):
            if probs[j] >= floor:
                kept += 1
        keep = kept
    cumulative = float32(0.0)
    for j in range(keep):
        cumulative += probs[j]
    seed = uint64(keys[row * 2])
    step = uint64(keys[row * 2 + 1])
    x = splitmix64(seed ^ (step * GOLDEN))
    u = float32(x >> uint64(40)) / float32(16777216.0)
    target = u * cumulative
    running = float32(0.0)
    index = 0
    for j in range(keep):
        running += probs[j]
        if running <= target:
            index += 1
    out[row] = cand_i[min(index, keep - 1)]


KERNELS = {"sample": (sample, (I32P, F32P, I32P, F32P, I32P, U64P, int32))}
