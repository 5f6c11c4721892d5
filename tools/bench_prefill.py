"""Prefill throughput and time to first token of the CUDA backend, next to transformers on the same card.

    python tools/bench_prefill.py [--tokens 8192] [--chunks 512,1024,2048,4096,8192] [--peer eager|none]

Qwen3-8B shape, random bf16 weights made on the GPU (our fill kernel), bf16 KV pool, cuBLASLt
prefill GEMMs. The prompt is fed as the engine feeds it: ``PrefillChunk``s of ``--prefill-chunk``
tokens (``--prefill-chunk`` of ``ninfer serve``), each over the prefix before it, the first token
sampled after the last; the runner splits each chunk into sub-chunks of ``max_prefill_rows`` rows
(set to the chunk here). Prints, per chunk size, tok/s for the whole prompt (median of ``--reps``,
each pass after ``--pause`` seconds of an idle GPU; the peer's forward is timed the same way),
the share of that time spent in attention (the same prefill with the attention launches left out),
TTFT of a 512-token prompt, and transformers eager's forward of the same prompt measured in this run.
``--tune`` times each chunk size twice, passes alternating: with cuBLASLt's first picks and with the
algorithms ``CudaRunner.tune_prefill_gemms`` chose for that many rows (tuned here at any size; ``ninfer
serve`` tunes chunks of ``TUNE_MIN_ROWS`` or more). ``--tune-passes`` times every algorithm of every GEMM
by whole prefills instead (slow, and a pass varies by about 1%); both launch kernel by kernel (a
graph would be captured again at every switch of algorithm). Chunks of the size timed replay the
prefill graph where ``ninfer serve``'s whole chunks of that size would (``CudaRunner.graph_prefill_rows``,
``PREFILL_GRAPH_MAX_ROWS``); ``--graph-ablation`` times each chunk size with and without one, passes
alternating; ``--outputs-ablation`` as the runner runs the sub-chunks (those in a prompt's middle
stopping at the last layer's K/V append, the one that samples running its last layer past it for its
last row alone) and with every sub-chunk computing every row's hidden states.
``--profile`` adds where one prefill's device time goes (in chunks of the largest ``--chunks``): every
kernel recorded by CUPTI (torch.profiler), summed by kernel name, and the device's idle time between
kernels, by the kernel that ended each idle stretch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_bench import PAGE, QWEN3_8B, bench_peer_eager  # noqa: E402

from ninfer.backends.cuda import runtime as rt  # noqa: E402
from ninfer.backends.cuda.random_weights import random_device_weights  # noqa: E402
from ninfer.backends.runner import PrefillChunk, SamplingRow  # noqa: E402


def feed_prompt(runner, tokens: int, chunk: int) -> None:
    """Prefill a ``tokens``-token prompt in chunks of ``chunk`` and sample the first token."""
    prompt = (np.arange(tokens) * 7919 % QWEN3_8B.vocab_size).astype(np.int32)
    table = np.arange(runner.buffers.max_pages, dtype=np.int32)
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        runner.prefill(PrefillChunk(lane=0, tokens=prompt[start:end], start=start, page_table=table,
                                    sample=SamplingRow() if end == tokens else None))


def prefill_seconds(runner, tokens: int, chunk: int, reps: int, pause: float = 0.0) -> float:
    """Median wall time to prefill ``tokens`` in chunks of ``chunk`` and sample the first token, each
    pass after ``pause`` seconds of an idle GPU (the peer is timed the same way: passes back to back
    and passes after a pause can run at different clocks); the first pass, untimed, plans cuBLASLt
    for these row counts."""
    return alternating(runner, tokens, chunk, reps, pause, {"": lambda: None})[""]


def alternating(runner, tokens: int, chunk: int, reps: int, pause: float, variants: dict) -> dict[str, float]:
    """Median seconds of a prefill under each of ``variants`` (name: a function that sets the runner
    up), passes alternating between them, one untimed pass of each first."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps + 1):
        for name, apply in variants.items():
            apply()
            time.sleep(pause)
            t0 = time.perf_counter()
            feed_prompt(runner, tokens, chunk)
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


