"""Random-weight artifacts of every supported dense architecture and of tiny hybrids (Gated
DeltaNet + gated attention), for tests and benchmarks.

Weights come from NumPy's seeded generator, one independent stream per tensor (keyed by the seed
and the tensor name), so a tensor's values do not depend on the order tensors are written in.
Scales keep activations near unit size whatever the width: embeddings ~N(0, 1), projections
~N(0, 1/fan_in), norm weights ~1, so greedy decoding produces varied tokens rather than NaNs or a
constant. Hybrids store their RMSNorm weights zero-centred (the runner multiplies by ``1 + w``), so
theirs are ~0; the DeltaNet decay parameters follow the Hugging Face initialisation.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.artifact import TensorSource, write_artifact
from ninfer.artifact.bf16 import from_float32
from ninfer.convert.special_tokens import special_tokens_record
from ninfer.models import DenseConfig, HybridConfig, tensor_names
from ninfer.models import hybrid
from ninfer.text import synthetic

PRESETS: dict[str, DenseConfig] = {
    "tiny-llama": DenseConfig(
        architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False),
    "tiny-qwen3": DenseConfig(
        architecture="Qwen3ForCausalLM", vocab_size=1024, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=True, qk_norm=True),
}
# Benchmark shapes, too large for the tests that run every tiny preset: the Qwen3-8B shape (16.4 GB
# of bf16) is served from random weights made on the GPU (`ninfer serve --random-weights qwen3-8b`).
LARGE_PRESETS: dict[str, DenseConfig] = {
    "qwen3-8b": DenseConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=40960, qk_norm=True),
}

_L, _F = hybrid.LINEAR, hybrid.FULL
# Three DeltaNet layers per full-attention layer, as the real models interleave them.
HYBRID_PRESETS: dict[str, HybridConfig] = {
    "tiny-qwen3-next": HybridConfig(
        architecture="Qwen3NextForCausalLM", vocab_size=1024, hidden_size=64, num_layers=4,
        layer_types=(_L, _L, _L, _F), mlp_types=(hybrid.MOE, hybrid.DENSE, hybrid.MOE, hybrid.MOE),
        rms_norm_eps=1e-6, num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=8, rope_theta=1000000.0,
        max_position_embeddings=4096, linear_num_k_heads=2, linear_num_v_heads=4, linear_k_head_dim=16,
        linear_v_head_dim=16, intermediate_size=96, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "tiny-qwen3.5": HybridConfig(
        architecture="Qwen3_5ForCausalLM", vocab_size=1024, hidden_size=64, num_layers=4,
        layer_types=(_L, _L, _L, _F), mlp_types=(hybrid.DENSE,) * 4, rms_norm_eps=1e-6, num_heads=4,
        num_kv_heads=2, head_dim=32, rotary_dim=8, rope_theta=10000000.0, max_position_embeddings=4096,
        linear_num_k_heads=2, linear_num_v_heads=4, linear_k_head_dim=16, linear_v_head_dim=16,
        intermediate_size=128, tie_word_embeddings=True),
    # Every layer MoE, as Qwen3.6-35B-A3B; more experts and picks than tiny-qwen3-next, untied.
    "tiny-qwen3.5-moe": HybridConfig(
        architecture="Qwen3_5MoeForCausalLM", vocab_size=1024, hidden_size=64, num_layers=4,
        layer_types=(_L, _L, _L, _F), mlp_types=(hybrid.MOE,) * 4, rms_norm_eps=1e-6, num_heads=4,
        num_kv_heads=2, head_dim=32, rotary_dim=8, rope_theta=10000000.0, max_position_embeddings=4096,
        linear_num_k_heads=2, linear_num_v_heads=4, linear_k_head_dim=16, linear_v_head_dim=16,
        num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=48),
}

AnyConfig = DenseConfig | HybridConfig


def resolve_config(spec: str | os.PathLike[str] | AnyConfig) -> tuple[AnyConfig, str | None]:
    """A config from itself, a preset name, or a Dense/HybridConfig JSON file (told apart by its
    ``architecture``); plus the preset name."""
    if isinstance(spec, (DenseConfig, HybridConfig)):
        return spec, None
    if str(spec) in PRESETS:
        return PRESETS[str(spec)], str(spec)
    if str(spec) in LARGE_PRESETS:
        return LARGE_PRESETS[str(spec)], str(spec)
    if str(spec) in HYBRID_PRESETS:
        return HYBRID_PRESETS[str(spec)], str(spec)
    path = Path(spec)
    if not path.is_file():
        names = ", ".join([*PRESETS, *LARGE_PRESETS, *HYBRID_PRESETS])
        raise ValueError(f"--random: {spec!r} is neither a preset ({names}) nor a file")
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("architecture") in hybrid.ARCHITECTURES:
            return HybridConfig.from_json(data), None
        return DenseConfig.from_json(data), None
    except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"--random: {path} is not a DenseConfig or HybridConfig JSON: {exc}") from None


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_weight(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values for one canonical tensor, scaled by its role."""
    rng = _rng(seed, name)
    role = name.rsplit(".", 1)[-1]
    if role.endswith("norm"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if role == "qkv_bias":
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if role == "embed":
        return rng.standard_normal(shape, dtype=np.float32)
    fan_in = shape[-1]
    return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)


