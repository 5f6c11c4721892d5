"""Llama and Qwen3 dense decoders: configuration, derived shapes and canonical tensor names.

No compute lives here. Backends read the canonical names; converters map source names onto them.
Weights keep the Hugging Face orientation ``[out_features, in_features]`` (``y = x @ W.T``), and the
converters fuse q/k/v into ``qkv`` and gate/up into ``gate_up`` so each layer is two GEMMs plus two.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from ninfer.models.names import decoder_tensor_names

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
ROPE_KINDS = ("none", "linear", "llama3", "yarn")


def check_numbers(owner: object, names: tuple[str, ...], *, integer: bool = True, zero: bool = False) -> None:
    """Each named attribute is a finite number (an int when ``integer``; never a bool) > 0, or >= 0
    when ``zero``. The values come from files (config.json, GGUF metadata, an artifact header): a
    zero or negative size would only fail later, far from its cause."""
    kind = int if integer else (int, float)
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, kind) or not (0 <= value if zero else 0 < value) \
                or not value < math.inf:
            wanted = ("a non-negative " if zero else "a positive ") + ("integer" if integer else "number")
            raise ValueError(f"{name} must be {wanted}, got {value!r}")


@attrs.frozen(kw_only=True)
class RopeScaling:
    """Rotary scaling as Hugging Face configs spell it; ``kind`` is none, linear, llama3 or yarn."""

    kind: str = "none"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None derives 0.1 * ln(factor) + 1

    def __attrs_post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope_scaling.kind {self.kind!r} is not supported ({', '.join(ROPE_KINDS)})")
        check_numbers(self, ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"),
                      integer=False)
        if self.original_max_position is not None:
            check_numbers(self, ("original_max_position",))
        if self.attention_factor is not None:
            check_numbers(self, ("attention_factor",), integer=False)


@attrs.frozen(kw_only=True)
class DenseConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    attention_bias: bool = False  # Llama variants with q/k/v biases (o has none)

    def __attrs_post_init__(self) -> None:
        check_numbers(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                             "num_kv_heads", "head_dim", "max_position_embeddings"))
        check_numbers(self, ("rms_norm_eps", "rope_theta"), integer=False)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even: RoPE rotates its two halves")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling, got {self.rope_scaling!r}")
        for name in ("tie_word_embeddings", "qk_norm", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every layer for one token."""
        return self.num_layers * 2 * self.kv_size * 2

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DenseConfig:
        fields = dict(data)
        fields["rope_scaling"] = RopeScaling(**fields.get("rope_scaling", {}))
        return cls(**fields)


def layer_tensor_names(config: DenseConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Canonical names and shapes of one decoder layer's tensors."""
    p = f"layers.{layer}."
    h, d = config.hidden_size, config.head_dim
    names: dict[str, tuple[int, ...]] = {
        p + "attn_norm": (h,),
        p + "qkv": (config.qkv_size, h),  # rows: q heads, then k heads, then v heads
        p + "o": (h, config.q_size),
        p + "mlp_norm": (h,),
        p + "gate_up": (2 * config.intermediate_size, h),  # rows: gate, then up
        p + "down": (h, config.intermediate_size),
    }
    if config.attention_bias:
        names[p + "qkv_bias"] = (config.qkv_size,)
    if config.qk_norm:
        names[p + "q_norm"] = (d,)
        names[p + "k_norm"] = (d,)
    return names


def tensor_names(config: DenseConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of the ``text`` component with its shape, in file order."""
    return decoder_tensor_names(config, layer_tensor_names)
