"""The prefill's two bf16 RMSNorm kernels on one shape, timed in alternating loops on one GPU.

    python3 tools/bench_prefill_norm.py [--rows 8192] [--hidden 4096] [--loops 50] [--rounds 3]

``rmsnorm_rows_bf16`` (a warp a row, the row read twice) against ``rmsnorm_block_bf16`` (a block a
row, the row held in registers), each launched as ``Forward.layers`` launches it, ``--loops``
back-to-back launches between two events, the kernels taking turns for ``--rounds`` rounds. Prints
microseconds a norm and the bytes moved (fp32 in, bf16 out) over that time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.backends.cuda import runtime as rt  # noqa: E402
from tools.bench_prefill_attention import time_ms  # noqa: E402

KERNELS = ("rmsnorm_rows_bf16", "rmsnorm_block_bf16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--loops", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rows, hidden = args.rows, args.hidden
    device = rt.Device(0)
    stream = device.stream()
    kernels = rt.Kernels(device)
    x = device.alloc(rows * hidden * 4, "x")
    weight = device.alloc(hidden * 4, "weight")
    out = device.alloc(rows * hidden * 2, "out")
    rng = np.random.default_rng(0)
    rt.copy_h2d(x, rng.standard_normal(rows * hidden).astype(np.float32), stream)
    rt.copy_h2d(weight, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), stream)
    rt.synchronize(stream)

    def launch(name: str) -> None:
        kernel = kernels[name]
        blocks = min(-(-rows // kernel.meta.get("rows", 1)), kernel.meta["blocks"])
        kernel.launch((blocks,), (kernel.meta["threads"],), (out, x, weight, rows, hidden, 1e-6), stream)

    moved = rows * hidden * (4 + 2)  # bytes: x read, the bf16 result written
    for _ in range(args.rounds):
        for name in KERNELS:
            ms = time_ms(device, stream, lambda: launch(name), args.loops)  # after one warm-up launch
            print(f"{name}: {ms * 1e3:.1f} us a norm, {moved / ms / 1e9:.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
