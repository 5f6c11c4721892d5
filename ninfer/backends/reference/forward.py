"""The dense decoder forward pass in NumPy, fp32 throughout: the executable specification.

One function runs both prefill and decode. Queries come as ``S`` sequences of ``Q`` tokens
(prefill: one sequence, the chunk's tokens; decode: ``B`` sequences of one token). Every query
attends to the keys of its own sequence at positions ``<= its own position``: that single rule is
the causal mask within a chunk, the attention over an earlier prefix, and the per-row length of a
decode batch with sequences of different lengths.
"""

from __future__ import annotations

import numpy as np

from ninfer.backends.reference.kv_cache import PagedKVCache
from ninfer.backends.reference.rope import apply_rope, rope_tables
from ninfer.backends.reference.weights import LayerWeights, ModelWeights
from ninfer.models.dense import DenseConfig

# Queries per attention block in a long prefill: bounds the score matrix to
# heads x block x context floats instead of heads x chunk x context.
QUERY_BLOCK = 256


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """HF order of operations: normalise in fp32, then scale by the weight."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    # sigmoid(x) = (1 + tanh(x / 2)) / 2 cannot overflow, unlike 1 / (1 + exp(-x)).
    return x * (np.float32(0.5) + np.float32(0.5) * np.tanh(np.float32(0.5) * x))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, query_pos: np.ndarray, scale: float) -> np.ndarray:
    """Grouped-query attention of ``q`` [S, Q, H, D] over ``k``/``v`` [S, T, Hkv, D].

    Query ``(s, i)`` sees keys ``t <= query_pos[s, i]`` of sequence ``s``. Returns [S, Q, H * D].
    """
    s_count, q_count, heads, dim = q.shape
    if q_count > QUERY_BLOCK:
        blocks = [
            attention(q[:, i : i + QUERY_BLOCK], k, v, query_pos[:, i : i + QUERY_BLOCK], scale)
            for i in range(0, q_count, QUERY_BLOCK)
        ]
        return np.concatenate(blocks, axis=1)
    kv_heads = k.shape[2]
    group = heads // kv_heads
    # [S, Q, Hkv, G, D] -> [S, Hkv, G * Q, D]: each KV head serves its G query heads in one matmul.
    qg = q.reshape(s_count, q_count, kv_heads, group, dim).transpose(0, 2, 3, 1, 4)
    qg = qg.reshape(s_count, kv_heads, group * q_count, dim)
    scores = np.matmul(qg, k.transpose(0, 2, 3, 1)) * np.float32(scale)  # [S, Hkv, G*Q, T]
    key_pos = np.arange(k.shape[1], dtype=np.int64)
    row_pos = np.tile(query_pos, (1, group))  # G-major, Q-minor: the order of qg's rows
    masked = key_pos[None, None, :] > row_pos[:, :, None]  # [S, G*Q, T]
    scores = np.where(masked[:, None], np.float32(-np.inf), scores)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.matmul(probs, v.transpose(0, 2, 1, 3))  # [S, Hkv, G*Q, D]
    out = out.reshape(s_count, kv_heads, group, q_count, dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(s_count, q_count, heads * dim)


class DenseForward:
    """Weights, RoPE tables and the KV pool of one dense model; no scheduling state."""

    def __init__(self, config: DenseConfig, weights: ModelWeights, cache: PagedKVCache, max_context: int):
        self.config = config
        self.weights = weights
        self.cache = cache
        self.cos, self.sin = rope_tables(config, max_context)
        self.scale = config.head_dim**-0.5

    def hidden(self, tokens: np.ndarray, positions: np.ndarray, page_tables: np.ndarray, seqs: int) -> np.ndarray:
        """Final-norm hidden states [S * Q] of ``tokens`` laid out as ``seqs`` sequences.

        ``positions`` [S * Q] are absolute; ``page_tables`` [S, pages] covers each sequence's
        positions. K/V of every token are written to the pool before its sequence attends.
        """
        rows = tokens.shape[0]
        query_pos = positions.reshape(seqs, rows // seqs)
        seq_of_row = np.repeat(np.arange(seqs), rows // seqs)
        pages = page_tables[seq_of_row, positions // self.cache.page_size]
        slots = positions % self.cache.page_size
        length = int(positions.max()) + 1
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.weights.embed[tokens]
        for index, layer in enumerate(self.weights.layers):
            x = self._layer(index, layer, x, cos, sin, pages, slots, page_tables, query_pos, length)
        return rms_norm(x, self.weights.final_norm, self.config.rms_norm_eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return np.matmul(hidden, self.weights.lm_head)

    def _layer(self, index, w: LayerWeights, x, cos, sin, pages, slots, page_tables, query_pos, length):
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
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        self.cache.write(index, pages, slots, k, v)
        keys, values = self.cache.gather(index, page_tables, length)
        seqs, per_seq = query_pos.shape
        attn = attention(q.reshape(seqs, per_seq, c.num_heads, c.head_dim), keys, values, query_pos, self.scale)
        x = x + attn.reshape(rows, c.q_size) @ w.o
        h = rms_norm(x, w.mlp_norm, c.rms_norm_eps)
        gate_up = h @ w.gate_up
        act = silu(gate_up[:, : c.intermediate_size]) * gate_up[:, c.intermediate_size :]
        return x + act @ w.down