# Hybrid RMSNorms the runner applies as ``1 + w`` (the DeltaNet output norm ``linear_norm`` is plain).
_ZERO_CENTRED = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")


def random_hybrid_weight(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 values for one hybrid tensor: the shared roles, plus the hybrid-only ones."""
    role = name.rsplit(".", 1)[-1]
    rng = _rng(seed, name)
    if role in _ZERO_CENTRED:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if role == "A_log":  # decay rate A ~ U(1, 16), as transformers initialises it
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if role == "dt_bias":
        return np.ones(shape, np.float32)
    return random_weight(name, shape, seed)


def random_sources(config: AnyConfig, seed: int) -> list[TensorSource]:
    if isinstance(config, HybridConfig):
        names, values = hybrid.tensor_names(config), random_hybrid_weight
    else:
        names, values = tensor_names(config), random_weight

    def source(name: str, shape: tuple[int, ...]) -> TensorSource:
        if isinstance(config, HybridConfig) and hybrid.tensor_dtype(name) == "f32":
            return TensorSource(name, "text", "f32", shape, lambda: values(name, shape, seed))
        return TensorSource(name, "text", "bf16", shape, lambda: from_float32(values(name, shape, seed)))
    return [source(n, s) for n, s in names.items()]


def synthetic_text_assets() -> tuple[str, str]:
    """(tokenizer JSON, chat template): the project's synthetic Qwen-style test assets."""
    return synthetic.build_test_tokenizer_json(), synthetic.QWEN3_TEMPLATE


def random_header_fields(config: AnyConfig, seed: int, preset: str | None) -> dict[str, Any]:
    tokenizer_json, template = synthetic_text_assets()
    record = special_tokens_record(tokenizer_json, bos=None, eos=None, pad=None)
    vocab = json.loads(tokenizer_json)
    size = max([*vocab["model"]["vocab"].values(), *record["tokens"].values()]) + 1
    if size > config.vocab_size:
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the test tokenizer's {size} ids")
    eos = [record["tokens"][s] for s in ("<|im_end|>", "<|endoftext|>") if s in record["tokens"]]
    record["eos_token_ids"] = eos
    record["pad_token_id"] = record["tokens"].get("<|endoftext|>")
    return {
        "metadata": {"name": f"random-{preset or config.architecture}", "architecture": config.architecture,
                     "source": {"kind": "random", "seed": seed, "preset": preset}},
        "config": config.to_json(),
        "tokenizer": {"json": tokenizer_json},
        "chat_template": template,
        "special_tokens": record,
        "generation": {"defaults": {}, "presets": {}},
        "components": ["text"],
    }


def make_random_artifact(path: str | os.PathLike[str], config: AnyConfig | str, seed: int = 0,
                         progress=None) -> dict[str, Any]:
    """Write a random-weight artifact for ``config`` (a Dense/HybridConfig or a preset name); returns its header."""
    resolved, preset = resolve_config(config)
    fields = random_header_fields(resolved, seed, preset)
    return write_artifact(path, fields, random_sources(resolved, seed), progress=progress)


__all__ = ["HYBRID_PRESETS", "LARGE_PRESETS", "PRESETS", "make_random_artifact", "random_weight", "resolve_config"]
