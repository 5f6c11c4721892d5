"""The reference sampling rule (ninfer/backends/sampling.py)."""

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ninfer.backends.runner import SamplingRow
from ninfer.backends.sampling import sample_row, top_k_order, uniform


def test_greedy_takes_lowest_index_on_ties():
    logits = np.array([0.0, 3.0, 3.0, 1.0], dtype=np.float32)
    assert sample_row(logits, SamplingRow(temperature=0.0)) == 1


def test_uniform_is_a_pure_function_of_seed_and_step():
    assert uniform(7, 3) == uniform(7, 3)
    assert uniform(7, 3) != uniform(7, 4)
    assert uniform(-1, 0) == uniform((1 << 64) - 1, 0)
    assert all(0.0 <= uniform(s, t) < 1.0 for s in range(5) for t in range(50))


def test_top_k_one_is_greedy_and_penalties_shift_the_choice():
    logits = np.array([5.0, 4.9, 0.0], dtype=np.float32)
    row = SamplingRow(temperature=1.0, top_k=1, seed=3)
    assert sample_row(logits, row) == 0
    counts = np.array([1, 0, 0])
    penalised = SamplingRow(temperature=1.0, top_k=1, presence_penalty=1.0, seed=3)
    assert sample_row(logits, penalised, counts) == 1


def test_sampling_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    draws = [sample_row(logits, SamplingRow(temperature=1.0, seed=11, step=s)) for s in range(4000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, [0.5, 0.3, 0.2], atol=0.03)


def test_top_p_and_min_p_cut_the_tail():
    logits = np.log(np.array([0.6, 0.3, 0.1], dtype=np.float32))
    top_p = [sample_row(logits, SamplingRow(temperature=1.0, top_p=0.5, seed=1, step=s)) for s in range(200)]
    assert set(top_p) == {0}
    min_p = [sample_row(logits, SamplingRow(temperature=1.0, min_p=0.4, seed=1, step=s)) for s in range(400)]
    assert set(min_p) == {0, 1}


@settings(max_examples=300, deadline=None)
@example([1.0, 2.0, np.nan, 3.0, 4.0], 2)
@given(st.lists(st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 2.0, np.inf, np.nan]), min_size=1, max_size=40),
       st.integers(1, 45))
def test_top_k_order_is_the_head_of_the_full_stable_sort(values, k):
    """Ties (many equal logits around the k-th) keep the lowest indices, as a full sort does."""
    logits = np.array(values, dtype=np.float32)
    full = np.lexsort((np.arange(logits.size), -logits))[:k]
    assert top_k_order(logits, k).tolist() == full.tolist()


def test_penalties_stay_in_fp32_like_the_device_sampler():
    from ninfer.backends.sampling import apply_penalties

    row = SamplingRow(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(np.zeros(3, dtype=np.float32), np.array([0, 1, 2]), row)
    assert out.dtype == np.float32
    assert out.tolist() == [0.0, -0.75, -1.0]