@contextlib.contextmanager
def launched(runner):
    """Context: every prefill pass launched kernel by kernel (no prefill graph), as before afterwards."""
    was, runner.graph_prefill_rows = runner.graph_prefill_rows, None
    try:
        yield
    finally:
        runner.graph_prefill_rows = was


def graph_against_launches(runner, tokens: int, chunk: int, reps: int, pause: float) -> dict[str, float]:
    """Median seconds of a prefill in chunks of ``chunk``, each chunk replaying the prefill graph or
    launched kernel by kernel, passes alternating."""
    def rows(graph_rows):
        return lambda: setattr(runner, "graph_prefill_rows", graph_rows)

    with launched(runner):
        return alternating(runner, tokens, chunk, reps, pause, {"graph": rows(chunk), "launches": rows(None)})


def every_row_out(runner, on: bool) -> None:
    """With ``on``, every prefill sub-chunk's pass computes every row's hidden states, as before the
    runner ran its last layer past the K/V append only for the rows it reads (``Forward.layers``'
    ``outputs``); off, the runner's own choice again."""
    vars(runner).pop("_prefill_layers", None)
    if on:
        layers = runner._prefill_layers
        runner._prefill_layers = lambda rows, stream, outputs="all": layers(rows, stream, "all")


def needed_against_every_row(runner, tokens: int, chunk: int, reps: int, pause: float) -> dict[str, float]:
    """Median seconds of a prefill in chunks of ``chunk``: as the runner runs it and with
    ``every_row_out``, passes alternating."""
    try:
        return alternating(runner, tokens, chunk, reps, pause, {"runner": lambda: every_row_out(runner, False),
                                                                "every_row": lambda: every_row_out(runner, True)})
    finally:
        every_row_out(runner, False)


def print_alternation(seconds: dict[str, float], tokens: int) -> None:
    """One line of an alternation's medians (``alternating``): ms and tok/s of each variant."""
    print("    " + ", ".join(f"{name} {s * 1e3:.1f} ms = {tokens / s:.0f} tok/s" for name, s in seconds.items()),
          flush=True)


def tuned_against_first(runner, tokens: int, chunk: int, reps: int, pause: float) -> dict:
    """Tune the prefill GEMMs of ``chunk`` rows, then time passes alternately with the heuristic's first
    algorithms and the tuned ones: median seconds of each."""
    with launched(runner):
        return _tuned_against_first(runner, tokens, chunk, reps, pause)


def _tuned_against_first(runner, tokens: int, chunk: int, reps: int, pause: float) -> dict:
    tuning = runner.tune_prefill_gemms(chunk, min_rows=0)
    lt = runner.forward.lt
    tuned = lt.chosen()
    first = {key: 0 for key in tuned}
    medians = alternating(runner, tokens, chunk, reps, pause,
                          {"first": lambda: lt.choose_all(first), "tuned": lambda: lt.choose_all(tuned)})
    lt.choose_all(tuned)
    return {"tuning": tuning, **medians}


def algorithms_by_passes(runner, tokens: int, chunk: int, reps: int, pause: float) -> dict:
    """Each algorithm of each prefill GEMM of ``chunk`` rows timed by whole prefills: that GEMM on that
    algorithm, every other on the heuristic's first pick, passes alternating with all-first passes.
    Returns, by shape, each algorithm's median pass time over the all-first median (1.0: level)."""
    with launched(runner):
        return _algorithms_by_passes(runner, tokens, chunk, reps, pause)


def _algorithms_by_passes(runner, tokens: int, chunk: int, reps: int, pause: float) -> dict:
    runner.tune_prefill_gemms(chunk, min_rows=0)  # plans of the heuristic's first TUNE_CHOICES algorithms
    lt = runner.forward.lt
    first = {key: 0 for key in lt.chosen()}

    def one(key, index):
        lt.choose_all(first)
        lt.choose(*key, index)

    ratios = {}
    for key in (key for key in first if key[0] == chunk):
        ratios[f"{key[0]}x{key[2]}x{key[1]}"] = found = []
        for index in range(lt.algorithms(*key)):
            m = alternating(runner, tokens, chunk, reps, pause,
                            {"first": lambda: lt.choose_all(first), "one": lambda: one(key, index)})
            found.append(round(m["one"] / m["first"], 4))
    lt.choose_all(first)
    return ratios


