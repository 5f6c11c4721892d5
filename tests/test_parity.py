"""Parity of the reference backend with Hugging Face transformers on tiny random checkpoints.

The fixtures (tests/fixtures/parity/<name>/) come from tools/make_parity_fixtures.py: bf16 HF
checkpoints plus transformers' float32 logits and greedy tokens on them. Here each checkpoint goes
the product's way (``ninfer.convert.hf`` into a .ninfer artifact, opened by ``ReferenceRunner``),
and the reference backend must reproduce:
- the greedy tokens exactly (32 per prompt, decoded through the paged KV cache);
- every logit within ``parity_testing.LOGIT_TOLERANCE`` x the largest |logit| of that row (fp32 vs fp32 with
  different summation orders: the largest error observed is 6.5e-6).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from parity_testing import convert_fixtures, replay_golden

from ninfer.backends.reference import ReferenceRunner
from ninfer.convert.hf_config import dense_config_from_hf

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").is_file())
PAGE_SIZE = 8


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Each fixture checkpoint converted once by the product's HF converter."""
    return convert_fixtures(FIXTURES, NAMES, tmp_path_factory.mktemp("parity"))


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_and_logits_match_transformers(name, artifacts):
    golden = np.load(FIXTURES / name / "golden.npz")
    prompts = sorted(k for k in golden.files if k.startswith("prompt_") and "logits" not in k)
    assert len(prompts) >= 3
    runner = ReferenceRunner(artifacts[name], page_size=PAGE_SIZE, num_pages=16, max_batch=1, max_context=128)
    pages = np.arange(16, dtype=np.int32)[::-1].copy()  # non-identity page order on purpose
    for key in prompts:
        replay_golden(runner, golden, key.split("_")[1], pages, name)


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
