"""Make the parity fixtures: tiny random Hugging Face checkpoints and transformers' outputs on them.

Run it in a scratch venv that has torch and transformers (they are not product dependencies):

    python3 -m venv .scratch/torchvenv
    .scratch/torchvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    .scratch/torchvenv/bin/python tools/make_parity_fixtures.py [--set reference|cuda] [--out DIR]

There are two sets of models. ``reference`` (the default; ``MODELS``, into tests/fixtures/parity)
covers the architectures' features at the smallest shapes; ``cuda`` (``CUDA_MODELS``, into
tests/fixtures/parity_cuda) takes the shapes the CUDA backend's kernels are built for (head_dim 64
and 128, ``ninfer.backends.cuda.forward.check_supported``), so that backend too is checked against
transformers. For each model of the set it writes ``<out>/<name>/``:
- ``config.json`` and ``model.safetensors`` (bf16) as ``save_pretrained`` writes them, with two
  edits: rope settings spelled the classic way (``rope_theta`` + ``rope_scaling``, as published
  checkpoints have them) and Llama's all-zero ``o_proj.bias`` removed (see ``build_model``);
- ``tokenizer.json``: a tiny word-level tokenizer (``<pad>``, ``<s>``, ``</s>``, ``t3`` ... ``t255``)
  so the checkpoint converts like a real one;
- ``golden.npz``: for prompt ``i`` (fixed random token ids) ``prompt_i`` int32 [n],
  ``prompt_logits_i`` float32 [n, vocab] (every prompt position), ``greedy_i`` int32 [32] (greedy
  continuation) and ``greedy_logits_i`` float32 [32, vocab] (the logits each greedy token was
  chosen from). transformers runs in float32 on the bf16 checkpoint, recomputing the whole
  sequence at every step (no KV cache), so the oracle is as plain as it gets.

A model whose greedy choice is ever nearly tied (top-2 margin below ``MIN_MARGIN``) would test
rounding noise rather than the model, so the tool then retries with the next seed (deterministic:
the same seeds are tried in the same order on every run); ``config.json`` records nothing of it,
but the tool prints the seed it used.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers

GREEDY_TOKENS = 32
PROMPT_LENGTHS = (1, 9, 37)
MIN_MARGIN = 1e-2
SEED = 20261202

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # large enough that logits are well separated (no near-ties)
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

MODELS = {
    # Tied embeddings and Llama 3 rope scaling (the original context is short so that low, medium
    # and high frequency bands all occur at head_dim 16).
    "llama_tied_llama3": (
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=2,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # Untied head, q/k/v biases, linear rope scaling, three layers.
    "llama_bias_linear": (
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=3,
            tie_word_embeddings=False,
            attention_bias=True,
            rope_theta=500000.0,
            rope_scaling=dict(rope_type="linear", factor=2.0),
        ),
    ),
    # Qwen3: per-head q/k RMSNorm, head_dim * heads != hidden, YaRN scaling, tied embeddings.
    "qwen3_yarn": (
        "Qwen3ForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=32,
            tie_word_embeddings=True,
            max_position_embeddings=256,  # = factor x original, as YaRN configs state it
            rope_theta=1000000.0,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    # The common case: no rope scaling, untied head; one KV head (multi-query attention).
    "qwen3_plain": (
        "Qwen3ForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
        ),
    ),
}


# The CUDA backend's set: head_dim 64 and 128, query heads per KV head in its GROUPS, hidden and
# intermediate sizes divisible by 8. Hidden 128 and two layers keep both checkpoints and their
# goldens under 2 MiB together (tests/test_parity.py checks it).
CUDA_MODELS = {
    # Classic Llama shape (heads x head_dim = hidden), GQA 2, q/k/v biases, untied head, Llama 3
    # rope scaling (the original context is short so that all three frequency bands occur).
    "llama_d64_bias_llama3": (
        "LlamaForCausalLM",
        dict(
            hidden_size=128,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            tie_word_embeddings=False,
            attention_bias=True,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # Qwen3: q/k RMSNorm, heads x head_dim (512) wider than hidden, GQA 4, tied embeddings, YaRN
    # (whose attention factor the backends fold into the cos/sin tables).
    "qwen3_d128_gqa4_yarn": (
        "Qwen3ForCausalLM",
        dict(
            hidden_size=128,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=128,
            tie_word_embeddings=True,
            max_position_embeddings=256,  # = factor x original, as YaRN configs state it
            rope_theta=1000000.0,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        ),
    ),
}
ROOT = Path(__file__).resolve().parents[1]
SETS = {"reference": (MODELS, ROOT / "tests/fixtures/parity"),
        "cuda": (CUDA_MODELS, ROOT / "tests/fixtures/parity_cuda")}


def build_model(architecture: str, fields: dict) -> torch.nn.Module:
    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen3ForCausalLM": transformers.Qwen3Config}
    config = config_cls[architecture](**{**COMMON, **fields})
    config.architectures = [architecture]
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        # HF initialises norm weights to 1 and biases to 0; perturb them so that parity checks
        # would notice a backend that ignored either.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("o_proj.bias"):
                # Llama's attention_bias also gives o_proj a bias, which our canonical tensors
                # (ninfer.models.dense: q/k/v biases only, the Qwen2-style layout) do not have.
                # Zero it here and drop it from the file after the oracle has run.
                param.zero_()
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def golden(model: torch.nn.Module, vocab: int, rng: np.random.Generator, prompt_lengths=PROMPT_LENGTHS,
           greedy_tokens: int = GREEDY_TOKENS) -> dict[str, np.ndarray]:
    """The golden.npz arrays (module docstring); raises NearTie when a greedy choice is nearly tied."""
    arrays = {}
    for i, length in enumerate(prompt_lengths):
        prompt = rng.integers(3, vocab, size=length).tolist()
        arrays[f"prompt_{i}"] = np.array(prompt, dtype=np.int32)
        arrays[f"prompt_logits_{i}"] = logits_of(model, prompt)
        ids, chosen, step_logits = list(prompt), [], []
        for _ in range(greedy_tokens):
            last = logits_of(model, ids)[-1]
            top2 = np.sort(last)[-2:]
            if top2[1] - top2[0] < MIN_MARGIN:
                raise NearTie(f"top-2 margin {top2[1] - top2[0]:.2e}")
            token = int(np.argmax(last))
            chosen.append(token)
            step_logits.append(last)
            ids.append(token)
        arrays[f"greedy_{i}"] = np.array(chosen, dtype=np.int32)
        arrays[f"greedy_logits_{i}"] = np.stack(step_logits).astype(np.float32)
    return arrays


def write_classic_rope_fields(path: Path) -> None:
    """Rewrite transformers 5's ``rope_parameters`` as ``rope_theta`` + ``rope_scaling``.

    Published Llama and Qwen3 checkpoints spell it the classic way, so that is what converters
    must read; transformers reads both, and the oracle below loads the rewritten file.
    """
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 = COMMON's pad, bos, eos
    vocab = {token: i for i, token in enumerate(specials + [f"t{i}" for i in range(len(specials), vocab_size)])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tokenizer.save(str(path))


def drop_zero_o_bias(path: Path) -> None:
    """Remove ``o_proj.bias`` tensors, which must be all zero (the function stays the same)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    biases = [name for name in tensors if name.endswith("o_proj.bias")]
    if not biases:
        return
    assert all(not tensors[name].any() for name in biases)
    save_file({k: v for k, v in tensors.items() if k not in biases}, path, metadata={"format": "pt"})


