"""The dense decoder forward pass in NumPy, fp32 throughout: the executable specification.

One function runs both prefill and decode. Queries come as ``S`` sequences of ``Q`` tokens
(prefill: one sequence, the chunk's tokens; decode: ``B`` sequences of one token). Every query
attends to the keys of its own sequence at positions ``<= its own position``: that single rule is
the causal mask within a chunk, the attention over an earlier prefix, and the per-row length of a
decode batch with sequences of different lengths.
"""

from __future__ import annotations

import attrs
import numpy as np

from ninfer.backends.reference.kv_cache import PagedKVCache
from ninfer.backends.reference.rope import apply_rope, rope_tables
from ninfer.backends.reference.weights import LayerWeights, ModelWeights
from ninfer.models.dense import DenseConfig

# Longest run of tokens one forward call takes: the runner splits longer prefill chunks (same
# result, chunked prefill is exact), which bounds the mask and score matrices to about
# heads x PREFILL_BLOCK x context floats however long the prompt.
PREFILL_BLOCK = 256


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """HF order of operations: normalise in fp32, then scale by the weight."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    # sigmoid(x) = (1 + tanh(x / 2)) / 2 cannot overflow, unlike 1 / (1 + exp(-x)).
    return x * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x))


def causal_mask(query_pos: np.ndarray, length: int) -> np.ndarray:
    """Additive mask [S, 1, Q, 1, length]: 0 where key ``t <= query_pos[s, i]``, else -inf."""
    hidden = np.arange(length)[None, None, :] > query_pos[:, :, None]
    return np.where(hidden, np.float32(-np.inf), np.float32(0.0))[:, None, :, None, :]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """Grouped-query attention of ``q`` [S, Q, H, D] over ``k``/``v`` [S, T, Hkv, D].

    ``mask`` is ``causal_mask``'s [S, 1, Q, 1, T]. Returns [S, Q, H * D].
    """
    s_count, q_count, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    # [S, Q, Hkv, G, D] -> [S, Hkv, Q * G, D]: each KV head serves its G query heads in one matmul.
    qg = q.reshape(s_count, q_count, kv_heads, group, dim).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(s_count, kv_heads, q_count * group, dim)
    scores = np.matmul(qg, k.transpose(0, 2, 3, 1))  # [S, Hkv, Q*G, T]
    scores *= np.float32(scale)
    scores = scores.reshape(s_count, kv_heads, q_count, group, -1)
    scores += mask
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.matmul(probs.reshape(s_count, kv_heads, q_count * group, -1), v.transpose(0, 2, 1, 3))
    out = out.reshape(s_count, kv_heads, q_count, group, dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(s_count, q_count, heads * dim)


class DenseForward:
    """Weights, RoPE tables and the KV pool of one dense model; no scheduling state."""

    def __init__(self, config: DenseConfig, weights: ModelWeights, cache: PagedKVCache, max_context: int):
        self.config = config
        self.weights = weights
        self.cache = cache
        self.cos, self.sin = rope_tables(config, max_context)
        self.scale = config.head_dim**-0.5

    def hidden(self, tokens: np.ndarray, positions: np.ndarray, page_tables: np.ndarray, lanes: np.ndarray,
               decode: bool) -> np.ndarray:
        """Final-norm hidden states [S * Q] of ``tokens`` laid out as one sequence per lane.

        ``positions`` [S * Q] are absolute; ``page_tables`` [S, pages] covers each sequence's
        positions. K/V of every token are written to the pool before its sequence attends.
        Prefill is one lane with the chunk's tokens, decode one token per lane (``decode`` only
        matters to models with per-lane state).
        """
        step = AttentionStep.of(self.cache, self.cos, self.sin, positions, page_tables, lanes.size)
        x = self.weights.embed[tokens]
        for index, layer in enumerate(self.weights.layers):
            x = self._layer(index, layer, x, step)
        return rms_norm(x, self.weights.final_norm, self.config.rms_norm_eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return np.matmul(hidden, self.weights.lm_head)

    def _layer(self, index: int, w: LayerWeights, x: np.ndarray, step: AttentionStep) -> np.ndarray:
        c = self.config
        rows = x.shape[0]
        h = rms_norm(x, w.attn_norm, c.rms_norm_eps)
        qkv = h @ w.qkv
        if w.qkv_bias is not None:
            qkv += w.qkv_bias
        q = qkv[:, : c.q_size].reshape(rows, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].reshape(rows, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].reshape(rows, c.num_kv_heads, c.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, c.rms_norm_eps)
            k = rms_norm(k, w.k_norm, c.rms_norm_eps)
        q = apply_rope(q, step.cos, step.sin)
        k = apply_rope(k, step.cos, step.sin)
        self.cache.write(index, step.slots, k, v)
        keys, values = self.cache.gather(index, step.context)
        q = q.reshape(step.seqs, rows // step.seqs, c.num_heads, c.head_dim)
        attn = attention(q, keys, values, step.mask, self.scale)
        x = x + attn.reshape(rows, c.q_size) @ w.o
        return x + swiglu(w.gate_up, w.down, rms_norm(x, w.mlp_norm, c.rms_norm_eps))


def swiglu(gate_up: np.ndarray, down: np.ndarray, h: np.ndarray) -> np.ndarray:
    """``(silu(h @ gate) * (h @ up)) @ down`` with gate and up fused: ``gate_up`` [h, 2I], ``down`` [I, h]."""
    fused = h @ gate_up
    inner = fused.shape[1] // 2
    return (silu(fused[:, :inner]) * fused[:, inner:]) @ down


@attrs.define(slots=True)
class AttentionStep:
    """Per-step values every attention layer shares, worked out once per step."""

    slots: np.ndarray  # flat KV slot of each row's token
    context: np.ndarray | slice  # where each sequence's keys live (PagedKVCache.context_index)
    mask: np.ndarray  # causal_mask
    cos: np.ndarray
    sin: np.ndarray
    seqs: int

    @classmethod
    def of(cls, cache: PagedKVCache, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
           page_tables: np.ndarray, seqs: int) -> AttentionStep:
        """``positions`` [S * Q]: ``seqs`` sequences of equally many query tokens."""
        per_seq = positions.shape[0] // seqs
        length = int(positions.max()) + 1
        return cls(
            slots=cache.token_slots(page_tables, positions, np.repeat(np.arange(seqs), per_seq)),
            context=cache.context_index(page_tables, length),
            mask=causal_mask(positions.reshape(seqs, per_seq), length),
            cos=cos[positions],
            sin=sin[positions],
            seqs=seqs,
        )
