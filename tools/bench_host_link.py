"""The host link a pause snapshot crosses: pinned host <-> device copy rates on this GPU.

    python3 tools/bench_host_link.py [--device 0] [--sizes 1,16,256] [--reps 5]

A snapshot copies a paused request's KV pages (and a hybrid's StateImage) to the pinned Host arena
and back (``ninfer/engine/context_cost.py``: 2 x bytes x seconds-per-byte). This times
``cuMemcpyDtoHAsync`` and ``cuMemcpyHtoDAsync`` between one pinned buffer and one device buffer of
each size in MiB (median of ``reps`` after a warm-up) and prints GB/s each way and the
seconds-per-byte of a round trip's average, the value of a ``transfer`` entry of
``--context-cost-presets`` (and of the compiled CUDA default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def timed(copy, stream, reps: int) -> float:
    from ninfer.backends.cuda import runtime as rt

    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        copy()
        rt.synchronize(stream)
        if i:  # the first faults in and warms the path
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--sizes", default="1,16,256", help="MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    from ninfer.backends.cuda import runtime as rt

    device = rt.Device(args.device)
    stream = device.stream()
    sizes = [int(s) << 20 for s in args.sizes.split(",")]
    host = device.pinned(max(sizes))
    host[:] = 1
    dev = device.alloc(max(sizes), "link")
    print(f"{device.name}: pinned host <-> device, median of {args.reps}")
    for nbytes in sizes:
        d2h = timed(lambda: rt.copy_d2h(host[:nbytes], dev, stream), stream, args.reps)
        h2d = timed(lambda: rt.copy_h2d(dev, host[:nbytes], stream), stream, args.reps)
        per_byte = (d2h + h2d) / (2 * nbytes)
        print(f"{nbytes >> 20:5d} MiB: device->host {nbytes / d2h / 1e9:6.1f} GB/s, host->device "
              f"{nbytes / h2d / 1e9:6.1f} GB/s; seconds_per_byte {per_byte:.3e}")
    device.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
