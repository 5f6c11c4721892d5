"""Convert a llama-architecture GGUF file into a `.ninfer` artifact.

Every tensor is dequantized to float32 (ninfer.convert.gguf_reader) and narrowed to bf16; q/k/v
and gate/up are fused into the canonical ``qkv`` and ``gate_up`` (ninfer.models.dense). llama.cpp's
converter reorders the rows of ``attn_q``/``attn_k`` inside each head for its interleaved RoPE; we
put them back in Hugging Face order, which our "rotate half" RoPE expects. The tokenizer is rebuilt
by ninfer.convert.gguf_tokenizer. Tensors load lazily, one at a time, while the artifact streams.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.artifact import TensorSource, write_artifact
from ninfer.artifact.bf16 import from_float32
from ninfer.convert.fields import Fields
from ninfer.convert.gguf_reader import DEQUANTIZERS, GGUFError, GGUFFile, unsupported
from ninfer.convert.gguf_tokenizer import build_tokenizer
from ninfer.convert.special_tokens import special_tokens_record
from ninfer.models import DenseConfig, RopeScaling, tensor_names

ARCH = "llama"


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, GGUF row 2i is HF row i and GGUF row
    2i+1 is HF row i + head_dim/2 (interleaved pairs back to two halves)."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"cannot unpermute {rows} rows into {n_heads} heads of even size")
    return (weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _f32(value: float) -> float:
    """A GGUF float32 as the shortest decimal that round-trips (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(llama: Fields) -> RopeScaling:
    kind = llama.string("rope.scaling.type", "none")
    factor = llama.positive("rope.scaling.factor", 1.0)
    original = llama.integer("rope.scaling.original_context_length", None)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "yarn":
        # llama.cpp multiplies its attn_factor into the derived 0.1 * ln(factor) + 1, while a Hugging
        # Face attention_factor replaces it; only the neutral 1.0 means the same in both.
        attn = llama.positive("rope.scaling.attn_factor", 1.0)
        if attn != 1.0:
            raise llama.fail("rope.scaling.attn_factor", f"{attn} is not supported (only 1.0)")
        return RopeScaling(kind="yarn", factor=factor, original_max_position=original,
                           beta_fast=llama.positive("rope.scaling.yarn_beta_fast", 32.0),
                           beta_slow=llama.positive("rope.scaling.yarn_beta_slow", 1.0))
    raise llama.fail("rope.scaling.type", f"{kind!r} is not supported (none, linear, yarn)")


def _namespace(gguf: GGUFFile, name: str) -> Fields:
    """The ``name.*`` metadata keys as one object: GGUF nests by key prefix, not by value."""
    start = len(name) + 1
    keys = {key[start:]: value for key, value in gguf.metadata.items() if key.startswith(f"{name}.")}
    return Fields(keys, gguf.path, f"{name}.", GGUFError)


def _vocab_size(gguf: GGUFFile, llama: Fields) -> int:
    """``vocab_size``, else the token count, else the embedding's rows."""
    tokens = Fields(gguf.metadata, gguf.path, error=GGUFError).strings("tokenizer.ggml.tokens", [])
    return llama.integer("vocab_size", None) or len(tokens) or gguf.tensor("token_embd.weight").shape[0]


def gguf_config(gguf: GGUFFile) -> DenseConfig:
    """The DenseConfig a llama-architecture GGUF describes (llama.* metadata keys)."""
    md = gguf.metadata
    arch = md.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{gguf.path}: general.architecture {arch!r} is not supported (only {ARCH!r})")
    if "rope_freqs.weight" in gguf.tensors:
        # Llama 3.1-style scaling is stored as precomputed per-frequency factors, not as parameters.
        raise GGUFError(f"{gguf.path}: rope_freqs.weight (precomputed RoPE frequency factors) is not supported")
    llama = _namespace(gguf, ARCH)
    hidden = llama.integer("embedding_length")
    heads = llama.integer("attention.head_count")
    head_dim = llama.integer("attention.key_length", None)
    if head_dim is None:
        if heads > hidden:
            raise llama.fail("attention.head_count", f"({heads}) exceeds embedding_length ({hidden})")
        head_dim = hidden // heads
    rot = llama.integer("rope.dimension_count", head_dim)
    if rot != head_dim:
        raise GGUFError(f"{gguf.path}: partial rotary embedding ({rot} of {head_dim} dims) is not supported")
    fields = dict(
        architecture="LlamaForCausalLM",
        vocab_size=_vocab_size(gguf, llama),
        hidden_size=hidden,
        intermediate_size=llama.integer("feed_forward_length"),
        num_layers=llama.integer("block_count"),
        num_heads=heads,
        num_kv_heads=llama.integer("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(llama.positive("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(llama.positive("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(llama),
        max_position_embeddings=llama.integer("context_length", 8192),
        tie_word_embeddings="output.weight" not in gguf.tensors,
    )
    try:
        return DenseConfig(**fields)
    except ValueError as exc:  # the model's own checks (num_heads a multiple of num_kv_heads, ...)
        raise GGUFError(f"{gguf.path}: {exc}") from exc


def _sources_of(config: DenseConfig) -> dict[str, list[str]]:
    """Canonical name → the GGUF tensors it is built from (concatenated by rows, in this order)."""
    src = {"embed": ["token_embd.weight"], "final_norm": ["output_norm.weight"]}
    if not config.tie_word_embeddings:
        src["lm_head"] = ["output.weight"]
    for i in range(config.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        src[p + "attn_norm"] = [b + "attn_norm.weight"]
        src[p + "qkv"] = [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]
        src[p + "o"] = [b + "attn_output.weight"]
        src[p + "mlp_norm"] = [b + "ffn_norm.weight"]
        src[p + "gate_up"] = [b + "ffn_gate.weight", b + "ffn_up.weight"]
        src[p + "down"] = [b + "ffn_down.weight"]
    return src


def _loader(gguf: GGUFFile, config: DenseConfig, parts: list[str]) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        arrays = []
        for part in parts:
            w = gguf.dequantize(part)
            if part.endswith("attn_q.weight"):
                w = unpermute_rope_rows(w, config.num_heads)
            elif part.endswith("attn_k.weight"):
                w = unpermute_rope_rows(w, config.num_kv_heads)
            arrays.append(w)
        return from_float32(arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0))
    return load


def gguf_sources(gguf: GGUFFile, config: DenseConfig) -> list[TensorSource]:
    """Lazy sources for every canonical tensor; checks names, shapes and types before any work."""
    mapping = _sources_of(config)
    used = {part for parts in mapping.values() for part in parts}
    extra = sorted(set(gguf.tensors) - used)
    if extra:
        raise GGUFError(f"{gguf.path}: tensors with no place in a {ARCH} model: {', '.join(extra[:5])}")
    sources = []
    for name, shape in tensor_names(config).items():
        parts = [gguf.tensor(p) for p in mapping[name]]
        for info in parts:
            if info.type_name not in DEQUANTIZERS:
                raise unsupported(info)
        rows = sum(info.shape[0] for info in parts)
        got = (rows, *parts[0].shape[1:])
        if got != shape or any(info.shape[1:] != parts[0].shape[1:] for info in parts):
            raise GGUFError(f"{gguf.path}: {', '.join(mapping[name])} give {name!r} the shape {list(got)}, "
                            f"the config needs {list(shape)}")
        sources.append(TensorSource(name, "text", "bf16", shape, _loader(gguf, config, mapping[name])))
    return sources


_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d[A-Z0-9_]*|B?F(?:16|32))$", re.IGNORECASE)


def default_name(path: Path) -> str:
    """The model name from the file name without its quantization suffix
    (SmolLM2-135M-Instruct.Q4_1.gguf → SmolLM2-135M-Instruct)."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def header_fields(gguf: GGUFFile, config: DenseConfig, name: str) -> dict[str, Any]:
    tok = build_tokenizer(gguf.metadata, gguf.path)
    record = special_tokens_record(tok.json, bos=tok.bos_token_id, eos=tok.eos_token_ids, pad=tok.pad_token_id)
    md = gguf.metadata
    return {
        "metadata": {"name": name, "architecture": config.architecture,
                     "source": {"kind": "gguf", "file": os.path.basename(gguf.path),
                                "gguf_version": gguf.version, "general.name": md.get("general.name"),
                                "file_type": md.get("general.file_type")}},
        "config": config.to_json(),
        "tokenizer": {"json": tok.json, "add_bos_token": tok.add_bos_token, "add_eos_token": tok.add_eos_token},
        "chat_template": tok.chat_template,
        "special_tokens": record,
        "generation": {"defaults": {}, "presets": {}},
        "components": ["text"],
    }


def convert_gguf(src: str | os.PathLike[str], out: str | os.PathLike[str], *, name: str | None = None,
                 progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Convert ``src`` (a llama-architecture GGUF) into the artifact ``out``; returns its header."""
    with GGUFFile(src) as gguf:
        config = gguf_config(gguf)
        sources = gguf_sources(gguf, config)
        fields = header_fields(gguf, config, name or default_name(Path(src)))
        return write_artifact(out, fields, sources, progress=progress)
