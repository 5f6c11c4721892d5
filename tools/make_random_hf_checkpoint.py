"""Write a random-weight Hugging Face Llama/Qwen3 checkpoint directory (for converter benchmarks).

    python tools/make_random_hf_checkpoint.py OUT_DIR [--arch llama|qwen3] [--hidden 1024]
        [--layers 12] [--vocab 32000] [--dtype BF16|F16|F32] [--shards 2]

It writes config.json, sharded *.safetensors with model.safetensors.index.json, and the synthetic
test tokenizer and chat template, i.e. everything `ninfer convert` reads. No torch needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.artifact.bf16 import from_float32  # noqa: E402
from ninfer.convert.random_model import synthetic_text_assets  # noqa: E402
from ninfer.convert.safetensors import write_safetensors  # noqa: E402


def hf_config(arch: str, hidden: int, layers: int, vocab: int) -> dict:
    heads = hidden // 64
    cfg = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": hidden * 11 // 4,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
           "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "hidden_act": "silu", "bos_token_id": 0}
    if arch == "qwen3":
        return {**cfg, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64,
                "rope_theta": 1000000.0, "tie_word_embeddings": True, "eos_token_id": 2}
    return {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
            "tie_word_embeddings": False, "eos_token_id": 2}


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim", 64)
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
        if cfg["architectures"] == ["Qwen3ForCausalLM"]:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=("llama", "qwen3"), default="llama")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=("BF16", "F16", "F32"), default="BF16")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = hf_config(args.arch, args.hidden, args.layers, args.vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1))
    tok_json, template = synthetic_text_assets()
    (args.out / "tokenizer.json").write_text(tok_json)
    (args.out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    rng = np.random.default_rng(args.seed)
    shapes = weight_shapes(cfg)
    names = list(shapes)
    weight_map, total = {}, 0
    for s in range(args.shards):
        fname = f"model-{s + 1:05d}-of-{args.shards:05d}.safetensors"
        part = {}
        for name in names[s::args.shards]:
            values = (rng.standard_normal(shapes[name], dtype=np.float32) * 0.02)
            part[name] = {"BF16": lambda v: ("BF16", from_float32(v)), "F16": lambda v: v.astype(np.float16),
                          "F32": lambda v: v}[args.dtype](values)
            weight_map[name] = fname
        write_safetensors(args.out / fname, part)
        total += (args.out / fname).stat().st_size
        del part
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    print(f"{args.out}: {len(names)} tensors, {total / 1e6:.1f} MB of {args.dtype} in {args.shards} shards")


if __name__ == "__main__":
    main()
