"""The two forms of the gated delta rule agree, and the conv's two forms agree.

``recurrent`` is the literal per-token recurrence (decode); ``chunked`` is the WY/UT chunk form
(prefill). On random inputs with a non-zero initial state, lengths that are and are not multiples
of the chunk, and several chunk sizes, outputs and final states agree within 2e-5 relative to
their scale (float32 with different summation orders). An independent float64 loop written from
the recurrence's definition pins both.
"""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.backends.reference import deltanet

HEADS, DK, DV = 3, 8, 6


def inputs(steps: int, seed: int):
    rng = np.random.default_rng(seed)
    q = deltanet.l2_normalize(rng.standard_normal((steps, HEADS, DK)).astype(np.float32)) * np.float32(DK**-0.5)
    k = deltanet.l2_normalize(rng.standard_normal((steps, HEADS, DK)).astype(np.float32))
    v = rng.standard_normal((steps, HEADS, DV)).astype(np.float32)
    g = -rng.uniform(0.0, 2.0, (steps, HEADS)).astype(np.float32)  # log-decays: exp(g) in (0.13, 1]
    beta = rng.uniform(0.0, 1.0, (steps, HEADS)).astype(np.float32)
    state = rng.standard_normal((HEADS, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, state


def definition(q, k, v, g, beta, state):
    """The recurrence exactly as written in deltanet's docstring, in float64, head by head."""
    s = state.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        for h in range(HEADS):
            s[h] *= np.exp(g[t, h])
            s[h] += np.outer(k[t, h], beta[t, h] * (v[t, h] - s[h].T @ k[t, h]))
            out[t, h] = s[h].T @ q[t, h]
    return out, s


def close(actual, expected, what, tolerance=2e-5):
    error = np.abs(actual - expected).max() / max(np.abs(expected).max(), 1.0)
    assert error <= tolerance, f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("steps", [1, 5, 64, 100, 130])
def test_chunked_equals_recurrent_and_definition(steps):
    q, k, v, g, beta, state = inputs(steps, seed=steps)
    want_out, want_state = definition(q, k, v, g, beta, state)
    rec_out, rec_state = deltanet.recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])
    chunk_out, chunk_state = deltanet.chunked(q, k, v, g, beta, state)
    close(rec_out[0], want_out, "recurrent output")
    close(rec_state[0], want_state, "recurrent state")
    close(chunk_out, want_out, "chunked output")
    close(chunk_state, want_state, "chunked state")
    close(chunk_out, rec_out[0], "chunked vs recurrent output")


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunk_size_does_not_change_the_result(chunk):
    q, k, v, g, beta, state = inputs(50, seed=3)
    out, final = deltanet.chunked(q, k, v, g, beta, state, chunk=chunk)
    ref_out, ref_state = deltanet.chunked(q, k, v, g, beta, state, chunk=64)
    close(out, ref_out, f"chunk {chunk} output")
    close(final, ref_state, f"chunk {chunk} state")


def test_chunked_in_pieces_equals_chunked_at_once():
    """Carrying the state between calls is the same as one call: what prefill chunks rely on."""
    q, k, v, g, beta, state = inputs(90, seed=11)
    whole, whole_state = deltanet.chunked(q, k, v, g, beta, state)
    s, parts = state, []
    for lo, hi in [(0, 17), (17, 81), (81, 90)]:
        out, s = deltanet.chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s)
        parts.append(out)
    close(np.concatenate(parts), whole, "pieces output")
    close(s, whole_state, "pieces state")


def test_recurrent_batches_sequences_independently():
    seqs = [inputs(4, seed=s) for s in (1, 2)]
    stacked = [np.stack(parts) for parts in zip(*seqs)]
    out, state = deltanet.recurrent(*stacked)
    for b, parts in enumerate(seqs):
        one_out, one_state = deltanet.recurrent(*(p[None] for p in parts))
        np.testing.assert_array_equal(out[b], one_out[0])
        np.testing.assert_array_equal(state[b], one_state[0])


def test_conv_step_by_step_equals_prefill_and_keeps_the_tail():
    rng = np.random.default_rng(5)
    channels, kernel, steps = 6, 4, 9
    x = rng.standard_normal((steps, channels)).astype(np.float32)
    weight = rng.standard_normal((channels, kernel)).astype(np.float32)
    state0 = rng.standard_normal((kernel - 1, channels)).astype(np.float32)
    out, tail = deltanet.conv_prefill(x, state0, weight)
    # Definition: out[t, c] = sum_j weight[c, j] * padded[t + j, c], padded = state0 then x.
    padded = np.concatenate([state0, x]).astype(np.float64)
    want = np.stack([(padded[t : t + kernel] * weight.T).sum(axis=0) for t in range(steps)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(tail, x[-(kernel - 1) :])
    state = state0[None]
    for t in range(steps):
        y, state = deltanet.conv_step(x[t][None], state, weight)
        np.testing.assert_allclose(y[0], out[t], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state[0], tail)


def test_gated_rms_norm_uses_the_plain_weight_and_silu_gate():
    x = np.array([[3.0, 4.0]], np.float32)
    gate = np.array([[0.0, 100.0]], np.float32)
    out = deltanet.gated_rms_norm(x, gate, np.array([2.0, 0.5], np.float32), eps=0.0)
    rms = np.sqrt(12.5)
    np.testing.assert_allclose(out, [[0.0, 4.0 / rms * 0.5 * 100.0]], rtol=1e-6)
