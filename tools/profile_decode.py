"""Where a decode step's device time goes: every kernel of the captured CUDA Graph, timed by CUPTI.

    python3 tools/profile_decode.py [--model 8b|27b|a3b] [--cases 1x512,8x512] [--reps 5] [--overlap yes|no]
                                    [--enable chain_norm|moe.fold_route|rule_splits=4|moe.routed_gate_up=NAME,...]
                                    [--trace DIR]

Qwen3-8B shape with random bf16 weights (as tools/gpu_bench.py), or a hybrid shape of
tools/gpu_bench_hybrid.py (``--model 27b|a3b``). For each (batch x context) case the
decode step is captured as a CUDA Graph and replayed under torch.profiler, whose CUPTI trace holds each
kernel node's start and end (torch shares our primary context; it only observes). Prints, per role in
the step (each decode GEMM by its matrix and shape, every other kernel by name): microseconds a step, per
launch, and for the GEMMs the weight bytes over kernel time; then the step's span, the sum of kernel
times and the idle time between consecutive kernels (negative: kernels overlapped). "Advances the
step" is how far each role's kernels moved the step's latest end: with overlapped launches a kernel's
own time counts its wait for the one before, so this is its share of the critical path (the shares
add up to the span). ``--trace`` keeps the Chrome traces.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.backends.cuda import runtime as rt  # noqa: E402
from ninfer.backends.cuda.forward import Forward  # noqa: E402
from ninfer.backends.cuda.random_weights import random_device_weights  # noqa: E402
from ninfer.backends.runner import DecodeBatch, SamplingRow  # noqa: E402
from tools.gpu_bench import PAGE, QWEN3_8B  # noqa: E402


def capture_with_roles(runner, batch: int):
    """The decode graph of ``batch`` rows and, per kernel node in launch order, (role, weight bytes)."""
    roles: list[tuple[str, int]] = []
    current: list = [None]
    launch, decode_gemm = rt.Kernel.launch, Forward.decode_gemm

    def record(self, grid, block, args, stream, shared=None):
        roles.append(current[0] or (self.name, 0))
        current[0] = None
        launch(self, grid, block, args, stream, shared)

    def gemm(self, matrix, y, x, w, rows, n, k, stream, *args, **kwargs):
        weight_rows = 2 * n if matrix == "gate_up" else n
        current[0] = (f"gemm {matrix} [{weight_rows} x {k}]", weight_rows * k * 2)
        decode_gemm(self, matrix, y, x, w, rows, n, k, stream, *args, **kwargs)

    rt.Kernel.launch, Forward.decode_gemm = record, gemm
    try:
        graph = rt.Graph.capture(runner.stream, lambda: runner.forward.decode(batch, runner.stream))
    finally:
        rt.Kernel.launch, Forward.decode_gemm = launch, decode_gemm
    return graph, roles


def profile_case(runner, batch: int, reps: int, trace: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    graph, roles = capture_with_roles(runner, batch)
    graph.launch(runner.stream)  # warm
    rt.synchronize(runner.stream)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.launch(runner.stream)
        rt.synchronize(runner.stream)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    graph.destroy()
    events = sorted((e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"),
                    key=lambda e: e["ts"])
    if len(events) != reps * len(roles):
        raise RuntimeError(f"trace holds {len(events)} kernels, expected {reps} x {len(roles)}")
    per_role: dict[str, list[float]] = defaultdict(list)
    advances: dict[str, float] = defaultdict(float)
    bytes_of: dict[str, int] = {}
    gaps, spans = [], []
    for step in range(reps):
        chunk = events[step * len(roles):(step + 1) * len(roles)]
        frontier = chunk[0]["ts"]  # the latest end so far: what the step has finished
        for (role, nbytes), event in zip(roles, chunk):
            per_role[role].append(event["dur"])
            bytes_of[role] = nbytes
            end = event["ts"] + event["dur"]
            advances[role] += max(0.0, end - frontier)
            frontier = max(frontier, end)
        gaps.append(sum(b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(chunk, chunk[1:])))
        spans.append(chunk[-1]["ts"] + chunk[-1]["dur"] - chunk[0]["ts"])
    report = {"span_us": float(np.mean(spans)), "gaps_us": float(np.mean(gaps)), "kernels": len(roles), "roles": {}}
    report["busy_us"] = sum(sum(v) for v in per_role.values()) / reps
    for role, durations in sorted(per_role.items(), key=lambda kv: -sum(kv[1])):
        launches = len(durations) // reps
        entry = {"us_per_step": sum(durations) / reps, "launches": launches, "us_per_launch": float(np.mean(durations)),
                 "advance_us_per_step": advances[role] / reps}
        if bytes_of[role]:
            entry["gb_s"] = bytes_of[role] / (entry["us_per_launch"] * 1e-6) / 1e9
        report["roles"][role] = entry
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("8b", "27b", "a3b"), default="8b")
    parser.add_argument("--cases", default="1x512,8x512")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--overlap", choices=("yes", "no"), default="yes")
    parser.add_argument("--enable", default="", help="options of the runner's forward to switch on (or set, "
                        "OPTION=N) first, "
                        "comma-separated attribute paths (chain_norm, moe.fold_route, moe.fold_combine)")
    parser.add_argument("--trace", type=Path, help="directory for the Chrome traces")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import torch

    from ninfer.backends.cuda import CudaRunner

    torch.zeros(1, device="cuda")  # torch's CUPTI and our launches share the primary context
    device = rt.Device(0)
    stream = device.stream()
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    max_batch, max_context = max(b for b, _ in cases), max(c for _, c in cases) + 64
    max_pages = -(-max_context // PAGE)
    shape = dict(device=device, page_size=PAGE, num_pages=max_batch * max_pages, max_batch=max_batch,
                 max_context=max_context, cuda_graph=False)
    if args.model == "8b":
        ptrs, _ = random_device_weights(device, stream, QWEN3_8B)
        runner = CudaRunner.from_device_weights(QWEN3_8B, ptrs, **shape)
    else:
        from ninfer.backends.cuda.hybrid_runner import CudaHybridRunner
        from tools.gpu_bench_hybrid import MODELS, random_weights

        config = MODELS[args.model]
        tensors = random_weights(config, torch)  # kept alive until the runner closes
        ptrs = {n: rt.DevicePtr(t.data_ptr(), t.numel() * t.element_size(), n) for n, t in tensors.items()}
        runner = CudaHybridRunner.from_device_weights(config, ptrs, state_slots=1, **shape)
    runner.forward.overlap = args.overlap == "yes"
    for setting in filter(None, args.enable.split(",")):
        path, _, number = setting.partition("=")
        *owners, option = path.split(".")
        target = runner.forward
        for owner in owners:
            target = getattr(target, owner)
        value = getattr(target, option)
        if isinstance(value, bool) and not number:
            setattr(target, option, True)
        elif isinstance(value, int) and not isinstance(value, bool) and number.isdigit():
            setattr(target, option, int(number))
        elif isinstance(value, float) and number:
            setattr(target, option, float(number))
        elif number and (value is None or isinstance(value, str)):  # a kernel's name
            setattr(target, option, number)
        else:
            raise SystemExit(f"--enable {setting}: not an on/off option (OPTION), a number (OPTION=N) or a kernel "
                             "(OPTION=NAME) of the forward")
    for name in runner.forward.kernel_names():  # module loads are not allowed during capture
        runner.kernels[name]
    trace_dir = args.trace or Path(tempfile.mkdtemp())
    trace_dir.mkdir(parents=True, exist_ok=True)
    reports = {}
    for batch, context in cases:
        if hasattr(runner, "states"):  # a hybrid: trust whatever the lanes' StateImages hold
            runner.states.length[:] = -1
        tables = np.stack([np.arange(max_pages) + lane * max_pages for lane in range(batch)]).astype(np.int32)
        runner.decode(DecodeBatch(lanes=np.arange(batch, dtype=np.int32), tokens=np.full(batch, 7, np.int32),
                                  positions=np.full(batch, context, np.int32), page_tables=tables,
                                  sampling=[SamplingRow()] * batch))  # leaves the step inputs in place
        r = reports[f"{batch}x{context}"] = profile_case(runner, batch, args.reps, trace_dir / f"b{batch}_c{context}.json")
        print(f"b={batch} ctx={context} overlap={args.overlap}: span {r['span_us']:.0f} us, kernels {r['busy_us']:.0f} us, "
              f"between kernels {r['gaps_us']:.0f} us ({r['kernels']} kernels)", flush=True)
        for role, e in r["roles"].items():
            rate = f", {e['gb_s']:.0f} GB/s" if "gb_s" in e else ""
            print(f"  {role:40s} {e['us_per_step']:8.1f} us/step  {e['launches']:3d} x {e['us_per_launch']:7.2f} us{rate}"
                  f"; advances the step {e['advance_us_per_step']:.1f} us", flush=True)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
