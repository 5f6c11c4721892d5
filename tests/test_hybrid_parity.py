"""Parity of the hybrid reference backend with transformers on tiny random checkpoints.

Fixtures (tests/fixtures/hybrid/<name>/) come from tools/make_hybrid_fixtures.py: bf16 checkpoints
of Qwen3NextForCausalLM (MoE + one dense layer, per-expert tensors), Qwen3_5ForConditionalGeneration
(dense, tied, vision + mtp tensors) and Qwen3_5MoeForCausalLM (fused experts), with transformers'
float32 logits. Each goes the product's way (HF converter -> .ninfer -> ``ReferenceRunner``), and:
- every prompt logit (one prefill chunk: the chunked delta rule; the 70-token prompt crosses the
  64-token chunk boundary) is within ``parity_testing.LOGIT_TOLERANCE`` x the row's largest |logit|;
- the greedy continuation (16 tokens through decode steps: the recurrent delta rule, the conv
  state and the paged KV cache) is token-identical, and each step's logits are within tolerance
  of transformers recomputing the whole sequence.
The largest relative error observed is 1.4e-5 (fp32 against fp32 with other summation orders).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from parity_testing import convert_fixtures, replay_golden

from ninfer.backends.reference import HybridRunner, ReferenceRunner

FIXTURES = Path(__file__).parent / "fixtures" / "hybrid"
NAMES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
PAGE_SIZE = 8


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return convert_fixtures(FIXTURES, NAMES, tmp_path_factory.mktemp("hybrid"))


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_and_greedy_tokens_match_transformers(name, artifacts):
    golden = np.load(FIXTURES / name / "golden.npz")
    runner = ReferenceRunner(artifacts[name], page_size=PAGE_SIZE, num_pages=16, max_batch=1, max_context=128)
    assert isinstance(runner, HybridRunner)  # the reference runner dispatches on the architecture
    pages = np.arange(16, dtype=np.int32)[::-1].copy()  # non-identity page order on purpose
    for i in range(3):
        replay_golden(runner, golden, i, pages, name)


def test_cli_generate_prints_the_greedy_continuation(artifacts, capsys):
    """``ninfer generate`` on a hybrid artifact: the word-level fixture tokenizer spells token i as
    ``t{i}``, so the printed text is transformers' greedy continuation."""
    from ninfer.cli import main

    golden = np.load(FIXTURES / "qwen3_5_moe" / "golden.npz")
    prompt = " ".join(f"t{i}" for i in golden["prompt_1"])
    assert main(["generate", str(artifacts["qwen3_5_moe"]), "--prompt", prompt, "--max-tokens", "8"]) == 0
    captured = capsys.readouterr()
    expected = golden["greedy_1"][:8].tolist()
    if 2 in expected:  # EOS (id 2) ends generation early
        expected = expected[: expected.index(2)]
    assert captured.out.split() == [f"t{i}" for i in expected]
    assert "GB/s" in captured.err
