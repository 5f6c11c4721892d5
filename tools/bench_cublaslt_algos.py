"""Each algorithm cuBLASLt's heuristic offers for the Qwen3-8B prefill GEMMs, timed: is its first pick the best?

    python3 tools/bench_cublaslt_algos.py [--rows 8192,1024] [--choices 16] [--reps 10]

For every prefill GEMM of a layer (qkv and gate_up written in bf16, o and down adding into the fp32
residual stream, as ``Forward.layers`` runs them) it asks the heuristic for up to ``--choices``
algorithms and times each on random bf16 operands (our fill kernel) with CUDA events, ``--reps``
back-to-back launches after an untimed turn of as many (``LtMatmul.tune``, one round). Prints TFLOP/s
per algorithm, the heuristic's first marked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.backends.cuda import runtime as rt  # noqa: E402
from ninfer.backends.cuda.cublaslt import WORKSPACE_BYTES, LtMatmul  # noqa: E402

# name: (n, k, out_bf16, accumulate), Qwen3-8B (hidden 4096, 32 + 2 x 8 heads of 128, ffn 12288)
SHAPES = {"qkv": (6144, 4096, True, False), "o": (4096, 4096, False, True),
          "gate_up": (24576, 4096, True, False), "down": (4096, 12288, False, True)}


def fill(kernels, buf, count: int, seed: int, stream) -> None:
    kernels["fill_normal_bf16"].launch((min(-(-count // 256), 4096),), (256,),
                                       (buf, count, seed, 0.02, 0.0, 1, 0, 0.0), stream)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8192,1024")
    parser.add_argument("--choices", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    device = rt.Device(0)
    stream = device.stream()
    kernels = rt.Kernels(device)
    lt = LtMatmul(device.alloc(WORKSPACE_BYTES, "lt workspace"))
    max_rows = max(int(r) for r in args.rows.split(","))
    x = device.alloc(max_rows * 12288 * 2, "x")
    y = device.alloc(max_rows * 24576 * 4, "y")
    w = device.alloc(24576 * 4096 * 2, "w")
    fill(kernels, x, max_rows * 12288, 1, stream)
    fill(kernels, w, 24576 * 4096, 2, stream)
    rt.memset32(y, 0, y.nbytes // 4, stream)
    events = device.event(timing=True), device.event(timing=True)
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (n, k, out_bf16, accumulate) in SHAPES.items():
            # one untimed turn over the algorithms, then one timed: --reps calls each, the same weights
            ms = lt.tune(y, x, [w] * args.reps, rows, n, k, stream, events, accumulate=accumulate,
                         out_bf16=out_bf16, rounds=1, choices=args.choices)
            flops = 2.0 * rows * n * k
            figures = [f"#{index} failed" if t == float("inf") else f"#{index} {flops / t / 1e9:.0f}"
                       for index, t in enumerate(ms)]
            print(f"rows={rows} {name} [{n} x {k}]: TFLOP/s by algorithm (#0 = heuristic's pick): "
                  + ", ".join(figures), flush=True)
    lt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
