"""The hybrid (Qwen3-Next / Qwen3.5) forward pass in NumPy, fp32: the executable specification.

Each layer is pre-norm residual: ``x += mixer(norm(x)); x += mlp(norm(x))`` where every norm is
the zero-centred RMSNorm (``* (1 + w)``). The mixer is Gated DeltaNet or gated full attention:

- DeltaNet: one projection gives q|k|v (through the depthwise causal conv and SiLU), z (output
  gate), b (``beta = sigmoid(b)``) and a (``g = -exp(A_log) * softplus(a + dt_bias)``); q and k are
  L2-normalised, each key head serves ``v_heads / k_heads`` consecutive value heads; the delta
  rule (``deltanet.py``) runs chunked for a prefill chunk and recurrent for a decode step; the
  output is ``RMSNormGated(o, z)`` per value head, then ``out``.
- Attention: q_proj gives per head a query and a gate; q and k get a per-head RMSNorm, RoPE on the
  first ``rotary_dim`` dimensions (rotate-half within them), causal GQA over the paged KV cache,
  and the output is multiplied by ``sigmoid(gate)`` before ``o``.

The MLP is SwiGLU, or MoE: softmax router in fp32, top-k experts (weights renormalised when the
config says so), plus a shared SwiGLU expert scaled by ``sigmoid(shared_gate(x))``.
"""

from __future__ import annotations

import attrs
import numpy as np

from ninfer.backends.reference import deltanet
from ninfer.backends.reference.forward import AttentionStep, attention, rms_norm, silu, swiglu
from ninfer.backends.reference.hybrid_state import StateStore
from ninfer.backends.reference.hybrid_weights import (
    AttentionWeights, DeltaNetWeights, DenseMlpWeights, HybridWeights, MoeWeights,
)
from ninfer.backends.reference.kv_cache import PagedKVCache
from ninfer.backends.reference.rope import apply_rope, base_inverse_frequencies, cos_sin_tables
from ninfer.models.hybrid import LINEAR, HybridConfig


@attrs.frozen
class StateRows:
    """The StateImage slots each sequence of a forward pass continues from (``read``) and leaves its
    new state in (``write``): the same slot for a prefill chunk, a lane's other image for a decode
    row (``ninfer/backends/lane_slots.py``)."""

    read: np.ndarray  # int [sequences]
    write: np.ndarray  # int [sequences]


