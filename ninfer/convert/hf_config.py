"""Hugging Face ``config.json`` → ``DenseConfig`` for the dense architectures NInfer runs.

Anything the forward pass would need but NInfer does not implement (another activation, MLP
biases, sliding windows, dynamic/longrope scaling) is refused by name instead of being dropped.
"""

from __future__ import annotations

from typing import Any

from ninfer.convert.errors import ConversionError
from ninfer.convert.fields import Fields
from ninfer.models import ARCHITECTURES, HYBRID_ARCHITECTURES, DenseConfig, RopeScaling


def config_fields(cfg: Any) -> Fields:
    """The typed view of a config.json object (a JSON array or string there is refused)."""
    return Fields(cfg, "config.json")


def _rope_parameters(cfg: Fields) -> tuple[float, Fields | None]:
    """(theta, scaling or None); newer configs nest both under ``rope_parameters``."""
    params = cfg.section("rope_parameters")
    if params.data:
        theta = params.positive("rope_theta", cfg.positive("rope_theta", 10000.0))
        kind = params.string("rope_type", params.string("type", "default"))
        return theta, None if kind == "default" else params
    return cfg.positive("rope_theta", 10000.0), cfg.section("rope_scaling")


def rope_scaling_from_hf(scaling: Fields | None) -> RopeScaling:
    if scaling is None or not scaling.data:
        return RopeScaling()
    kind = scaling.string("rope_type", scaling.string("type", None))
    factor = scaling.positive("factor", 1.0)
    original = scaling.integer("original_max_position_embeddings", None)
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=factor, original_max_position=original,
                           low_freq_factor=scaling.positive("low_freq_factor", 1.0),
                           high_freq_factor=scaling.positive("high_freq_factor", 4.0))
    if kind == "yarn":
        return RopeScaling(kind="yarn", factor=factor, original_max_position=original,
                           beta_fast=scaling.positive("beta_fast", 32.0),
                           beta_slow=scaling.positive("beta_slow", 1.0),
                           attention_factor=scaling.positive("attention_factor", None))
    raise ConversionError(f"config.json: rope scaling type {kind!r} is not supported "
                          f"(supported: linear, llama3, yarn)")


def _refuse_unsupported(cfg: Fields) -> None:
    act = cfg.string("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.boolean("mlp_bias", False):
        raise ConversionError("config.json: mlp_bias=true is not supported")
    if cfg.boolean("use_sliding_window", False):
        raise ConversionError("config.json: use_sliding_window=true is not supported")
    if cfg.integer("pretraining_tp", 1) != 1:
        raise ConversionError("config.json: pretraining_tp != 1 is not supported")


def single_architecture(cfg: dict[str, Any]) -> str | None:
    """The one class name ``architectures`` lists, or None when it lists none or several."""
    archs = cfg.get("architectures")
    return archs[0] if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) else None


def architecture_of(cfg: dict[str, Any]) -> str:
    architecture = single_architecture(cfg)
    if architecture not in ARCHITECTURES:
        raise ConversionError(f"config.json: unsupported architecture {cfg.get('architectures')!r} "
                              f"(supported: {', '.join(ARCHITECTURES + HYBRID_ARCHITECTURES)})")
    return architecture


def head_dim_of(cfg: Fields, hidden: int, heads: int) -> int:
    """``head_dim``, else hidden_size // num_attention_heads as transformers derives it."""
    given = cfg.integer("head_dim", None)
    if given is not None:
        return given
    if hidden < heads:
        raise cfg.fail("num_attention_heads", f"({heads}) exceeds hidden_size ({hidden}) and no head_dim is given")
    return hidden // heads


def dense_config_from_hf(cfg: dict[str, Any]) -> DenseConfig:
    fields = config_fields(cfg)
    architecture = architecture_of(cfg)
    _refuse_unsupported(fields)
    hidden = fields.integer("hidden_size")
    heads = fields.integer("num_attention_heads")
    theta, scaling = _rope_parameters(fields)
    try:
        return DenseConfig(
            architecture=architecture,
            vocab_size=fields.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.integer("intermediate_size"),
            num_layers=fields.integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=fields.integer("num_key_value_heads", heads),
            head_dim=head_dim_of(fields, hidden, heads),
            rms_norm_eps=fields.positive("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope_scaling_from_hf(scaling),
            max_position_embeddings=fields.integer("max_position_embeddings", 8192),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
            qk_norm=architecture == "Qwen3ForCausalLM",
            attention_bias=fields.boolean("attention_bias", False),
        )
    except ValueError as exc:  # the model's own checks (num_heads a multiple of num_kv_heads, ...)
        raise ConversionError(f"config.json: {exc}") from exc
