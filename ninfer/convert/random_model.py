"""Random-weight artifacts of every supported dense architecture, for tests and benchmarks.

Weights come from NumPy's seeded generator, one independent stream per tensor (keyed by the seed
and the tensor name), so a tensor's values do not depend on the order tensors are written in.
Scales keep activations near unit size whatever the width: embeddings ~N(0, 1), projections
~N(0, 1/fan_in), norm weights ~1, so greedy decoding produces varied tokens rather than NaNs or a
constant.
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
from ninfer.models import DenseConfig, tensor_names
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


def resolve_config(spec: str | os.PathLike[str] | DenseConfig) -> tuple[DenseConfig, str | None]:
    """A DenseConfig from itself, a preset name, or a DenseConfig JSON file; plus the preset name."""
    if isinstance(spec, DenseConfig):
        return spec, None
    if str(spec) in PRESETS:
        return PRESETS[str(spec)], str(spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--random: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        data = json.loads(path.read_text())
        return DenseConfig.from_json(data), None
    except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"--random: {path} is not a DenseConfig JSON: {exc}") from None


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


def random_sources(config: DenseConfig, seed: int) -> list[TensorSource]:
    def source(name: str, shape: tuple[int, ...]) -> TensorSource:
        return TensorSource(name, "text", "bf16", shape, lambda: from_float32(random_weight(name, shape, seed)))
    return [source(n, s) for n, s in tensor_names(config).items()]


def synthetic_text_assets() -> tuple[str, str]:
    """(tokenizer JSON, chat template): the project's synthetic Qwen-style test assets."""
    return synthetic.build_test_tokenizer_json(), synthetic.QWEN3_TEMPLATE


def random_header_fields(config: DenseConfig, seed: int, preset: str | None) -> dict[str, Any]:
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


def make_random_artifact(path: str | os.PathLike[str], config: DenseConfig | str, seed: int = 0,
                         progress=None) -> dict[str, Any]:
    """Write a random-weight artifact for ``config`` (a DenseConfig or a preset name); returns its header."""
    resolved, preset = resolve_config(config)
    fields = random_header_fields(resolved, seed, preset)
    return write_artifact(path, fields, random_sources(resolved, seed), progress=progress)


__all__ = ["PRESETS", "make_random_artifact", "random_weight", "resolve_config"]
