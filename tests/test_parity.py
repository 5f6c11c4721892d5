"""Parity of the reference backend with Hugging Face transformers on tiny random checkpoints.

The fixtures (tests/fixtures/parity/<name>/) come from tools/make_parity_fixtures.py: bf16 HF
checkpoints plus transformers' float32 logits and greedy tokens on them. Here each checkpoint goes
the product's way (``ninfer.convert.hf`` into a .ninfer artifact, opened by ``ReferenceRunner``),
and the reference backend must reproduce:
- the greedy tokens exactly (32 per prompt, decoded through the paged KV cache);
- every logit within ``LOGIT_TOLERANCE`` x the largest |logit| of that row (fp32 vs fp32 with
  different summation orders: the largest error observed is 6.5e-6).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ninfer.backends.reference import ReferenceRunner
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow
from ninfer.convert.hf import convert_hf
from ninfer.convert.hf_config import dense_config_from_hf

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").is_file())
LOGIT_TOLERANCE = 1e-4
PAGE_SIZE = 8
GREEDY = SamplingRow(temperature=0.0)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Each fixture checkpoint converted once by the product's HF converter."""
    out = tmp_path_factory.mktemp("parity")
    paths = {}
    for name in NAMES:
        paths[name] = out / f"{name}.ninfer"
        convert_hf(FIXTURES / name, paths[name])
    return paths


# -- the checks -----------------------------------------------------------------------------------


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    scale = np.maximum(np.abs(expected).max(axis=-1, keepdims=True), 1.0)
    error = (np.abs(actual - expected) / scale).max()
    assert error <= LOGIT_TOLERANCE, f"{what}: max relative logit error {error:.2e} > {LOGIT_TOLERANCE}"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_and_logits_match_transformers(name, artifacts):
    golden = np.load(FIXTURES / name / "golden.npz")
    prompts = sorted(k for k in golden.files if k.startswith("prompt_") and "logits" not in k)
    assert len(prompts) >= 3
    runner = ReferenceRunner(artifacts[name], page_size=PAGE_SIZE, num_pages=16, max_batch=1, max_context=128)
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
    """The parity set must keep covering: Llama + Qwen3, tied + untied, each rope scaling, biases,
    grouped and multi-query attention."""
    configs = [dense_config_from_hf(json.loads((FIXTURES / n / "config.json").read_text())) for n in NAMES]
    assert {c.architecture for c in configs} == {"LlamaForCausalLM", "Qwen3ForCausalLM"}
    assert {c.tie_word_embeddings for c in configs} == {True, False}
    assert {"none", "llama3", "linear", "yarn"} <= {c.rope_scaling.kind for c in configs}
    assert any(c.attention_bias for c in configs) and any(c.qk_norm for c in configs)
    assert {c.num_heads // c.num_kv_heads for c in configs} >= {2, 4}  # GQA and multi-query
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 2 * 1024 * 1024, f"parity fixtures grew to {total} bytes"
