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


def _row_scale(expected: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(expected).max(axis=-1, keepdims=True), 1.0)


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, what: str,
                        tolerance: float = LOGIT_TOLERANCE) -> None:
    error = (np.abs(actual - expected) / _row_scale(expected)).max()
    assert error <= tolerance, f"{what}: max relative logit error {error:.2e} > {tolerance}"


def replay_golden(runner, golden, i: int | str, pages: np.ndarray, what: str, *,
                  tolerance: float = LOGIT_TOLERANCE, teacher_forced: bool = False) -> None:
    """Prefill prompt ``i`` on lane 0, then decode greedily through the paged KV cache as many
    tokens as transformers did: the prompt logits and every step's logits must be within
    ``tolerance`` and the tokens identical.

    ``teacher_forced``: each step is fed transformers' token rather than the runner's own, for a
    runner whose rounding (a bf16 KV pool) may flip a close greedy choice: every step's logits stay
    comparable with the golden ones, and the runner's tokens must match only where transformers'
    top-2 margin exceeds twice the tolerance (logits within it cannot reorder those two)."""
    prompt = golden[f"prompt_{i}"]
    runner.bind_lane(0, [])
    first = runner.prefill(PrefillChunk(lane=0, tokens=prompt, start=0, page_table=pages, sample=GREEDY,
                                        return_logits=True))
    assert_logits_close(first.logits, golden[f"prompt_logits_{i}"], f"{what} prompt {i} prefill", tolerance)
    expected, expected_logits = golden[f"greedy_{i}"], golden[f"greedy_logits_{i}"]
    tokens, step_logits = [int(first.tokens[0])], [first.logits[-1]]
    while len(tokens) < expected.size:
        position = prompt.size + len(tokens) - 1
        fed = int(expected[len(tokens) - 1]) if teacher_forced else tokens[-1]
        step = runner.decode(DecodeBatch(
            lanes=np.array([0], np.int32), tokens=np.array([fed], np.int32),
            positions=np.array([position], np.int32), page_tables=pages[None, :],
            sampling=[GREEDY], return_logits=True))
        tokens.append(int(step.tokens[0]))
        step_logits.append(step.logits[0])
    if teacher_forced:
        top2 = np.sort(expected_logits, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * tolerance * _row_scale(expected_logits)[:, 0]
        assert np.array_equal(np.array(tokens)[clear], expected[clear]), \
            f"{what} prompt {i}: greedy tokens differ where transformers' choice is clear"
    else:
        assert tokens == expected.tolist(), f"{what} prompt {i}: greedy tokens differ"
    assert_logits_close(np.stack(step_logits), expected_logits, f"{what} prompt {i} decode", tolerance)
