"""Qwen3-Next / Qwen3.5 / Qwen3.6 hybrid decoders: configuration, derived shapes, canonical names.

A hybrid stacks two kinds of token mixer: Gated DeltaNet ("linear_attention", a recurrent layer
whose whole past is a fixed-size state) and gated full attention ("full_attention", a KV cache).
Every layer then has a dense SwiGLU MLP or a sparse MoE block with a gated shared expert.
No compute lives here; ``ninfer.backends.reference.hybrid`` is the executable definition.

Canonical tensors of the ``text`` component (weights ``[out, in]`` like the dense models):

- ``embed``, ``final_norm``, ``lm_head`` (absent when tied); ``layers.{i}.attn_norm`` and
  ``layers.{i}.mlp_norm`` on every layer. All hidden RMSNorm weights (and q/k norms) are stored
  as the checkpoint has them: the hybrid norm multiplies by ``1 + w``.
- DeltaNet layers: ``in_proj`` rows q | k | v | z | b | a (Qwen3-Next's per-key-head grouping is
  undone at conversion), ``conv`` ``[conv_dim, kernel]`` (depthwise), ``dt_bias``, ``A_log`` (f32),
  ``linear_norm`` ``[v_head_dim]`` (the gated norm: plain ``w``), ``out``.
- Attention layers: ``qkv`` rows = q_proj (per head: ``head_dim`` query rows then ``head_dim``
  gate rows, as the checkpoint interleaves them), then k, then v; ``q_norm``, ``k_norm``, ``o``.
- Dense MLP layers: ``gate_up`` (gate rows then up rows), ``down``.
- MoE layers: ``router`` ``[E, H]``, ``experts.gate_up`` ``[E, 2I, H]``, ``experts.down``
  ``[E, H, I]``, ``shared.gate_up``, ``shared.down``, ``shared_gate`` ``[1, H]``.

The per-sequence recurrent state (the "StateImage") of each DeltaNet layer is the conv tail
``[kernel - 1, conv_dim]`` (the last pre-conv q|k|v rows) and the delta-rule state
``[v_heads, k_head_dim, v_head_dim]``, both float32 in the reference backend.
"""

from __future__ import annotations

from typing import Any

import attrs

from ninfer.models.dense import check_numbers
from ninfer.models.names import decoder_tensor_names

# Hugging Face class names; the text backbone of the ConditionalGeneration classes is what we run.
ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
)
LINEAR = "linear_attention"
FULL = "full_attention"
DENSE = "dense"
MOE = "moe"


