"""Parity of the reference backend with Hugging Face transformers on tiny random checkpoints.

The fixtures (tests/fixtures/parity/<name>/) come from tools/make_parity_fixtures.py: bf16 HF
checkpoints plus transformers' float32 logits and greedy tokens on them. Here the checkpoint is
loaded into the reference backend, which must reproduce:
- the greedy tokens exactly (32 per prompt, decoded through the paged KV cache);
- every logit within ``LOGIT_TOLERANCE`` x the largest |logit| of that row (fp32 vs fp32 with
  different summation orders: the largest error observed is 6e-6).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ninfer.backends.reference import ReferenceRunner
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow
from ninfer.models.dense import DenseConfig, RopeScaling

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").is_file())
LOGIT_TOLERANCE = 1e-4
PAGE_SIZE = 8
GREEDY = SamplingRow(temperature=0.0)


# -- loading an HF checkpoint without the converter --------------------------------------------


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The safetensors layout: u64 header length, JSON header, raw little-endian data."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    dtypes = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16}
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        data = np.frombuffer(raw, dtype=dtypes[meta["dtype"]], offset=8 + length + begin,
                             count=(end - begin) // np.dtype(dtypes[meta["dtype"]]).itemsize)
        tensors[name] = data.reshape(meta["shape"])
    return tensors


def dense_config(hf: dict) -> DenseConfig:
    scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "none"))
    rope = RopeScaling(
        kind="none" if kind == "default" else kind,
        factor=scaling.get("factor", 1.0),
        original_max_position=scaling.get("original_max_position_embeddings"),
        low_freq_factor=scaling.get("low_freq_factor", 1.0),
        high_freq_factor=scaling.get("high_freq_factor", 4.0),
        beta_fast=scaling.get("beta_fast", 32.0),
        beta_slow=scaling.get("beta_slow", 1.0),
        attention_factor=scaling.get("attention_factor"),
    )
    qwen3 = hf["architectures"][0] == "Qwen3ForCausalLM"
    return DenseConfig(
        architecture=hf["architectures"][0],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=hf["rope_theta"],
        rope_scaling=rope,
        max_position_embeddings=hf["max_position_embeddings"],
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        qk_norm=qwen3,
        attention_bias=hf.get("attention_bias", False),
    )


def canonical_weights(config: DenseConfig, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF names onto ours, fusing q/k/v and gate/up (rows concatenated, as dense.py defines)."""
    out = {"embed": hf["model.embed_tokens.weight"], "final_norm": hf["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head"] = hf["lm_head.weight"]
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "attn_norm"] = hf[src + "input_layernorm.weight"]
        out[dst + "qkv"] = np.concatenate([hf[attn + f"{p}_proj.weight"] for p in "qkv"])
        if config.attention_bias:
            out[dst + "qkv_bias"] = np.concatenate([hf[attn + f"{p}_proj.bias"] for p in "qkv"])
        if config.qk_norm:
            out[dst + "q_norm"] = hf[attn + "q_norm.weight"]
            out[dst + "k_norm"] = hf[attn + "k_norm.weight"]
        out[dst + "o"] = hf[attn + "o_proj.weight"]
        o_bias = hf.get(attn + "o_proj.bias")
        assert o_bias is None or not o_bias.any(), "the canonical layout has no o_proj bias"
        out[dst + "mlp_norm"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "gate_up"] = np.concatenate([hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
        out[dst + "down"] = hf[src + "mlp.down_proj.weight"]
    return out


def load_fixture_runner(name: str, **sizes) -> ReferenceRunner:
    directory = FIXTURES / name
    config = dense_config(json.loads((directory / "config.json").read_text()))
    weights = canonical_weights(config, read_safetensors(directory / "model.safetensors"))
    return ReferenceRunner.from_weights(config, weights, **sizes)


# -- the checks -----------------------------------------------------------------------------------


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    scale = np.maximum(np.abs(expected).max(axis=-1, keepdims=True), 1.0)
    error = (np.abs(actual - expected) / scale).max()
    assert error <= LOGIT_TOLERANCE, f"{what}: max relative logit error {error:.2e} > {LOGIT_TOLERANCE}"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_and_logits_match_transformers(name):
    golden = np.load(FIXTURES / name / "golden.npz")
    prompts = sorted(k for k in golden.files if k.startswith("prompt_") and "logits" not in k)
    assert len(prompts) >= 3
    runner = load_fixture_runner(name, page_size=PAGE_SIZE, num_pages=16, max_batch=1, max_context=128)
    pages = np.arange(16, dtype=np.int32)[::-1].copy()  # non-identity page order on purpose
    for key in prompts:
        i = key.split("_")[1]
        prompt = golden[key]
        runner.bind_lane(0, [])
        first = runner.prefill(PrefillChunk(lane=0, tokens=prompt, start=0, page_table=pages, sample=GREEDY,
                                            return_logits=True))
        assert_logits_close(first.logits, golden[f"prompt_logits_{i}"], f"{name} prompt {i} prefill")
        tokens, step_logits = [int(first.tokens[0])], [first.logits[-1]]
        while len(tokens) < len(golden[f"greedy_{i}"]):
            position = len(prompt) + len(tokens) - 1
            step = runner.decode(DecodeBatch(
                lanes=np.array([0], np.int32), tokens=np.array([tokens[-1]], np.int32),
                positions=np.array([position], np.int32), page_tables=pages[None, :],
                sampling=[GREEDY], return_logits=True))
            tokens.append(int(step.tokens[0]))
            step_logits.append(step.logits[0])
        assert tokens == golden[f"greedy_{i}"].tolist(), f"{name} prompt {i}: greedy tokens differ"
        assert_logits_close(np.stack(step_logits), golden[f"greedy_logits_{i}"], f"{name} prompt {i} decode")


def test_fixtures_cover_the_required_features():
    """The parity set must keep covering: Llama + Qwen3, tied + untied, each rope scaling, biases."""
    configs = [dense_config(json.loads((FIXTURES / n / "config.json").read_text())) for n in NAMES]
    assert {c.architecture for c in configs} == {"LlamaForCausalLM", "Qwen3ForCausalLM"}
    assert {c.tie_word_embeddings for c in configs} == {True, False}
    assert {"llama3", "linear", "yarn"} <= {c.rope_scaling.kind for c in configs}
    assert any(c.attention_bias for c in configs) and any(c.qk_norm for c in configs)
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 2 * 1024 * 1024, f"parity fixtures grew to {total} bytes"
