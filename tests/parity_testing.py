"""What the dense and hybrid parity tests share: fixture conversion and the golden replay.

A fixture directory holds a Hugging Face checkpoint and ``golden.npz`` (tools/make_parity_fixtures.py,
tools/make_hybrid_fixtures.py): for prompt ``i``, ``prompt_i``, transformers' ``prompt_logits_i``,
its greedy continuation ``greedy_i`` and the logits ``greedy_logits_i`` each token came from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow
from ninfer.convert.hf import convert_hf

# Relative to the largest |logit| of the row: fp32 against fp32 with other summation orders.
LOGIT_TOLERANCE = 1e-4
GREEDY = SamplingRow(temperature=0.0)


def convert_fixtures(fixtures: Path, names, out: Path) -> dict[str, Path]:
    """Each fixture checkpoint converted by the product's HF converter: name -> artifact path."""
    paths = {}
    for name in names:
        paths[name] = out / f"{name}.ninfer"
        convert_hf(fixtures / name, paths[name])
    return paths


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    scale = np.maximum(np.abs(expected).max(axis=-1, keepdims=True), 1.0)
    error = (np.abs(actual - expected) / scale).max()
    assert error <= LOGIT_TOLERANCE, f"{what}: max relative logit error {error:.2e} > {LOGIT_TOLERANCE}"


def replay_golden(runner, golden, i: int | str, pages: np.ndarray, what: str) -> None:
    """Prefill prompt ``i`` on lane 0, then decode greedily through the paged KV cache as many
    tokens as transformers did: the prompt logits and every step's logits must be close and the
    tokens identical."""
    prompt = golden[f"prompt_{i}"]
    runner.bind_lane(0, [])
    first = runner.prefill(PrefillChunk(lane=0, tokens=prompt, start=0, page_table=pages, sample=GREEDY,
                                        return_logits=True))
    assert_logits_close(first.logits, golden[f"prompt_logits_{i}"], f"{what} prompt {i} prefill")
    expected = golden[f"greedy_{i}"]
    tokens, step_logits = [int(first.tokens[0])], [first.logits[-1]]
    while len(tokens) < expected.size:
        position = prompt.size + len(tokens) - 1
        step = runner.decode(DecodeBatch(
            lanes=np.array([0], np.int32), tokens=np.array([tokens[-1]], np.int32),
            positions=np.array([position], np.int32), page_tables=pages[None, :],
            sampling=[GREEDY], return_logits=True))
        tokens.append(int(step.tokens[0]))
        step_logits.append(step.logits[0])
    assert tokens == expected.tolist(), f"{what} prompt {i}: greedy tokens differ"
    assert_logits_close(np.stack(step_logits), golden[f"greedy_logits_{i}"], f"{what} prompt {i} decode")
