"""Parity of the reference backend with Hugging Face transformers on tiny random checkpoints.

The fixtures come from tools/make_parity_fixtures.py: bf16 HF checkpoints plus transformers'
float32 logits and greedy tokens on them, in two sets: tests/fixtures/parity/ (the architectures'
features at the smallest shapes) and tests/fixtures/parity_cuda/ (shapes the CUDA backend takes,
which tests/cuda/test_cuda_parity.py replays on the GPU). Here each checkpoint goes the product's
way (``ninfer.convert.hf`` into a .ninfer artifact, opened by ``ReferenceRunner``), and the
reference backend must reproduce:
- the greedy tokens exactly (32 per prompt, decoded through the paged KV cache);
- every logit within ``parity_testing.LOGIT_TOLERANCE`` x the largest |logit| of that row (fp32 vs fp32 with
  different summation orders: the largest error observed is 6.5e-6 on parity/, 7.7e-6 on parity_cuda/).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from parity_testing import convert_fixtures, replay_golden

from ninfer.backends.reference import ReferenceRunner
from ninfer.convert.hf_config import dense_config_from_hf

FIXTURES = Path(__file__).parent / "fixtures"
SETS = ("parity", "parity_cuda")
CASES = [(s, p.name) for s in SETS for p in sorted((FIXTURES / s).iterdir()) if (p / "golden.npz").is_file()]
PAGE_SIZE = 8
MAX_FIXTURE_BYTES = 2 * 1024 * 1024  # per set: the fixtures live in the repository


def _configs(fixture_set: str):
    return [dense_config_from_hf(json.loads((FIXTURES / s / n / "config.json").read_text()))
            for s, n in CASES if s == fixture_set]


def _set_bytes(fixture_set: str) -> int:
    return sum(f.stat().st_size for f in (FIXTURES / fixture_set).rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Each fixture checkpoint converted once by the product's HF converter: (set, name) -> path."""
    return {(s, name): path for s in SETS
            for name, path in convert_fixtures(FIXTURES / s, [n for t, n in CASES if t == s],
                                               tmp_path_factory.mktemp(s)).items()}


@pytest.mark.parametrize("fixture_set,name", CASES, ids=[f"{s}/{n}" for s, n in CASES])
def test_greedy_tokens_and_logits_match_transformers(fixture_set, name, artifacts):
    golden = np.load(FIXTURES / fixture_set / name / "golden.npz")
    prompts = sorted(k for k in golden.files if k.startswith("prompt_") and "logits" not in k)
    assert len(prompts) >= 3
    runner = ReferenceRunner(artifacts[fixture_set, name], page_size=PAGE_SIZE, num_pages=16, max_batch=1,
                             max_context=128)
    pages = np.arange(16, dtype=np.int32)[::-1].copy()  # non-identity page order on purpose
    for key in prompts:
        replay_golden(runner, golden, key.split("_")[1], pages, name)


class _Skewed:
    """A runner whose decode logits are off by ``error`` x each row's largest |logit|."""

    def __init__(self, runner, error):
        self.runner, self.error = runner, error

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def decode(self, batch):
        step = self.runner.decode(batch)
        step.logits[:, 0] += self.error * np.maximum(np.abs(step.logits).max(axis=-1), 1.0)
        return step


def test_teacher_forced_replay_checks_every_step(artifacts):
    """The replay tests/cuda/test_cuda_parity.py uses for a bf16 KV pool: transformers' tokens fed
    back, every step's logits compared at the given tolerance."""
    name = "qwen3_d128_gqa4_yarn"
    golden = np.load(FIXTURES / "parity_cuda" / name / "golden.npz")
    runner = ReferenceRunner(artifacts["parity_cuda", name], page_size=PAGE_SIZE, num_pages=16, max_batch=1,
                             max_context=128)
    pages = np.arange(16, dtype=np.int32)
    replay_golden(runner, golden, 2, pages, name, teacher_forced=True)
    replay_golden(_Skewed(runner, 5e-3), golden, 2, pages, name, tolerance=1e-2, teacher_forced=True)
    with pytest.raises(AssertionError, match="decode: max relative logit error"):
        replay_golden(_Skewed(runner, 2e-2), golden, 2, pages, name, tolerance=1e-2, teacher_forced=True)


def test_fixtures_cover_the_required_features():
    """The parity set must keep covering: Llama + Qwen3, tied + untied, each rope scaling, biases,
    grouped and multi-query attention."""
    configs = _configs("parity")
    assert {c.architecture for c in configs} == {"LlamaForCausalLM", "Qwen3ForCausalLM"}
    assert {c.tie_word_embeddings for c in configs} == {True, False}
    assert {"none", "llama3", "linear", "yarn"} <= {c.rope_scaling.kind for c in configs}
    assert any(c.attention_bias for c in configs) and any(c.qk_norm for c in configs)
    assert {c.num_heads // c.num_kv_heads for c in configs} >= {2, 4}  # GQA and multi-query
    total = _set_bytes("parity")
    assert total < MAX_FIXTURE_BYTES, f"parity fixtures grew to {total} bytes"


def test_cuda_fixtures_cover_both_head_dims_and_pass_the_cuda_gate():
    """The parity_cuda set: Llama (biases) + Qwen3 (q/k norm), head_dim 64 and 128, an untied head,
    and every config one the CUDA backend accepts (its gate needs no GPU)."""
    configs = _configs("parity_cuda")
    assert {c.architecture for c in configs} == {"LlamaForCausalLM", "Qwen3ForCausalLM"}
    assert {c.head_dim for c in configs} == {64, 128}
    assert any(c.attention_bias for c in configs) and any(c.qk_norm for c in configs)
    assert not all(c.tie_word_embeddings for c in configs)
    total = _set_bytes("parity_cuda")
    assert total < MAX_FIXTURE_BYTES, f"parity_cuda fixtures grew to {total} bytes"
    forward = pytest.importorskip("ninfer.backends.cuda.forward")  # needs the cuda extra, not a GPU
    for config in configs:
        for kv_dtype in ("f32", "bf16"):
            forward.check_supported(config, kv_dtype)