class NearTie(Exception):
    pass


def first_seed_without_tie(name: str, write: Callable[[int], None]) -> None:
    """``write(seed)`` for SEED, SEED + 1, ... until one has no near-tie (the same order every run)."""
    for seed in range(SEED, SEED + 50):
        try:
            return write(seed)
        except NearTie as tie:
            print(f"{name}: seed {seed} has a near-tie ({tie}); trying the next seed")
    raise SystemExit(f"{name}: every seed tried has a near-tie; make the logits larger")


def write_fixture(name: str, architecture: str, fields: dict, out_dir: Path, seed: int) -> None:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    target = out_dir / name
    if target.exists():
        shutil.rmtree(target)
    build_model(architecture, fields).to(torch.bfloat16).save_pretrained(target, safe_serialization=True)
    (target / "generation_config.json").unlink(missing_ok=True)
    write_classic_rope_fields(target / "config.json")
    write_tokenizer(target / "tokenizer.json", COMMON["vocab_size"])
    # The oracle is transformers itself loading the bf16 checkpoint and upcasting to float32.
    model = getattr(transformers, architecture).from_pretrained(
        target, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    np.savez_compressed(target / "golden.npz", **golden(model, COMMON["vocab_size"], rng))
    drop_zero_o_bias(target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    size = sum(f.stat().st_size for f in target.iterdir())
    print(f"{name}: {architecture}, {config.get('num_hidden_layers')} layers, seed {seed}, {size / 1024:.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="reference", help="which models (module docstring)")
    parser.add_argument("--out", type=Path, help="default: the set's folder under tests/fixtures")
    args = parser.parse_args()
    models, default_out = SETS[args.set]
    out = args.out or default_out
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name, (architecture, fields) in models.items():
        first_seed_without_tie(name, functools.partial(write_fixture, name, architecture, fields, out))


if __name__ == "__main__":
    main()