@attrs.frozen(kw_only=True)
class HybridConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...] = attrs.field(converter=tuple)  # LINEAR or FULL per layer
    mlp_types: tuple[str, ...] = attrs.field(converter=tuple)  # DENSE or MOE per layer
    rms_norm_eps: float
    # gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # int(head_dim * partial_rotary_factor): RoPE on the first rotary_dim dims
    rope_theta: float
    max_position_embeddings: int
    # Gated DeltaNet
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_head_dim: int
    linear_v_head_dim: int
    conv_kernel: int = 4
    # MLP / MoE
    intermediate_size: int = 0  # dense layers
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    mtp_num_layers: int = 0  # layers of the MTP head in the checkpoint's ``mtp`` component
    mrope_section: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))

    def __attrs_post_init__(self) -> None:
        check_numbers(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                             "rotary_dim", "max_position_embeddings", "linear_num_k_heads", "linear_num_v_heads",
                             "linear_k_head_dim", "linear_v_head_dim", "conv_kernel"))
        check_numbers(self, ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "shared_expert_intermediate_size", "mtp_num_layers"), zero=True)
        check_numbers(self, ("rms_norm_eps", "rope_theta"), integer=False)
        if len(self.layer_types) != self.num_layers or len(self.mlp_types) != self.num_layers:
            raise ValueError(f"layer_types/mlp_types must list {self.num_layers} layers")
        bad = {t for t in self.layer_types if t not in (LINEAR, FULL)}
        if bad:
            raise ValueError(f"layer_types: unknown kinds {sorted(bad)} (known: {LINEAR}, {FULL})")
        bad = {t for t in self.mlp_types if t not in (DENSE, MOE)}
        if bad:
            raise ValueError(f"mlp_types: unknown kinds {sorted(bad)} (known: {DENSE}, {MOE})")
        if self.linear_num_v_heads % self.linear_num_k_heads:
            raise ValueError("linear_num_v_heads must be a multiple of linear_num_k_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim]")
        if MOE in self.mlp_types and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("MoE layers need 0 < num_experts_per_tok <= num_experts")
        if MOE in self.mlp_types:
            check_numbers(self, ("moe_intermediate_size",))
        if DENSE in self.mlp_types:
            check_numbers(self, ("intermediate_size",))
        if self.mrope_section is not None and not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in self.mrope_section):
            raise ValueError(f"mrope_section must list non-negative integers, got {list(self.mrope_section)!r}")

    # -- derived shapes -------------------------------------------------------------------------

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def key_dim(self) -> int:
        return self.linear_num_k_heads * self.linear_k_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_v_heads * self.linear_v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k and v (z, b and a bypass it)."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_size(self) -> int:
        return self.conv_dim + self.value_dim + 2 * self.linear_num_v_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        """q_proj (query and gate) plus k and v."""
        return 2 * self.q_size + 2 * self.kv_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_kernel - 1, self.conv_dim)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.linear_num_v_heads, self.linear_k_head_dim, self.linear_v_head_dim)

    @property
    def state_floats_per_layer(self) -> int:
        (a, b), (c, d, e) = self.conv_state_shape, self.recurrent_state_shape
        return a * b + c * d * e

    @property
    def state_floats(self) -> int:
        """float32 values of one sequence's StateImage (every DeltaNet layer)."""
        return len(self.linear_layers) * self.state_floats_per_layer

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of the full-attention layers for one token."""
        return len(self.attention_layers) * 2 * self.kv_size * 2

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        for key in ("layer_types", "mlp_types", "mrope_section"):
            data[key] = None if data[key] is None else list(data[key])
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HybridConfig:
        for key in ("layer_types", "mlp_types"):  # tuple() of a string or a number would mislead
            if not isinstance(data.get(key), list):
                raise ValueError(f"{key} must be a list, got {data.get(key)!r}")
        return cls(**data)


def _linear_names(c: HybridConfig, p: str) -> dict[str, tuple[int, ...]]:
    return {
        p + "in_proj": (c.in_proj_size, c.hidden_size),  # rows: q | k | v | z | b | a
        p + "conv": (c.conv_dim, c.conv_kernel),
        p + "dt_bias": (c.linear_num_v_heads,),
        p + "A_log": (c.linear_num_v_heads,),
        p + "linear_norm": (c.linear_v_head_dim,),
        p + "out": (c.hidden_size, c.value_dim),
    }


def _attention_names(c: HybridConfig, p: str) -> dict[str, tuple[int, ...]]:
    return {
        p + "qkv": (c.qkv_size, c.hidden_size),
        p + "q_norm": (c.head_dim,),
        p + "k_norm": (c.head_dim,),
        p + "o": (c.hidden_size, c.q_size),
    }


def _mlp_names(c: HybridConfig, p: str, kind: str) -> dict[str, tuple[int, ...]]:
    h = c.hidden_size
    if kind == DENSE:
        return {p + "gate_up": (2 * c.intermediate_size, h), p + "down": (h, c.intermediate_size)}
    e, i, s = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    return {
        p + "router": (e, h),
        p + "experts.gate_up": (e, 2 * i, h),
        p + "experts.down": (e, h, i),
        p + "shared.gate_up": (2 * s, h),
        p + "shared.down": (h, s),
        p + "shared_gate": (1, h),
    }


def layer_tensor_names(config: HybridConfig, layer: int) -> dict[str, tuple[int, ...]]:
    p = f"layers.{layer}."
    names: dict[str, tuple[int, ...]] = {p + "attn_norm": (config.hidden_size,)}
    if config.layer_types[layer] == LINEAR:
        names.update(_linear_names(config, p))
    else:
        names.update(_attention_names(config, p))
    names[p + "mlp_norm"] = (config.hidden_size,)
    names.update(_mlp_names(config, p, config.mlp_types[layer]))
    return names


def tensor_names(config: HybridConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of the ``text`` component with its shape, in file order."""
    return decoder_tensor_names(config, layer_tensor_names)


# Stored as float32 whatever the checkpoint dtype: the decay exponent is sensitive to rounding
# (Qwen3.5 checkpoints ship A_log in fp32 for that reason) and both are a few floats per layer.
F32_SUFFIXES = (".A_log", ".dt_bias")


def tensor_dtype(name: str) -> str:
    return "f32" if name.endswith(F32_SUFFIXES) else "bf16"
