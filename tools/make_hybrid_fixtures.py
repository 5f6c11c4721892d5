"""Make the hybrid parity fixtures: tiny random Qwen3-Next / Qwen3.5 / Qwen3.5-MoE checkpoints and
transformers' outputs on them.

Run it in a scratch venv with torch and transformers (not product dependencies; transformers 5.24
has ``qwen3_next``, ``qwen3_5`` and ``qwen3_5_moe``):

    python3 -m venv .scratch/hybridvenv
    .scratch/hybridvenv/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl transformers==5.24.0 safetensors numpy
    .scratch/hybridvenv/bin/python tools/make_hybrid_fixtures.py [--out tests/fixtures/hybrid]

For each model below it writes ``<out>/<name>/``:
- ``config.json`` and ``model.safetensors`` (bf16) as ``save_pretrained`` writes them, except:
  ``qwen3_5_moe`` stores its experts fused (``experts.gate_up_proj`` [E, 2I, H],
  ``experts.down_proj`` [E, H, I], the other on-disk form), and ``qwen3_5`` gets two small
  ``mtp.*`` tensors (transformers ignores ``mtp.*`` on load) so the converter's ``mtp`` component
  is exercised, and a one-block vision tower (the ``vision`` component);
- ``tokenizer.json``: the word-level tokenizer of the dense parity fixtures;
- ``golden.npz``: for prompt ``i``: ``prompt_i`` int32 [n], ``prompt_logits_i`` float32
  [n, vocab] (every position, one forward without a cache: transformers' chunked DeltaNet path,
  chunk 64, and the longest prompt crosses a chunk boundary), ``greedy_i`` int32 [GREEDY_TOKENS]
  and ``greedy_logits_i`` (the logits each greedy token was chosen from, recomputing the whole
  sequence at every step).

Weights are rounded to bf16 before the oracle runs, so transformers (float32 math) and NInfer see
the same numbers. A seed whose greedy choice is ever nearly tied is skipped for the next one.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

# The sibling tool (this script's folder is on sys.path): oracle loop, seeds, tokenizer.
from make_parity_fixtures import first_seed_without_tie, golden, write_tokenizer

GREEDY_TOKENS = 16
PROMPT_LENGTHS = (1, 9, 70)

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # partial rotary 0.25 -> 8 rotary dims
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

MODELS = {
    # MoE on layers 0, 2, 3 and a dense MLP on layer 1 (mlp_only_layers); per-expert tensors.
    "qwen3_next": ("Qwen3NextForCausalLM",
                   dict(TEXT, num_hidden_layers=4, intermediate_size=96, mlp_only_layers=[1], **MOE,
                        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25))),
    # Dense Qwen3.5 with attention every 2nd layer, tied embeddings, vision tower and mtp tensors.
    "qwen3_5": ("Qwen3_5ForConditionalGeneration",
                dict(TEXT, num_hidden_layers=4, intermediate_size=96, full_attention_interval=2,
                     tie_word_embeddings=True,
                     rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                          mrope_section=[1, 2, 1], mrope_interleaved=True))),
    # Qwen3.5-MoE text-only class (``model.*`` names), 3 DeltaNet + 1 attention, fused experts.
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM",
                    dict(TEXT, num_hidden_layers=4, **MOE,
                         rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                              mrope_section=[1, 2, 1], mrope_interleaved=True))),
}


def build_model(architecture: str, fields: dict) -> torch.nn.Module:
    fields = dict(fields)
    if architecture == "Qwen3NextForCausalLM":
        config = transformers.Qwen3NextConfig(**fields)
    elif architecture == "Qwen3_5MoeForCausalLM":
        config = transformers.Qwen3_5MoeTextConfig(**fields)
    else:
        tie = fields.pop("tie_word_embeddings", False)
        cls = transformers.Qwen3_5Config if architecture == "Qwen3_5ForConditionalGeneration" \
            else transformers.Qwen3_5MoeConfig
        config = cls(text_config=fields, vision_config=VISION, tie_word_embeddings=tie)
    config.architectures = [architecture]
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Zero-centred norms start at 0 and the gated norm at 1: perturb both so a backend
            # that used the wrong form (w vs 1 + w) or ignored a norm would fail parity.
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("dt_bias"):
                param.add_(0.5 * torch.randn_like(param))
            elif name.endswith("A_log"):
                # Decays between exp(-0.01) and exp(-1) per token: long memories and short ones.
                param.copy_(torch.empty_like(param).uniform_(0.01, 1.0).log())
        # Round every weight to bf16 so the oracle computes on what the checkpoint stores.
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    return model.eval()


def fuse_experts(path: Path) -> None:
    """Rewrite per-expert MoE tensors into the fused on-disk layout (gate rows, then up rows)."""
    tensors = load_file(path)
    out, experts = {}, {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            index, proj = rest.split(".")[:2]
            experts.setdefault(prefix, {}).setdefault(int(index), {})[proj] = t
        else:
            out[name] = t
    for prefix, per in experts.items():
        order = sorted(per)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in order]).contiguous()
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in order]).contiguous()
    save_file(out, path, metadata={"format": "pt"})


def add_mtp(path: Path, hidden: int) -> None:
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(7)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen).to(torch.bfloat16)
    tensors["mtp.norm.weight"] = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})


def write_fixture(name: str, architecture: str, fields: dict, out_dir: Path, seed: int) -> None:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = build_model(architecture, fields)
    arrays = golden(model, TEXT["vocab_size"], rng, PROMPT_LENGTHS, GREEDY_TOKENS)
    target = out_dir / name
    if target.exists():
        shutil.rmtree(target)
    model.to(torch.bfloat16).save_pretrained(target)
    weights = target / "model.safetensors"
    if name == "qwen3_5_moe":
        fuse_experts(weights)
    if name == "qwen3_5":
        add_mtp(weights, TEXT["hidden_size"])
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer(target / "tokenizer.json", TEXT["vocab_size"])
    np.savez_compressed(target / "golden.npz", **arrays)
    print(f"{name}: seed {seed}, {sum(f.stat().st_size for f in target.iterdir())} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent.parent / "tests/fixtures/hybrid")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    for name, (architecture, fields) in MODELS.items():
        if args.only and name not in args.only:
            continue
        first_seed_without_tie(name, functools.partial(write_fixture, name, architecture, fields, args.out))


if __name__ == "__main__":
    main()