@contextlib.contextmanager
def without_attention(runner):
    """Context: the runner's prefill attention launches skipped (their share of the prefill time);
    passes launched kernel by kernel, since a graph would still launch it."""
    forward = runner.forward
    with launched(runner):
        # no launch; the output buffer it would have written
        forward.prefill_attention = lambda kv, rows, stream, bf16=False, first=0: forward.b.x_bf16 if bf16 else forward.b.attn
        try:
            yield
        finally:
            del forward.prefill_attention


def kernel_profile(runner, tokens: int, chunk: int) -> dict:
    """Device time of one prefill by kernel name (CUPTI through torch.profiler): us and launches."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        feed_prompt(runner, tokens, chunk)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "prefill.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    totals: dict[str, list[float]] = {}
    idle_before: dict[str, float] = {}  # device idle time ending at a kernel's start, by that kernel
    busy_until = None
    for e in sorted(events, key=lambda e: e["ts"]):
        entry = totals.setdefault(e["name"], [0.0, 0])
        entry[0] += e["dur"]
        entry[1] += 1
        if busy_until is not None and e["ts"] > busy_until:
            idle_before[e["name"]] = idle_before.get(e["name"], 0.0) + e["ts"] - busy_until
        busy_until = max(busy_until or 0.0, e["ts"] + e["dur"])
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    span_us = busy_until - min(e["ts"] for e in events)
    return {"wall_us": wall_us, "span_us": span_us, "busy_us": sum(us for us, _ in totals.values()),
            "kernels": {name: {"us": us, "launches": n} for name, (us, n) in ranked},
            "idle_us": sum(idle_before.values()),
            "idle_before": dict(sorted(idle_before.items(), key=lambda kv: -kv[1]))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunks", default="512,1024,2048,4096,8192")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--peer", choices=("eager", "none"), default="eager")
    parser.add_argument("--profile", action="store_true", help="where one prefill's device time goes, by kernel")
    parser.add_argument("--tune-passes", action="store_true",
                        help="each GEMM algorithm of each chunk size timed by whole prefills (slow)")
    parser.add_argument("--tune", action="store_true",
                        help="each chunk size also with its GEMM algorithms tuned, alternating with the first picks")
    parser.add_argument("--graph-ablation", action="store_true",
                        help="each chunk size also with whole chunks launched kernel by kernel, alternating with the graph")
    parser.add_argument("--outputs-ablation", action="store_true",
                        help="each chunk size also with every sub-chunk computing every row's hidden states, alternating")
    parser.add_argument("--pause", type=float, default=0.5,
                        help="seconds the GPU idles before each timed prefill, ours and the peer's alike")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import torch

    from ninfer.backends.cuda import CudaRunner

    torch.zeros(1, device="cuda")  # torch and NInfer share the device's primary context
    config = QWEN3_8B
    chunks = [int(c) for c in args.chunks.split(",")]
    max_context = args.tokens + PAGE
    device = rt.Device(0)
    ptrs, _ = random_device_weights(device, device.stream(), config)
    runner = CudaRunner.from_device_weights(config, ptrs, device=device, page_size=PAGE,
                                            num_pages=-(-max_context // PAGE), max_batch=1, max_context=max_context,
                                            kv_dtype="bf16", cuda_graph=False, max_prefill_rows=max(chunks),
                                            prefill_gemm="cublaslt")
    report: dict = {"device": device.name, "tokens": args.tokens, "prefill": []}
    print(f"{device.name}: prefill of {args.tokens} tokens, Qwen3-8B shape, bf16 KV, cuBLASLt GEMMs", flush=True)
    for chunk in chunks:
        # As ninfer serve prefills whole chunks of this size (decode graphs are not needed here).
        runner.graph_prefill_rows = chunk if chunk <= runner.PREFILL_GRAPH_MAX_ROWS else None
        seconds = prefill_seconds(runner, args.tokens, chunk, args.reps, args.pause)
        with without_attention(runner):
            rest = prefill_seconds(runner, args.tokens, chunk, 1, args.pause)  # timed as the full prefill
        r = {"chunk": chunk, "seconds": seconds, "tok_s": args.tokens / seconds,
             "attention_share": 1 - rest / seconds}
        report["prefill"].append(r)
        print(f"  chunks of {chunk}: {seconds * 1e3:.0f} ms = {r['tok_s']:.0f} tok/s "
              f"(attention {100 * r['attention_share']:.0f}%)", flush=True)
        if args.graph_ablation:
            r["graph_ablation"] = ab = graph_against_launches(runner, args.tokens, chunk, args.reps, args.pause)
            print_alternation(ab, args.tokens)
        if args.outputs_ablation:
            r["outputs_ablation"] = ab = needed_against_every_row(runner, args.tokens, chunk, args.reps, args.pause)
            print_alternation(ab, args.tokens)
        if args.tune:
            r["tune"] = ab = tuned_against_first(runner, args.tokens, chunk, args.reps, args.pause)
            print(f"    tuned in {ab['tuning']['seconds']} s, chose "
                  + ", ".join(f"{shape} #{g['chose']}" for shape, g in ab['tuning']['gemms'].items())
                  + f": first picks {ab['first'] * 1e3:.1f} ms = {args.tokens / ab['first']:.0f} tok/s, "
                  f"tuned {ab['tuned'] * 1e3:.1f} ms = {args.tokens / ab['tuned']:.0f} tok/s", flush=True)
            for shape, g in ab["tuning"]["gemms"].items():
                print(f"      {shape}: ms a call by algorithm {g['ms']}", flush=True)
        if args.tune_passes:
            r["tune_passes"] = by_passes = algorithms_by_passes(runner, args.tokens, chunk, args.reps, args.pause)
            for shape, ratios in by_passes.items():
                print(f"    {shape}: prefill time by algorithm over the first picks' {ratios}", flush=True)
    if args.profile:
        profile = report["profile"] = kernel_profile(runner, args.tokens, max(chunks))
        print(f"  device time by kernel (one prefill in chunks of {max(chunks)}): {profile['busy_us'] / 1e3:.1f} ms busy",
              flush=True)
        for name, e in list(profile["kernels"].items())[:16]:
            print(f"    {name[:60]:60s} {e['us'] / 1e3:8.2f} ms  {e['launches']:5d} launches", flush=True)
        print(f"  wall {profile['wall_us'] / 1e3:.1f} ms, first kernel start to last kernel end "
              f"{profile['span_us'] / 1e3:.1f} ms", flush=True)
        print(f"  device idle between kernels: {profile['idle_us'] / 1e3:.1f} ms; most before:", flush=True)
        for name, us in list(profile["idle_before"].items())[:5]:
            print(f"    {name[:60]:60s} {us / 1e3:8.2f} ms", flush=True)
    for tokens in (512, args.tokens):
        chunk = min(tokens, 1024)  # ninfer serve's default --prefill-chunk
        runner.graph_prefill_rows = 1024  # whose whole chunks replay the graph
        ttft = prefill_seconds(runner, tokens, chunk, args.reps, args.pause)
        report[f"ttft_{tokens}_ms"] = ttft * 1e3
        print(f"  TTFT {tokens} tokens (chunks of {chunk}): {ttft * 1e3:.1f} ms", flush=True)
    runner.close()  # frees the weights too (allocated on the runner's device)
    if args.peer == "eager":
        report["peer"] = bench_peer_eager(torch, config, batches=[], prompt=512, new_tokens=2, prefill=args.tokens,
                                          prefill_reps=args.reps, pause=args.pause)
        for r in report["peer"]:
            print("  peer", json.dumps(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