class HybridForward:
    """Weights, RoPE tables, the KV pool (attention layers only) and the StateImage slots."""

    def __init__(self, config: HybridConfig, weights: HybridWeights, cache: PagedKVCache, states: StateStore,
                 max_context: int):
        self.config = config
        self.weights = weights
        self.cache = cache
        self.states = states
        # Unscaled RoPE over the first rotary_dim dimensions of each head.
        self.cos, self.sin = cos_sin_tables(base_inverse_frequencies(config.rope_theta, config.rotary_dim),
                                            max_context)
        self.scale = config.head_dim**-0.5
        # Layer index -> its index among the attention layers (KV pool) or DeltaNet layers (states).
        self.kv_index = {layer: i for i, layer in enumerate(config.attention_layers)}
        self.state_index = {layer: i for i, layer in enumerate(config.linear_layers)}

    def hidden(self, tokens: np.ndarray, positions: np.ndarray, page_tables: np.ndarray, states: StateRows,
               decode: bool) -> np.ndarray:
        """Final-norm hidden states of ``tokens``.

        Prefill (``decode=False``): one sequence, the chunk's tokens in order. Decode: one token per
        sequence. DeltaNet layers continue from the ``states.read`` slots and write the ``states.write`` ones.
        """
        step = AttentionStep.of(self.cache, self.cos, self.sin, positions, page_tables, states.read.size)
        x = self.weights.embed[tokens]
        eps = self.config.rms_norm_eps
        for index, layer in enumerate(self.weights.layers):
            h = rms_norm(x, layer.attn_norm, eps)
            if self.config.layer_types[index] == LINEAR:
                x = x + self._deltanet(self.state_index[index], layer.mixer, h, states, decode)
            else:
                x = x + self._attention(self.kv_index[index], layer.mixer, h, step)
            h = rms_norm(x, layer.mlp_norm, eps)
            x = x + (self._moe(layer.mlp, h) if isinstance(layer.mlp, MoeWeights) else _dense_mlp(layer.mlp, h))
        return rms_norm(x, self.weights.final_norm, eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return np.matmul(hidden, self.weights.lm_head)

    # -- mixers ---------------------------------------------------------------------------------

    def _deltanet(self, s: int, w: DeltaNetWeights, h: np.ndarray, states: StateRows, decode: bool) -> np.ndarray:
        c = self.config
        rows = h.shape[0]
        nk, nv, dk, dv = c.linear_num_k_heads, c.linear_num_v_heads, c.linear_k_head_dim, c.linear_v_head_dim
        proj = h @ w.in_proj
        mixed = proj[:, : c.conv_dim]
        z = proj[:, c.conv_dim : c.conv_dim + c.value_dim].reshape(rows, nv, dv)
        b = proj[:, c.conv_dim + c.value_dim : c.conv_dim + c.value_dim + nv]
        a = proj[:, c.conv_dim + c.value_dim + nv :]
        conv_state, rec_state = self.states.conv[s], self.states.recurrent[s]
        read, write = states.read, states.write
        if decode:
            mixed, conv_state[write] = deltanet.conv_step(mixed, conv_state[read], w.conv)
        else:
            mixed, conv_state[write[0]] = deltanet.conv_prefill(mixed, conv_state[read[0]], w.conv)
        mixed = silu(mixed)
        q = deltanet.l2_normalize(mixed[:, : c.key_dim].reshape(rows, nk, dk)) * np.float32(dk**-0.5)
        k = deltanet.l2_normalize(mixed[:, c.key_dim : 2 * c.key_dim].reshape(rows, nk, dk))
        v = mixed[:, 2 * c.key_dim :].reshape(rows, nv, dv)
        # Value head j reads key head j // (nv / nk).
        q, k = np.repeat(q, nv // nk, axis=1), np.repeat(k, nv // nk, axis=1)
        beta = deltanet.sigmoid(b)
        g = w.neg_a * deltanet.softplus(a + w.dt_bias)
        if decode:
            out, rec_state[write] = deltanet.recurrent(q[:, None], k[:, None], v[:, None], g[:, None],
                                                       beta[:, None], rec_state[read])
            out = out[:, 0]
        else:
            out, rec_state[write[0]] = deltanet.chunked(q, k, v, g, beta, rec_state[read[0]])
        out = deltanet.gated_rms_norm(out, z, w.norm, c.rms_norm_eps)
        return out.reshape(rows, c.value_dim) @ w.out

    def _attention(self, kv: int, w: AttentionWeights, h: np.ndarray, step: AttentionStep) -> np.ndarray:
        c = self.config
        rows = h.shape[0]
        qkv = h @ w.qkv
        query_gate = qkv[:, : 2 * c.q_size].reshape(rows, c.num_heads, 2 * c.head_dim)
        q = query_gate[..., : c.head_dim]
        gate = query_gate[..., c.head_dim :].reshape(rows, c.q_size)
        k = qkv[:, 2 * c.q_size : 2 * c.q_size + c.kv_size].reshape(rows, c.num_kv_heads, c.head_dim)
        v = qkv[:, 2 * c.q_size + c.kv_size :].reshape(rows, c.num_kv_heads, c.head_dim)
        q = rms_norm(q, w.q_norm, c.rms_norm_eps)
        k = rms_norm(k, w.k_norm, c.rms_norm_eps)
        rot = c.rotary_dim
        q[..., :rot] = apply_rope(q[..., :rot], step.cos, step.sin)
        k[..., :rot] = apply_rope(k[..., :rot], step.cos, step.sin)
        self.cache.write(kv, step.slots, k, v)
        keys, values = self.cache.gather(kv, step.context)
        q = q.reshape(step.seqs, rows // step.seqs, c.num_heads, c.head_dim)
        out = attention(q, keys, values, step.mask, self.scale).reshape(rows, c.q_size)
        return (out * deltanet.sigmoid(gate)) @ w.o

    # -- MLPs -----------------------------------------------------------------------------------

    def _moe(self, w: MoeWeights, h: np.ndarray) -> np.ndarray:
        c = self.config
        top, weights = route(h @ w.router, c.num_experts_per_tok, c.norm_topk_prob)
        out = np.zeros_like(h)
        for expert in np.unique(top):
            rows, slot = np.nonzero(top == expert)
            out[rows] += swiglu(w.gate_up[expert], w.down[expert], h[rows]) * weights[rows, slot, None]
        shared = _dense_mlp(w.shared, h) * deltanet.sigmoid(h @ w.shared_gate)
        return out + shared


def route(logits: np.ndarray, top_k: int, renormalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over experts, the ``top_k`` most probable (ties: lower expert id), their weights."""
    z = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, top, axis=-1)
    if renormalise:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return top, weights


def _dense_mlp(w: DenseMlpWeights, h: np.ndarray) -> np.ndarray:
    return swiglu(w.gate_up, w.down, h)
