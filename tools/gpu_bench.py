"""Benchmark of the CUDA backend on a Qwen3-8B-shaped model with random bf16 weights made on the GPU.

    python tools/gpu_bench.py [--json OUT.json] [--steps 32] [--prefill 8192] [--ttft 512,8192]
                              [--peer eager|compile|none] [--peer-batches 1,8]

Prints, all measured in this one run on this one card: device-to-device copy bandwidth (the
roofline's denominator), decode tok/s at batch 1/4/8 for contexts 512 and 8192 (CUDA Graph replay),
achieved GB/s and % of roofline (weights + KV bytes read per step / copy bandwidth), host time and
host CPU per step, the GEMV alone, with ``--ablation`` the step time with each kernel family left
out of the graph, prefill tok/s for one prompt, time to first token (prefill + first sample through
the runner) for each ``--ttft`` prompt, and the Hugging Face transformers eager peer. ``--peer
compile`` instead runs only transformers' static cache + torch.compile fast path (its compile takes
50-80 s per batch size, so it gets a run of its own).
The random weights are made on the GPU by our fill kernel (ninfer/backends/cuda/random_weights.py);
torch only runs the peer; NInfer itself runs through cuda.bindings and our PTX. KV contents are
whatever the pool holds (zeros at start): our kernels' time does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.backends.cuda import runtime as rt  # noqa: E402
from ninfer.backends.cuda.random_weights import random_device_weights  # noqa: E402
from ninfer.backends.runner import DecodeBatch, SamplingRow  # noqa: E402
# The measurements `ninfer bench backend` shares (torch-free); the other tools import them from here too.
from ninfer.commands.runner_timing import (ENGINE_STEPS, PAGE, bench_decode, bench_engine,  # noqa: E402,F401
                                           bench_prefill, bench_ttft, copy_bandwidth, replay_ms,
                                           weight_bytes_per_step)
from ninfer.convert.random_model import LARGE_PRESETS  # noqa: E402
from ninfer.models.dense import DenseConfig  # noqa: E402

QWEN3_8B = LARGE_PRESETS["qwen3-8b"]


def host_phases(runner, batch: int, context: int, steps: int = 64) -> dict[str, float]:
    """Median microseconds of one ``runner.decode`` call and of its host phases: the input checks
    (``decode_inputs``), the graph launch call, the wait for the device (the step's device time
    included), and the rest (context switch, filling the pinned inputs, the result)."""
    from ninfer.backends.cuda import runner as runner_module

    max_pages = runner.buffers.max_pages
    tables = np.stack([np.arange(max_pages) + lane * max_pages for lane in range(batch)]).astype(np.int32)
    phases: dict[str, list[int]] = {"checks": [], "launch": [], "wait": []}
    patched = [(runner_module, "decode_inputs", "checks"), (rt.Graph, "launch", "launch"), (rt, "wait_event", "wait")]
    originals = [getattr(owner, name) for owner, name, _ in patched]

    def timed(fn, label):
        def call(*args, **kwargs):
            t0 = time.perf_counter_ns()
            result = fn(*args, **kwargs)
            phases[label].append(time.perf_counter_ns() - t0)
            return result
        return call

    for (owner, name, label), fn in zip(patched, originals):
        setattr(owner, name, timed(fn, label))
    totals, tokens = [], np.full(batch, 7, np.int32)
    try:
        for step in range(steps):
            batch_in = DecodeBatch(lanes=np.arange(batch, dtype=np.int32), tokens=tokens,
                                   positions=np.full(batch, context + step, np.int32), page_tables=tables,
                                   sampling=[SamplingRow()] * batch)
            t0 = time.perf_counter_ns()
            tokens = runner.decode(batch_in).tokens
            totals.append(time.perf_counter_ns() - t0)
    finally:
        for (owner, name, _), fn in zip(patched, originals):
            setattr(owner, name, fn)
    out = {label: float(np.median(v[4:])) / 1e3 for label, v in phases.items()}
    out["step"] = float(np.median(totals[4:])) / 1e3
    out["other"] = out["step"] - out["checks"] - out["launch"] - out["wait"]
    return out


def profile_decode(runner, batch: int) -> dict[str, float]:
    """Device microseconds per kernel name for one eager decode step (events around each launch)."""
    dev, stream = runner.device, runner.stream
    marks = []
    original = rt.Kernel.launch

    def timed(self, grid, block, args, stream_, shared=None):
        start, stop = dev.event(timing=True), dev.event(timing=True)
        rt.check(rt.cu.cuEventRecord(start, stream_), "cuEventRecord")
        original(self, grid, block, args, stream_, shared)
        rt.check(rt.cu.cuEventRecord(stop, stream_), "cuEventRecord")
        marks.append((self.name, start, stop))

    rt.Kernel.launch = timed
    try:
        runner.forward.decode(batch, stream)
    finally:
        rt.Kernel.launch = original
    rt.synchronize(stream)
    totals: dict[str, float] = {}
    for name, start, stop in marks:
        ms = rt.check(rt.cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime")
        totals[name] = totals.get(name, 0.0) + ms * 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


ABLATIONS = {
    "attention": ("attention_g", "attention_combine", "decode_attention"),
    "norms": ("rmsnorm", "add_rmsnorm"),
    "rope_kv": ("rope_kv",),
    "silu_mul": ("silu_mul",),
    "gemv": ("gemv_", "mma_gemv"),  # the fp32 GEMVs (fused or not) and the tensor-core decode GEMM
    "sample+count": ("sample", "count_tokens"),
}


def ablate(runner, batch: int, context: int, reps: int = 20, families: dict | None = None) -> dict[str, float]:
    """GPU ms per decode step with each kernel family (``families``: name -> kernel name prefixes,
    by default ABLATIONS) left out of the graph (METHOD.md's leave-one-out timing); the difference to
    "full" is that family's share of the step."""
    max_pages = runner.buffers.max_pages
    tables = np.stack([np.arange(max_pages) + lane * max_pages for lane in range(batch)]).astype(np.int32)
    runner.decode(DecodeBatch(lanes=np.arange(batch, dtype=np.int32), tokens=np.full(batch, 7, np.int32),
                              positions=np.full(batch, context, np.int32), page_tables=tables,
                              sampling=[SamplingRow()] * batch))  # leaves the step inputs in place
    dev, stream = runner.device, runner.stream
    original = rt.Kernel.launch
    out = {}
    for name, prefixes in [("full", ())] + list((ABLATIONS if families is None else families).items()):
        def launch(self, *args, _prefixes=prefixes, **kwargs):
            if not self.name.startswith(_prefixes) or not _prefixes:
                original(self, *args, **kwargs)

        rt.Kernel.launch = launch
        try:
            graph = rt.Graph.capture(stream, lambda: runner.forward.decode(batch, stream))
        finally:
            rt.Kernel.launch = original
        out[name] = replay_ms(graph, dev, stream, reps)
        graph.destroy()
    return out


def bench_gemv(runner, weight: rt.DevicePtr, n: int, k: int, reps: int = 20) -> dict[str, float]:
    """GB/s of the decode GEMV alone on one [n, k] bf16 weight, for each row count M."""
    dev, stream = runner.device, runner.stream
    start, stop = dev.event(timing=True), dev.event(timing=True)
    out = {}
    b = runner.buffers
    for variant in ("", "_c4"):
        for rows in (1, 2, 4, 8):
            kernel = runner.kernels[f"gemv_m{rows}{variant}"]
            grid, block = (-(-n // kernel.meta["cols"]),), (kernel.meta["threads"],)
            args = (b.gate_up, b.h, weight, rows, n, k, n)
            kernel.launch(grid, block, args, stream)  # warm-up
            rt.check(rt.cu.cuEventRecord(start, stream), "cuEventRecord")
            for _ in range(reps):
                kernel.launch(grid, block, args, stream)
            rt.check(rt.cu.cuEventRecord(stop, stream), "cuEventRecord")
            rt.synchronize(stream)
            seconds = rt.check(rt.cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / 1e3 / reps
            out[f"gemv_m{rows}{variant}"] = round(n * k * 2 / seconds / 1e9)
    return out


def hf_model(torch, config: DenseConfig):
    """transformers' Qwen3 of the same shape, random bf16 weights on the GPU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf = Qwen3Config(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                     intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                     num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                     head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                     tie_word_embeddings=False, max_position_embeddings=40960)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(hf).eval()
    torch.set_default_dtype(torch.float32)
    return model


def bench_peer_compile(torch, config: DenseConfig, batches, prompt: int, new_tokens: int) -> list[dict]:
    """transformers' fast path: ``generate`` with a static KV cache compiles its decoding forward with
    torch.compile (mode "reduce-overhead": CUDA graphs) by itself and marks the cache's tensors as
    static inputs (compiling ``model.forward`` by hand instead lets the graphs overwrite the lazily
    made cache: "accessing tensor output of CUDAGraphs that has been overwritten"). The first
    generates per batch size compile (50-150 s), so they run as a warm-up."""
    from transformers import CompileConfig

    model = hf_model(torch, config)
    fast = {"cache_implementation": "static", "compile_config": CompileConfig(fullgraph=True, mode="reduce-overhead")}
    results = []
    with torch.no_grad():
        for batch in batches:
            ids = torch.randint(0, config.vocab_size, (batch, prompt), device="cuda")
            t0 = time.perf_counter()
            for _ in range(2):  # compile, then the CUDA graph recordings
                model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **fast)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            timings = {}
            for n in (1, new_tokens):
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **fast)
                torch.cuda.synchronize()
                timings[n] = time.perf_counter() - t0
            decode_s = (timings[new_tokens] - timings[1]) / (new_tokens - 1)
            results.append({"peer": "transformers static cache + torch.compile", "batch": batch, "context": prompt,
                            "tok_s": batch / decode_s, "ttft_ms": timings[1] * 1e3, "warmup_s": compile_s})
            print("peer", json.dumps(results[-1]), flush=True)  # each batch size as soon as it is known
    del model
    torch.cuda.empty_cache()
    return results


def bench_peer_eager(torch, config: DenseConfig, batches, prompt: int, new_tokens: int, prefill: int,
                     prefill_reps: int = 1, pause: float = 0.0) -> list[dict]:
    """transformers eager decode with its dynamic cache, random weights, same shape; and one forward
    over ``prefill`` tokens (``prefill_reps`` > 1: the median of that many, after a full-length
    warm-up, each after ``pause`` seconds of an idle GPU, as tools/bench_prefill.py times ours)."""
    model = hf_model(torch, config)
    results = []
    with torch.no_grad():
        for batch in batches:
            ids = torch.randint(0, config.vocab_size, (batch, prompt), device="cuda")
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
            t_prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            torch.cuda.synchronize()
            decode_s = (time.perf_counter() - t0 - t_prefill) / (new_tokens - 1)
            results.append({"peer": "transformers eager", "batch": batch, "context": prompt,
                            "tok_s": batch / decode_s})
        ids = torch.randint(0, config.vocab_size, (1, prefill), device="cuda")
        model(ids if prefill_reps > 1 else ids[:, :512])
        torch.cuda.synchronize()
        times = []
        for _ in range(prefill_reps):
            time.sleep(pause)
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        seconds = float(np.median(times))
        results.append({"peer": "transformers eager prefill", "tokens": prefill, "tok_s": prefill / seconds,
                        "reps": prefill_reps, "pause_s": pause})
    del model
    torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--contexts", default="512,8192")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--peer", choices=("eager", "compile", "none"), default="eager",
                        help="compile: only the transformers static-cache + torch.compile peer (its compile "
                             "takes 50-80 s per batch size, so it gets a run of its own)")
    parser.add_argument("--peer-batches", default="1,8", help="batch sizes of the peer")
    parser.add_argument("--ttft", default="512,8192", help="prompt lengths for time to first token ('' skips)")
    parser.add_argument("--ablation", action="store_true", help="leave-one-out timing of kernel families")
    args = parser.parse_args(argv)
    import torch

    from ninfer.backends.cuda import CudaRunner

    torch.zeros(1, device="cuda")  # torch and NInfer share the device's primary context
    if args.peer == "compile":
        peer = bench_peer_compile(torch, QWEN3_8B, [int(b) for b in args.peer_batches.split(",")], prompt=512,
                                  new_tokens=32)
        if args.json:
            args.json.write_text(json.dumps({"peer": peer}, indent=1))
        return 0
    device = rt.Device(0)
    stream = device.stream()
    report: dict = {"device": device.name, "sync": device.sync}
    report["copy_gb_s"] = copy_bandwidth(device, stream) / 1e9
    print(f"device {device.name}; copy bandwidth {report['copy_gb_s']:.0f} GB/s", flush=True)
    config = QWEN3_8B
    t0 = time.perf_counter()
    ptrs, fill = random_device_weights(device, stream, config)
    report["random_fill_s"] = fill.seconds
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    max_context = max(max(contexts) + max(args.steps, ENGINE_STEPS, 64) + 8, args.prefill, *(int(n) for n in args.ttft.split(",") if n))
    max_pages = -(-max_context // PAGE)
    runner = CudaRunner.from_device_weights(config, ptrs, device=device, page_size=PAGE,
                                            num_pages=max(batches) * max_pages, max_batch=max(batches),
                                            max_context=max_context, max_prefill_rows=512, prefill_gemm="cublaslt")
    report["startup"] = runner.startup
    report["setup_s"] = time.perf_counter() - t0
    print("startup", json.dumps(runner.startup), flush=True)
    report["decode"] = []
    for context in contexts:
        for batch in batches:
            r = bench_decode(runner, config, batch, context, args.steps, report["copy_gb_s"] * 1e9)
            report["decode"].append(r)
            print("decode b={batch} ctx={context}: {tok_s:.1f} tok/s, step {step_ms:.3f} ms (gpu {gpu_step_ms:.3f}, "
                  "host {host_ms:.3f}), {achieved_gb_s:.0f} GB/s, {pct_roofline:.1f}% of roofline "
                  "({roofline_tok_s:.0f} tok/s), host CPU {cpu_cores_busy:.2f} cores; pipelined {pipelined_tok_s:.1f} "
                  "tok/s, step {pipelined_step_ms:.3f} ms, {pipelined_pct_roofline:.1f}% of roofline, host CPU "
                  "{pipelined_host_cpu_ms:.3f} ms a step".format(**r), flush=True)
    report["engine"] = []
    for batch in sorted({min(batches), max(batches)}):
        for pipelined in (False, True):
            r = bench_engine(runner, batch, min(contexts), max(args.steps, ENGINE_STEPS), pipelined)
            report["engine"].append(r)
            print("engine-driven decode b={batch} ctx={context} pipelined={pipelined}: {tok_s:.1f} tok/s, step "
                  "{step_ms:.3f} ms (median {runner_ms:.3f} ms in runner calls, longest {longest_step_ms:.3f}), engine host time {engine_host_us:.1f} us a "
                  "step".format(**r), flush=True)
    report["host_phases"] = {}
    for batch in sorted({min(batches), max(batches)}):
        r = report["host_phases"][f"b{batch}"] = host_phases(runner, batch, min(contexts))
        print(f"host phases b={batch} ctx={min(contexts)}, us: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()),
              flush=True)
    sampled = SamplingRow(temperature=1.0, top_p=0.95, seed=1)  # top_k 0 = the sampler's cap of 20
    for batch in sorted({min(batches), max(batches)}):
        r = bench_decode(runner, config, batch, min(contexts), args.steps, report["copy_gb_s"] * 1e9, sampled)
        report["decode"].append(r)
        print("decode sampled (temperature 1, top_p 0.95) b={batch} ctx={context}: {tok_s:.1f} tok/s, step "
              "{step_ms:.3f} ms (gpu {gpu_step_ms:.3f})".format(**r), flush=True)
    if args.ablation:
        report["ablation"] = {}
        for batch, context in ((1, 512), (max(batches), 512), (max(batches), max(contexts))):
            r = ablate(runner, batch, context)
            report["ablation"][f"b{batch}_ctx{context}"] = r
            print(f"ablation b={batch} ctx={context} GPU ms: full {r['full']:.3f}; without: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "full"), flush=True)
    c = config
    report["gemv_gb_s"] = bench_gemv(runner, ptrs["layers.0.gate_up"], 2 * c.intermediate_size, c.hidden_size)
    print("gemv gate_up [24576 x 4096] alone, GB/s:", json.dumps(report["gemv_gb_s"]), flush=True)
    report["profile_b1"] = profile_decode(runner, 1)
    report[f"profile_b{max(batches)}"] = profile_decode(runner, max(batches))
    for key in ("profile_b1", f"profile_b{max(batches)}"):
        print(key, "us per step:", ", ".join(f"{k} {v:.0f}" for k, v in report[key].items()), flush=True)
    if args.prefill:
        lt = runner.forward.lt
        for name, engine in (("cublaslt", lt), ("fp32", None)):  # tensor-core GEMMs, then our fp32 kernel
            runner.forward.lt = engine
            runner.forget_prefill_graph()  # the graph holds the other GEMMs: warm up, capture anew
            bench_prefill(runner, 2 * runner.buffers.rows)
            report[f"prefill_{name}"] = r = bench_prefill(runner, args.prefill)
            print(f"prefill ({name} GEMMs) {r['tokens']} tokens: {r['seconds']:.2f} s = {r['tok_s']:.0f} tok/s",
                  flush=True)
        runner.forward.lt = lt
        runner.forget_prefill_graph()
    report["ttft"] = [bench_ttft(runner, int(n)) for n in args.ttft.split(",") if n]
    for r in report["ttft"]:
        print(f"TTFT prompt {r['prompt']}: {r['ttft_ms']:.1f} ms (prefill + first sample, through the runner)",
              flush=True)
    runner.close()
    torch.cuda.empty_cache()
    if args.peer == "eager":
        report["peer"] = bench_peer_eager(torch, config, batches=[int(b) for b in args.peer_batches.split(",")],
                                          prompt=512, new_tokens=16, prefill=args.prefill or 8192)
        for r in report["peer"]:
            print("peer", json.dumps(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
