"""Device time of the sampler (``sample_partial`` then ``sample``), greedy and sampled rows, alone.

    python3 tools/bench_sampler.py [--vocab 151936] [--rows 1,8] [--reps 200] [--ptx DIR]

Random logits, no penalties; sampled rows are temperature 1, top_p 0.95 and the top-k cap of 20
(what tools/gpu_bench.py's sampled decode uses). ``--ptx`` loads the kernels from another build
(an earlier ptx/ directory) to compare two versions on one GPU in one session.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.backends.cuda import runtime as rt  # noqa: E402
from tools.gpu_bench import replay_ms  # noqa: E402


def time_sampler(device, kernels, stream, vocab: int, rows: int, temperature: float, reps: int) -> float:
    """Microseconds of one (sample_partial, sample) pair over ``rows`` rows."""
    meta = kernels["sample"].meta
    threads = meta["threads"]
    parts = max(1, min(meta["max_parts"], -(-vocab // threads)))
    logits = (np.random.default_rng(rows).standard_normal((rows, vocab)) * 2).astype(np.float32)
    fparams = np.tile(np.array([temperature, 0.95, 0.0, 0.0, 0.0], np.float32), rows)
    iparams = np.array([v for lane in range(rows) for v in (0, lane)], np.int32)
    keys = np.array([v for lane in range(rows) for v in (lane + 1, 3)], np.uint64)
    buffers = {}
    for name, array in (("logits", logits), ("counts", np.zeros((rows, vocab), np.int32)), ("fparams", fparams),
                        ("iparams", iparams), ("keys", keys)):
        buffers[name] = device.alloc(array.nbytes, name)
        rt.copy_h2d(buffers[name], np.ascontiguousarray(array), stream)
    slots = rows * parts * meta["top_k_cap"] * 4
    part_v, part_i, out = device.alloc(slots, "part_v"), device.alloc(slots, "part_i"), device.alloc(rows * 4, "out")
    b = buffers

    def step():
        kernels["sample_partial"].launch((parts, rows), (threads,), (part_v, part_i, b["logits"], b["counts"],
                                                                     b["fparams"], b["iparams"], vocab, parts), stream)
        kernels["sample"].launch((rows,), (threads,), (out, part_v, part_i, b["fparams"], b["iparams"], b["keys"],
                                                        vocab, parts), stream)

    graph = rt.Graph.capture(stream, step)  # replayed: launch costs out of the figure
    us = replay_ms(graph, device, stream, reps) * 1e3
    graph.destroy()
    return us


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--ptx", type=Path, default=rt.PTX_DIR)
    args = parser.parse_args(argv)
    device = rt.Device(0)
    stream = device.stream()
    kernels = rt.Kernels(device, args.ptx)
    for rows in (int(r) for r in args.rows.split(",")):
        greedy = time_sampler(device, kernels, stream, args.vocab, rows, 0.0, args.reps)
        sampled = time_sampler(device, kernels, stream, args.vocab, rows, 1.0, args.reps)
        print(f"{args.ptx}: rows {rows}, vocab {args.vocab}: greedy {greedy:.1f} us, sampled {sampled:.1f} us",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
