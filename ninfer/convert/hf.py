"""Convert a Hugging Face Llama / Qwen3 checkpoint directory into a `.ninfer` artifact.

Weights keep (or are narrowed to) bf16 and are renamed to the canonical names of
``ninfer.models.tensor_names``; q/k/v and gate/up are fused here, once, so the runtime does two
GEMMs where the checkpoint has five. Everything is checked against the config before the first
byte is written, and each output tensor is built only when the writer asks for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.artifact import TensorSource, write_artifact
from ninfer.convert.errors import ConversionError
from ninfer.convert.fields import Fields
from ninfer.convert.hf_checkpoint import CheckpointWeights, chat_template, read_json, tokenizer_json
from ninfer.convert.hf_config import dense_config_from_hf
from ninfer.convert.special_tokens import special_tokens_record
from ninfer.models import DenseConfig, tensor_names

# Canonical name suffix → Hugging Face source names (concatenated along rows when several).
_LAYER_SOURCES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("input_layernorm.weight",),
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "o": ("self_attn.o_proj.weight",),
    "mlp_norm": ("post_attention_layernorm.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}
_GLOBAL_SOURCES = {"embed": ("model.embed_tokens.weight",), "final_norm": ("model.norm.weight",),
                   "lm_head": ("lm_head.weight",)}

# Sampler presets the model publishers recommend (Qwen3 model cards); the engine applies them.
_PRESETS: dict[str, dict[str, dict[str, float]]] = {
    "Qwen3ForCausalLM": {
        "thinking": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},
        "non_thinking": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0},
    },
}
_GENERATION_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")


def source_names(canonical: str) -> tuple[str, ...]:
    if canonical.startswith("layers."):
        _, layer, suffix = canonical.split(".", 2)
        return tuple(f"model.layers.{layer}.{s}" for s in _LAYER_SOURCES[suffix])
    return _GLOBAL_SOURCES[canonical]


def _plan_sources(config: DenseConfig, weights: CheckpointWeights) -> list[TensorSource]:
    """One lazy TensorSource per canonical tensor, after checking every source's presence and shape."""
    plan, used = [], set()
    for canonical, shape in tensor_names(config).items():
        names = source_names(canonical)
        rows = 0
        for name in names:
            info = weights.checked(name, f"for {canonical!r} of {config.architecture}")
            if info.shape[1:] != shape[1:]:
                raise ConversionError(f"{weights.directory}: tensor {name!r} has shape {list(info.shape)}, "
                                      f"incompatible with {canonical!r} {list(shape)}")
            rows += info.shape[0]
        if rows != shape[0]:
            raise ConversionError(f"{weights.directory}: {' + '.join(names)} give {rows} rows, the config "
                                  f"needs {shape[0]} for {canonical!r}")
        used.update(names)
        plan.append(TensorSource(canonical, "text", "bf16", shape, _loader(weights, names)))
    # Dropping is exact for all-zero biases too, e.g. Llama's o_proj.bias under attention_bias.
    weights.refuse_unknown(used, config.architecture, config.tie_word_embeddings,
                           droppable=lambda name: name.endswith(".bias") and not np.any(weights.get(name)))
    return plan


def _loader(weights: CheckpointWeights, names: tuple[str, ...]) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        parts = [weights.bf16(n) for n in names]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return load


def _token_ids(fields: Fields, key: str, vocab_size: int) -> int | list[int] | None:
    """A token id field; eos_token_id may list several. Each must be a row of the embedding."""
    several = key == "eos_token_id" and isinstance(fields.data.get(key), list)
    ids = fields.integers(key) if several else fields.integer(key, None, minimum=0)
    for token in ids if several else [ids]:
        if token is not None and token >= vocab_size:
            raise fields.fail(key, f"{token} is outside the {vocab_size}-token vocabulary")
    return ids


def _special_tokens(directory: Path, cfg: dict[str, Any], gen: dict[str, Any], tok_json: str,
                    vocab_size: int) -> dict[str, Any]:
    def pick(key: str) -> Any:
        source = Fields(gen, "generation_config.json") if gen.get(key) is not None else Fields(cfg, "config.json")
        return _token_ids(source, key, vocab_size)

    record = special_tokens_record(tok_json, pick("bos_token_id"), pick("eos_token_id"), pick("pad_token_id"))
    # Chat checkpoints sometimes name their end-of-turn token only in tokenizer_config.json.
    tok_cfg = read_json(directory / "tokenizer_config.json", required=False) or {}
    eos = tok_cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and eos in record["tokens"] and record["tokens"][eos] not in record["eos_token_ids"]:
        record["eos_token_ids"].append(record["tokens"][eos])
    return record


def _generation_defaults(gen: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json's sampler fields, type-checked: the engine computes with them."""
    fields = Fields(gen, "generation_config.json")
    for key in _GENERATION_KEYS:
        if key == "do_sample":
            fields.boolean(key, None)
        elif key == "top_k":
            fields.integer(key, None, minimum=0)
        else:
            fields.number(key, None)
    return {k: gen[k] for k in _GENERATION_KEYS if k in gen}


def _check_tokenizer(directory: Path, tok_json: str, special: dict[str, Any]) -> None:
    """Load the tokenizer as `generate` and `serve` will: one they would refuse stops the
    conversion here, naming the file, instead of every later start."""
    from ninfer.text import Tokenizer, TokenizerError

    try:
        Tokenizer.from_json(tok_json, special)
    except TokenizerError as exc:
        raise ConversionError(f"{directory / 'tokenizer.json'}: {exc}") from None


def header_fields(directory: Path, cfg: dict[str, Any], config: DenseConfig,
                  weights: CheckpointWeights) -> dict[str, Any]:
    gen = read_json(directory / "generation_config.json", required=False) or {}
    tok_json = tokenizer_json(directory)
    special = _special_tokens(directory, cfg, gen, tok_json, config.vocab_size)
    _check_tokenizer(directory, tok_json, special)
    return {
        "metadata": {"name": directory.resolve().name, "architecture": config.architecture,
                     "source": {"kind": "huggingface", "path": str(directory.resolve()),
                                "shards": weights.shard_names, "torch_dtype": cfg.get("torch_dtype")}},
        "config": config.to_json(),
        "tokenizer": {"json": tok_json},
        "chat_template": chat_template(directory),
        "special_tokens": special,
        "generation": {"defaults": _generation_defaults(gen),
                       "presets": _PRESETS.get(config.architecture, {})},
        "components": ["text"],
    }


def convert_hf(src: str | os.PathLike[str], out: str | os.PathLike[str], progress=None) -> dict[str, Any]:
    """Convert the checkpoint directory ``src`` into ``out``; returns the written header."""
    directory = Path(src)
    cfg = read_json(directory / "config.json")
    from ninfer.convert import hf_hybrid

    if hf_hybrid.architecture_of(cfg) is not None:  # Qwen3-Next / Qwen3.5 hybrids
        return hf_hybrid.convert_hf_hybrid(directory, cfg, out, progress=progress)
    config = dense_config_from_hf(cfg)
    weights = CheckpointWeights(directory)
    fields = header_fields(directory, cfg, config, weights)
    sources = _plan_sources(config, weights)
    return write_artifact(out, fields, sources, progress=progress)
