"""The sampling rule every backend implements: this NumPy version is its executable definition.

For one row of fp32 logits:
1. penalties: ``logit[t] -= presence * (count[t] > 0) + frequency * count[t]`` over generated tokens;
2. ``temperature == 0``: argmax, lowest index on ties;
3. otherwise keep the ``k`` largest logits (``k = top_k``, or 20 for ``top_k`` 0), ordered by value
   descending then index ascending; softmax of ``logit / temperature`` over them;
4. top-p: keep the shortest head whose cumulative probability reaches ``top_p`` (at least one);
5. min-p: drop candidates with ``p < min_p * p_max``; renormalise;
6. draw ``u`` from the counter-based generator keyed by ``(seed, step)`` and take the first
   candidate whose cumulative probability exceeds ``u``.

The generator depends only on the request's seed and the output index, so a seeded request gives
the same tokens whatever else shares its batch. The CUDA sampler mirrors this bit for bit in its
integer part (the hash) and to fp32 rounding in the rest.
"""

from __future__ import annotations

import numpy as np

from ninfer.backends.inputs import TOP_K_CAP
from ninfer.backends.runner import SamplingRow
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """A uniform draw in [0, 1) with 24 bits, a pure function of (seed, step)."""
    x = splitmix64((seed & _MASK64) ^ ((step * _GOLDEN) & _MASK64))
    return (x >> 40) / float(1 << 24)


def apply_penalties(logits: np.ndarray, counts: np.ndarray, row: SamplingRow) -> np.ndarray:
    if row.presence_penalty == 0.0 and row.frequency_penalty == 0.0:
        return logits
    # fp32 throughout, as the device sampler computes it (a bool mask times a Python float is fp64).
    counts = counts.astype(np.float32)
    presence = np.float32(row.presence_penalty) * (counts > 0).astype(np.float32)
    return logits - presence - np.float32(row.frequency_penalty) * counts


def top_k_order(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest logits, value descending then index ascending.

    The same as the first ``k`` of a full stable sort, but a partition finds the k-th value first
    and only the logits at or above it are sorted: a full sort of a 150k vocabulary cost 14 ms a
    row, the reference decode step's largest item after the GEMMs.
    """
    vocab = logits.shape[0]
    k = min(k, vocab)
    candidates = np.arange(vocab)
    # A partition ranks NaN above every number, the stable sort below: such rows take the sort.
    if k < vocab and not np.isnan(logits).any():
        threshold = np.partition(logits, vocab - k)[vocab - k]
        candidates = np.flatnonzero(logits >= threshold)
    return candidates[np.lexsort((candidates, -logits[candidates]))[:k]]


def sample_row(logits: np.ndarray, row: SamplingRow, counts: np.ndarray | None = None) -> int:
    """Sample one token id from fp32 ``logits`` [vocab]; ``counts`` are generated-token counts."""
    logits = np.asarray(logits, dtype=np.float32)
    if counts is not None:
        logits = apply_penalties(logits, counts, row)
    if row.temperature <= 0.0:
        return int(np.argmax(logits))
    k = row.top_k or TOP_K_CAP
    order = top_k_order(logits, k)
    scaled = logits[order] / np.float32(row.temperature)
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    if row.top_p < 1.0:
        cumulative = np.cumsum(probs)
        keep = int(np.searchsorted(cumulative, np.float32(row.top_p) - np.float32(1e-6))) + 1
        probs = probs[: max(1, keep)]
    if row.min_p > 0.0:
        probs = probs[probs >= np.float32(row.min_p) * probs[0]]
    cumulative = np.cumsum(probs)
    target = np.float32(uniform(row.seed, row.step)) * cumulative[-1]
    index = int(np.searchsorted(cumulative, target, side="right"))
    return int(order[min(index, len(cumulative) - 1)])
