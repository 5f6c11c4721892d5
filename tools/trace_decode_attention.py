"""Where ``decode_attention``'s time goes inside a captured decode step: a traced build of the kernel.

    python3 tools/trace_decode_attention.py --build DIR        # here (NVVM 13.0): traced PTX + manifest
    python3 tools/trace_decode_attention.py --ptx DIR [--cases 1x512,8x512] [--overlap yes|no]   # on the GPU

The traced variant (``make_decode_attention(..., TRACE=True)``) takes one more parameter, a uint64 array
where thread 0 of every block stamps ``%globaltimer`` at ``TRACE_POINTS``. The decode step of the
Qwen3-8B shape (random weights, as tools/bench_decode_step.py) is captured with each layer's attention
launch swapped for the traced kernel writing its own array, replayed, and the stamps of the last replay
are read back. Times are microseconds after the layer's first block left its grid wait (about when the
q/k/v GEMM finished), the largest over blocks (the critical path) and the median; layer 0 is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from numba_kernels.decode_attention import TRACE_POINTS  # noqa: E402

KERNEL = "decode_attention_g4_d128_bf16"  # Qwen3-8B: groups of 4, head_dim 128, bf16 pool


def build(directory: Path) -> None:
    from numba_kernels import build as nb
    from numba_kernels import decode_attention as da
    from numba_kernels.common import U64P

    nb._compile_without_gpu()
    func = da.make_decode_attention(4, 128, "bf16", TRACE=True)
    ptx, params = nb.compile_one(KERNEL, func, (*da.signature("bf16"), U64P))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{KERNEL}.ptx").write_text(ptx)
    meta = {"threads": 32 * da.TC_WARPS, "grid_wait": 1}
    manifest = {"kernels": {KERNEL: {"file": f"{KERNEL}.ptx", "symbol": f"ninfer_{KERNEL}", "params": params,
                                     "meta": meta}}}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"wrote the traced {KERNEL} to {directory}")


def capture_traced(runner, batch: int, traced, rt):
    """The decode graph, at the attention depth the runner would pick for the inputs in place, with
    every attention launch given its own stamp array; returns (graph, arrays)."""
    c, inp = runner.forward.c, runner.buffers.inputs
    depth = runner.forward.decode_depth(int(inp.split[0]), int(inp.positions[:batch].max()) + 1)
    blocks = c.num_kv_heads * batch * depth
    free = [runner.device.alloc(blocks * len(TRACE_POINTS) * 8, "trace") for _ in range(c.num_layers)]
    arrays = []  # no allocations while capturing
    launch = rt.Kernel.launch

    seen = set()

    def swap(self, grid, block, args, stream, shared=None):
        seen.add(self.name)
        if self.name != KERNEL:
            return launch(self, grid, block, args, stream, shared)
        assert grid[0] * grid[1] * grid[2] == blocks
        arrays.append((free.pop(0), blocks))
        return launch(traced, grid, block, (*args, arrays[-1][0]), stream, shared)

    rt.Kernel.launch = swap
    try:
        graph = rt.Graph.capture(runner.stream, lambda: runner.forward.decode(batch, runner.stream, depth))
    finally:
        rt.Kernel.launch = launch
    if not arrays:
        raise RuntimeError(f"the step never launched {KERNEL}; it launched {sorted(seen)}")
    for unused in free:
        runner.device.free(unused)
    for stamps, blocks in arrays:  # points a block never reaches stay 0
        rt.memset32(stamps, 0, blocks * len(TRACE_POINTS) * 2, runner.stream)
    return graph, arrays


def summarize(stamps: list[np.ndarray]) -> dict[str, tuple[float, float]]:
    """Per point: (largest, median) microseconds after the layer's first block left its wait. Only
    stamps of the last replay count: the block that merges a row's splits changes between replays,
    so a merge stamp may be left over from an earlier one (older than every start of this one)."""
    rows = {p: ([], []) for p in TRACE_POINTS}
    for layer in stamps[1:]:
        zero, first = int(layer[:, 2].min()), layer[:, 0].min()
        for i, point in enumerate(TRACE_POINTS):
            t = layer[:, i][layer[:, i] >= first].astype(np.int64) - zero
            if t.size:
                rows[point][0].append(t.max() / 1e3)
                rows[point][1].append(np.median(t) / 1e3)
    return {p: (float(np.mean(a)), float(np.mean(b))) for p, (a, b) in rows.items() if a}


def run(directory: Path, cases: str, overlap: bool, reps: int) -> None:
    from ninfer.backends.cuda import CudaRunner
    from ninfer.backends.cuda import runtime as rt
    from ninfer.backends.cuda.random_weights import random_device_weights
    from ninfer.backends.runner import DecodeBatch, SamplingRow
    from tools.gpu_bench import PAGE, QWEN3_8B

    device = rt.Device(0)
    stream = device.stream()
    ptrs, _ = random_device_weights(device, stream, QWEN3_8B)
    parsed = [tuple(int(v) for v in c.split("x")) for c in cases.split(",")]
    max_batch, max_context = max(b for b, _ in parsed), max(c for _, c in parsed) + 64
    max_pages = -(-max_context // PAGE)
    runner = CudaRunner.from_device_weights(QWEN3_8B, ptrs, device=device, page_size=PAGE,
                                            num_pages=max_batch * max_pages, max_batch=max_batch,
                                            max_context=max_context, cuda_graph=False)
    runner.forward.overlap = overlap
    traced_kernels = rt.Kernels(device, directory)
    traced_kernels.overlap = runner.kernels.overlap  # launched inside the runner's overlapped regions
    traced = traced_kernels[KERNEL]
    for entry in runner.kernels.entries:  # module loads are not allowed during capture
        if entry.startswith(("mma_gemv_", "gemv_", "rmsnorm", "add_rmsnorm", "decode_attention", "sampl")):
            runner.kernels[entry]
    for batch, context in parsed:
        tables = np.stack([np.arange(max_pages) + lane * max_pages for lane in range(batch)]).astype(np.int32)
        runner.decode(DecodeBatch(lanes=np.arange(batch, dtype=np.int32), tokens=np.full(batch, 7, np.int32),
                                  positions=np.full(batch, context, np.int32), page_tables=tables,
                                  sampling=[SamplingRow()] * batch))  # leaves the step inputs in place
        graph, arrays = capture_traced(runner, batch, traced, rt)
        for _ in range(reps):
            graph.launch(stream)
        rt.synchronize(stream)
        stamps = []
        for ptr, blocks in arrays:
            host = np.empty((blocks, len(TRACE_POINTS)), np.uint64)
            rt.check(rt.cu.cuMemcpyDtoH(host.ctypes.data, ptr.addr, host.nbytes), "cuMemcpyDtoH")
            stamps.append(host)
            device.free(ptr)
        graph.destroy()
        period = np.mean([(b[:, 2][b[:, 2] > 0].min() - a[:, 2][a[:, 2] > 0].min()) / 1e3
                          for a, b in zip(stamps[1:], stamps[2:])])
        print(f"b={batch} ctx={context} splits of {int(runner.buffers.inputs.split[0])}, overlap={overlap}: "
              f"layer period {period:.2f} us; us after the first block's wait (max / median over blocks):")
        for point, (top, median) in summarize(stamps).items():
            print(f"  {point:8s} {top:8.2f} {median:8.2f}")
    runner.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, help="write the traced kernel's PTX and manifest here")
    parser.add_argument("--ptx", type=Path, help="run with the traced kernel from here (GPU)")
    parser.add_argument("--cases", default="1x512,8x512")
    parser.add_argument("--overlap", choices=("yes", "no"), default="yes")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.build:
        build(args.build)
    if args.ptx:
        run(args.ptx, args.cases, args.overlap == "yes", args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
