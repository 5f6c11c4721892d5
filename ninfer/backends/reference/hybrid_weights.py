"""The reference backend's hybrid weights: float32, projections transposed to ``[in, out]``.

Source tensors use the canonical names of ``ninfer.models.hybrid``. Two transforms happen once at
load so the forward pass reads as the math: the zero-centred RMSNorm weights become ``1 + w``
(computed in fp32, as transformers does on every call), and ``A_log`` becomes ``-exp(A_log)``.
"""

from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from ninfer.backends.reference.weights import CheckedReader
from ninfer.models.hybrid import DENSE, LINEAR, HybridConfig, tensor_names


@attrs.define(slots=True)
class DeltaNetWeights:
    in_proj: np.ndarray  # [h, in_proj_size]: q | k | v | z | b | a
    conv: np.ndarray  # [conv_dim, kernel]
    dt_bias: np.ndarray  # [v_heads]
    neg_a: np.ndarray  # [v_heads] = -exp(A_log)
    norm: np.ndarray  # [v_head_dim], plain weight
    out: np.ndarray  # [value_dim, h]


@attrs.define(slots=True)
class AttentionWeights:
    qkv: np.ndarray  # [h, 2 q_size + 2 kv_size]
    q_norm: np.ndarray  # [head_dim], 1 + w
    k_norm: np.ndarray  # [head_dim], 1 + w
    o: np.ndarray  # [q_size, h]


@attrs.define(slots=True)
class DenseMlpWeights:
    gate_up: np.ndarray  # [h, 2 I]
    down: np.ndarray  # [I, h]


@attrs.define(slots=True)
class MoeWeights:
    router: np.ndarray  # [h, E]
    gate_up: np.ndarray  # [E, h, 2 I]
    down: np.ndarray  # [E, I, h]
    shared: DenseMlpWeights
    shared_gate: np.ndarray  # [h, 1]


@attrs.define(slots=True)
class HybridLayerWeights:
    attn_norm: np.ndarray  # 1 + w
    mixer: DeltaNetWeights | AttentionWeights
    mlp_norm: np.ndarray  # 1 + w
    mlp: DenseMlpWeights | MoeWeights


@attrs.define(slots=True)
class HybridWeights:
    embed: np.ndarray  # [vocab, h]
    layers: list[HybridLayerWeights]
    final_norm: np.ndarray  # 1 + w
    lm_head: np.ndarray  # [h, vocab]; a transposed view of ``embed`` when tied


def load_hybrid_weights(config: HybridConfig, get: Callable[[str], np.ndarray]) -> HybridWeights:
    """Read every canonical tensor through ``get(name)``, check its shape, upcast and lay it out."""
    read = CheckedReader(tensor_names(config), get)
    t, tr = read.vector, read.transposed

    def one_plus(name: str) -> np.ndarray:
        return np.float32(1.0) + t(name)

    def experts(name: str) -> np.ndarray:  # [E, out, in] -> [E, in, out]
        return np.ascontiguousarray(np.swapaxes(t(name), 1, 2))

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        if config.layer_types[i] == LINEAR:
            mixer: DeltaNetWeights | AttentionWeights = DeltaNetWeights(
                in_proj=tr(p + "in_proj"), conv=t(p + "conv"), dt_bias=t(p + "dt_bias"),
                neg_a=-np.exp(t(p + "A_log")), norm=t(p + "linear_norm"), out=tr(p + "out"))
        else:
            mixer = AttentionWeights(qkv=tr(p + "qkv"), q_norm=one_plus(p + "q_norm"),
                                     k_norm=one_plus(p + "k_norm"), o=tr(p + "o"))
        if config.mlp_types[i] == DENSE:
            mlp: DenseMlpWeights | MoeWeights = DenseMlpWeights(gate_up=tr(p + "gate_up"), down=tr(p + "down"))
        else:
            mlp = MoeWeights(
                router=tr(p + "router"),
                gate_up=experts(p + "experts.gate_up"),
                down=experts(p + "experts.down"),
                shared=DenseMlpWeights(gate_up=tr(p + "shared.gate_up"), down=tr(p + "shared.down")),
                shared_gate=tr(p + "shared_gate"))
        layers.append(HybridLayerWeights(attn_norm=one_plus(p + "attn_norm"), mixer=mixer,
                                         mlp_norm=one_plus(p + "mlp_norm"), mlp=mlp))
    embed = t("embed")
    lm_head = embed.T if config.tie_word_embeddings else tr("lm_head")
    return HybridWeights(embed=embed, layers=layers, final_norm=one_plus("final_norm"), lm_head=lm_head)
