"""Hugging Face ``config.json`` → ``DenseConfig`` for the dense architectures NInfer runs.

Anything the forward pass would need but NInfer does not implement (another activation, MLP
biases, sliding windows, dynamic/longrope scaling) is refused by name instead of being dropped.
"""

from __future__ import annotations

from typing import Any

from ninfer.convert.errors import ConversionError
from ninfer.models import ARCHITECTURES, DenseConfig, RopeScaling


def require(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ConversionError(f"config.json: missing {key!r}")
    return cfg[key]


def _rope_parameters(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None); newer configs nest both under ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return float(theta), None if kind == "default" else params
    return float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")


def rope_scaling_from_hf(scaling: dict[str, Any] | None) -> RopeScaling:
    if not scaling:
        return RopeScaling()
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    original = scaling.get("original_max_position_embeddings")
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=factor, original_max_position=original,
                           low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                           high_freq_factor=float(scaling.get("high_freq_factor", 4.0)))
    if kind == "yarn":
        attention = scaling.get("attention_factor")
        return RopeScaling(kind="yarn", factor=factor, original_max_position=original,
                           beta_fast=float(scaling.get("beta_fast", 32.0)),
                           beta_slow=float(scaling.get("beta_slow", 1.0)),
                           attention_factor=None if attention is None else float(attention))
    raise ConversionError(f"config.json: rope scaling type {kind!r} is not supported "
                          f"(supported: linear, llama3, yarn)")


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ConversionError("config.json: mlp_bias=true is not supported")
    if cfg.get("use_sliding_window"):
        raise ConversionError("config.json: use_sliding_window=true is not supported")
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise ConversionError("config.json: pretraining_tp != 1 is not supported")


def architecture_of(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConversionError(f"config.json: unsupported architecture {archs!r} "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    return archs[0]


def dense_config_from_hf(cfg: dict[str, Any]) -> DenseConfig:
    architecture = architecture_of(cfg)
    _refuse_unsupported(cfg)
    hidden = int(require(cfg, "hidden_size"))
    heads = int(require(cfg, "num_attention_heads"))
    head_dim = cfg.get("head_dim") or hidden // heads
    theta, scaling = _rope_parameters(cfg)
    return DenseConfig(
        architecture=architecture,
        vocab_size=int(require(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(require(cfg, "intermediate_size")),
        num_layers=int(require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling_from_hf(scaling),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        attention_bias=bool(cfg.get("attention_bias", False)),
    )
