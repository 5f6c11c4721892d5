"""Time the reference gated delta rule, chunked (prefill form) against recurrent (decode form).

    .venv/bin/python tools/bench_deltanet.py [--tokens 1024] [--heads 32] [--dim 128]

Random inputs of one DeltaNet layer (``heads`` value heads of ``dim x dim`` state), one BLAS
thread (as the reference runner runs); prints both timings and the largest output difference.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

from ninfer.backends.reference import deltanet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    t, h, d = args.tokens, args.heads, args.dim
    rng = np.random.default_rng(0)
    q = deltanet.l2_normalize(rng.standard_normal((t, h, d)).astype(np.float32)) * np.float32(d**-0.5)
    k = deltanet.l2_normalize(rng.standard_normal((t, h, d)).astype(np.float32))
    v = rng.standard_normal((t, h, d)).astype(np.float32)
    g = -rng.uniform(0, 1, (t, h)).astype(np.float32)
    beta = rng.uniform(0, 1, (t, h)).astype(np.float32)
    state = np.zeros((h, d, d), np.float32)
    with threadpool_limits(1, "blas"):
        start = time.perf_counter()
        chunked, _ = deltanet.chunked(q, k, v, g, beta, state)
        t_chunked = time.perf_counter() - start
        start = time.perf_counter()
        recurrent, _ = deltanet.recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])
        t_recurrent = time.perf_counter() - start
    diff = np.abs(chunked - recurrent[0]).max()
    print(f"{t} tokens, {h} heads of {d}x{d}: chunked {t_chunked:.2f} s ({t / t_chunked:.0f} tok/s), "
          f"recurrent {t_recurrent:.2f} s ({t / t_recurrent:.0f} tok/s), max |difference| {diff:.1e}")


if __name__ == "__main__":
    main()
