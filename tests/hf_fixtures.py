"""Tiny Hugging Face checkpoint directories written with our safetensors writer, for converter tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ninfer.artifact.bf16 import from_float32
from ninfer.convert.random_model import synthetic_text_assets
from ninfer.convert.safetensors import write_safetensors

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": True, "bos_token_id": 1, "eos_token_id": 2,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 1024},
}
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
    "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
}


def hf_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights under Hugging Face names for ``cfg``."""
    rng = np.random.default_rng(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    out = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "model.norm.weight": w(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": w(h), p + "post_attention_layernorm.weight": w(h),
                    p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                    p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                    p + "mlp.down_proj.weight": w(h, inter)})
        if cfg.get("attention_bias"):
            out.update({p + "self_attn.q_proj.bias": w(q), p + "self_attn.k_proj.bias": w(kv),
                        p + "self_attn.v_proj.bias": w(kv)})
        if cfg["architectures"] == ["Qwen3ForCausalLM"]:
            out.update({p + "self_attn.q_norm.weight": w(d), p + "self_attn.k_norm.weight": w(d)})
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = w(cfg["vocab_size"], h)
    return out


def _encode(array: np.ndarray, dtype: str):
    if dtype == "BF16":
        return ("BF16", from_float32(array))
    return array.astype(np.float16 if dtype == "F16" else np.float32)


def write_checkpoint(directory: Path, cfg: dict, weights: dict[str, np.ndarray], *, dtype: str = "BF16",
                     shards: int = 1, template_in: str = "tokenizer_config", generation: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    tok_json, template = synthetic_text_assets()
    (directory / "tokenizer.json").write_text(tok_json)
    tok_cfg = {"eos_token": "<|im_end|>"}
    if template_in == "tokenizer_config":
        tok_cfg["chat_template"] = template
    elif template_in == "jinja":
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    names = list(weights)
    if shards == 1:
        write_safetensors(directory / "model.safetensors", {n: _encode(weights[n], dtype) for n in names})
        return directory
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(directory / fname, {n: _encode(weights[n], dtype) for n in part})
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory
