"""Gated DeltaNet in NumPy (fp32): the depthwise causal conv and the gated delta rule, two forms.

Per value head the layer keeps a state ``S`` of shape ``[k_head_dim, v_head_dim]``. With the
query and key L2-normalised (the query also scaled by ``k_head_dim ** -0.5``), each token does

    S   <- exp(g_t) * S                       (decay; g_t <= 0 is a log-decay)
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T  (delta rule: write the part of v_t S does not predict)
    o_t  = S^T q_t

``recurrent`` runs that literally, one token at a time, for any number of sequences at once: the
decode form. ``chunked`` computes the same outputs and final state for one sequence in chunks of
``CHUNK`` tokens: inside a chunk the sequential updates collapse to a unit lower-triangular system
(the WY/UT form), solved by forward substitution, so the work is matrix products: the prefill
form. The two agree to float32 rounding (tests/test_hybrid_deltanet.py).

The conv runs over the pre-conv q|k|v channels with kernel ``K``; its state is the last ``K - 1``
input rows of the sequence (zeros before the first token).
"""

from __future__ import annotations

import numpy as np

CHUNK = 64  # transformers' and FLA's chunk size; any size gives the same result up to rounding
L2_EPS = np.float32(1e-6)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # The tanh form cannot overflow, unlike 1 / (1 + exp(-x)).
    return np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0.0), x).astype(np.float32, copy=False)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis (FLA's and transformers' epsilon)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def conv_prefill(x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv of ``x`` [T, C] after ``state`` [K-1, C]; weight [C, K].

    Returns (pre-activation output [T, C], new state [K-1, C]). Tap ``K - 1`` multiplies the
    current token, tap 0 the token ``K - 1`` steps back.
    """
    kernel = weight.shape[1]
    full = np.concatenate([state, x], axis=0)
    steps = x.shape[0]
    out = full[0:steps] * weight[:, 0]
    for j in range(1, kernel):
        out += full[j : j + steps] * weight[:, j]
    return out, full[full.shape[0] - (kernel - 1) :].copy()


def conv_step(x: np.ndarray, state: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token per sequence: ``x`` [B, C], ``state`` [B, K-1, C] -> (output [B, C], new state)."""
    full = np.concatenate([state, x[:, None, :]], axis=1)  # [B, K, C]
    out = np.einsum("bkc,ck->bc", full, weight)
    return out, full[:, 1:].copy()


def recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
              state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The token-by-token form over ``B`` sequences.

    ``q``, ``k`` [B, T, H, dk] (normalised and scaled already), ``v`` [B, T, H, dv],
    ``g``, ``beta`` [B, T, H], ``state`` [B, H, dk, dv]. Returns (o [B, T, H, dv], final state).
    """
    s = state.astype(np.float32, copy=True)
    out = np.empty(v.shape, dtype=np.float32)
    for t in range(q.shape[1]):
        s *= np.exp(g[:, t])[..., None, None]
        predicted = np.einsum("bhk,bhkv->bhv", k[:, t], s)
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        s += k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], s)
    return out, s


def chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
            state: np.ndarray, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """The chunked form for one sequence: ``q``, ``k`` [T, H, dk], ``v`` [T, H, dv], ``g``,
    ``beta`` [T, H], ``state`` [H, dk, dv]. Returns (o [T, H, dv], final state)."""
    steps, heads = g.shape
    pad = -steps % chunk
    # Padding tokens have k = 0, beta = 0 and g = 0: they neither decay nor write the state.
    q, k, v, g, beta = (np.concatenate([a, np.zeros((pad, *a.shape[1:]), np.float32)]) if pad else a
                        for a in (q, k, v, g, beta))
    n = (steps + pad) // chunk

    def blocks(a: np.ndarray) -> np.ndarray:  # [T, H, ...] -> [H, N, C, ...]
        return np.moveaxis(a.reshape(n, chunk, heads, *a.shape[2:]), 2, 0)

    q, k, v, g, beta = (blocks(a) for a in (q, k, v, g, beta))
    cum = np.cumsum(g, axis=-1)  # log of the decay from the chunk start through each token
    lower = np.tril(np.ones((chunk, chunk), dtype=bool))
    # decay[i, j] = exp(cum_i - cum_j) for j <= i: how much of token j's write survives to i.
    # Masking before exp keeps the (positive) upper triangle from overflowing.
    decay = np.exp(np.where(lower, cum[..., :, None] - cum[..., None, :], -np.inf)).astype(np.float32)
    k_beta = k * beta[..., None]
    # Within a chunk the delta rule's writes w solve (I + A) w = rhs with A strictly lower:
    # A[i, j] = beta_i (k_i . k_j) decay[i, j], j < i.
    a = (k_beta @ np.swapaxes(k, -1, -2)) * decay
    rhs = np.concatenate([v * beta[..., None], k_beta * np.exp(cum)[..., None]], axis=-1)
    solved = _unit_lower_solve(a, rhs)
    new_values, k_cumdecay = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    intra = (q @ np.swapaxes(k, -1, -2)) * decay  # causal, diagonal included
    q_decayed = q * np.exp(cum)[..., None]
    k_to_end = k * np.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = np.exp(cum[..., -1])[..., None, None]  # [H, N, 1, 1]
    s = state.astype(np.float32, copy=True)
    out = np.empty(new_values.shape, dtype=np.float32)
    for i in range(n):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s  # what the incoming state fails to predict
        out[:, i] = q_decayed[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + np.swapaxes(k_to_end[:, i], -1, -2) @ v_new
    out = np.moveaxis(out, 0, 2).reshape(n * chunk, heads, -1)[:steps]
    return out, s


def _unit_lower_solve(a: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Solve ``(I + strictly_lower(a)) x = rhs`` by forward substitution over the chunk rows."""
    x = np.empty_like(rhs)
    for i in range(rhs.shape[-2]):
        x[..., i, :] = rhs[..., i, :] - np.einsum("...j,...jd->...d", a[..., i, :i], x[..., :i, :])
    return x


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNormGated: normalise ``x`` over its last axis, scale by ``weight`` (plain, not 1 + w),
    then multiply by ``silu(gate)``."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    normed = x / np.sqrt(variance + np.float32(eps)) * weight
    return normed * (gate * sigmoid(gate))
