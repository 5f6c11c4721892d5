"""The chunked delta-rule kernels under Numba's CUDA simulator, against the NumPy reference.

Run as a script with ``NUMBA_ENABLE_CUDASIM=1`` (set before numba.cuda is imported: the pytest
process never imports it, see tests/test_deltanet_chunked_sim.py). It launches ``deltanet_prep``,
``deltanet_chunk_prep`` and ``deltanet_chunk_scan`` (their Python functions; the simulator runs them
as Python threads) over sequences of ``rows`` tokens that continue from a nonzero state, and prints
one JSON line: the largest relative difference of ``o_raw`` and the final state from
``reference.deltanet.chunked`` and ``recurrent``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_sim  # noqa: E402

kernel_sim.install()  # shuffles and the rest the simulator lacks, before numba_kernels is imported

from numba import cuda  # noqa: E402

from ninfer.backends.reference import deltanet as ref  # noqa: E402
from numba_kernels import deltanet as kern  # noqa: E402


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run(d: int, n_k: int, n_v: int, rows: int, n_seqs: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    key_dim, value_dim = n_k * d, n_v * d
    conv_dim = 2 * key_dim + value_dim
    in_stride = conv_dim + value_dim + 2 * n_v
    total = n_seqs * rows
    mixed = rng.standard_normal((total, conv_dim)).astype(np.float32)
    proj = rng.standard_normal((total, in_stride)).astype(np.float32)
    dt_bias = rng.standard_normal(n_v).astype(np.float32)
    a_log = (rng.standard_normal(n_v) * 0.5).astype(np.float32)
    slot = n_v * d * d + 8  # a slot stride that is not the state's size
    lanes = np.arange(n_seqs, dtype=np.int32)[::-1].copy() + 1  # slot 0 unused
    states = np.zeros((n_seqs + 1) * slot, np.float32)
    init = (rng.standard_normal((n_seqs, n_v, d, d)) * 0.3).astype(np.float32)
    for s in range(n_seqs):
        states[lanes[s] * slot: lanes[s] * slot + n_v * d * d] = init[s].ravel()

    qk = np.zeros(total * 2 * key_dim, np.float32)
    gates = np.zeros(total * 2 * n_v, np.float32)
    prep = cuda.jit(kern.make_prep(d))
    prep[(total, n_k + 1), (max(32, d),)](qk, gates, mixed.ravel(), proj.ravel(), n_k, n_v, in_stride, dt_bias,
                                           a_log)
    n_chunks = -(-rows // kern.CHUNK)
    floats = kern.chunk_floats(d, d)
    scratch = np.full(n_seqs * n_v * n_chunks * floats, np.nan, np.float32)  # unwritten rows stay NaN
    o_raw = np.zeros(total * value_dim, np.float32)
    chunk_prep = cuda.jit(kern.make_chunk_prep(d, d))
    chunk_scan = cuda.jit(kern.make_chunk_scan(d, d))
    chunk_prep[(n_v, n_chunks, n_seqs), (kern.CHUNK_THREADS,)](
        scratch, qk, gates, mixed.ravel(), proj.ravel(), in_stride, dt_bias, a_log, rows, n_k, n_v)
    chunk_scan[(n_v, d // kern.CHUNK_COLS, n_seqs), (kern.CHUNK_THREADS,)](
        scratch, qk, o_raw, states, slot, lanes, rows, n_k, n_v)

    # The reference from the same inputs: q, k from the normalised qk (checked against NumPy's norm),
    # g as the reference computes it from proj.
    qk = qk.reshape(total, 2, n_k, d)
    q_ref = ref.l2_normalize(mixed[:, :key_dim].reshape(total, n_k, d)) * np.float32(d ** -0.5)
    result = {"prep_q": rel(qk[:, 0], q_ref)}
    group = n_v // n_k
    q, k = np.repeat(qk[:, 0], group, axis=1), np.repeat(qk[:, 1], group, axis=1)
    v = mixed[:, 2 * key_dim:].reshape(total, n_v, d)
    b = proj[:, conv_dim + value_dim: conv_dim + value_dim + n_v]
    a = proj[:, conv_dim + value_dim + n_v:]
    beta = ref.sigmoid(b)
    g = -np.exp(a_log) * ref.softplus(a + dt_bias)
    o_raw = o_raw.reshape(total, n_v, d)
    worst = {"o_chunked": 0.0, "state_chunked": 0.0, "o_recurrent": 0.0, "state_recurrent": 0.0}
    for s in range(n_seqs):
        rows_s = slice(s * rows, (s + 1) * rows)
        final = states[lanes[s] * slot: lanes[s] * slot + n_v * d * d].reshape(n_v, d, d)
        o_c, s_c = ref.chunked(q[rows_s], k[rows_s], v[rows_s], g[rows_s], beta[rows_s], init[s])
        o_r, s_r = ref.recurrent(q[None, rows_s], k[None, rows_s], v[None, rows_s], g[None, rows_s],
                                 beta[None, rows_s], init[s][None])
        for key, got, want in (("o_chunked", o_raw[rows_s], o_c), ("state_chunked", final, s_c),
                               ("o_recurrent", o_raw[rows_s], o_r[0]), ("state_recurrent", final, s_r[0])):
            worst[key] = max(worst[key], rel(got, want))
    result.update(worst)
    result["finite"] = bool(np.isfinite(o_raw).all())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--n-k", type=int, default=1)
    parser.add_argument("--n-v", type=int, default=2)
    parser.add_argument("--rows", type=int, default=70)
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(run(args.d, args.n_k, args.n_v, args.rows, args.seqs, args.seed)))


if __name__ == "__main__":
    main()
