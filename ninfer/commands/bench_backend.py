"""`ninfer bench backend`: a ModelRunner timed directly, with no HTTP server in the way.

``--device cpu`` (the default) times the reference runner over an artifact (default: the embedded
demo model); ``--device N`` the CUDA runner over an artifact or ``--random-weights CONFIG`` (random
bf16 weights made on the GPU, no file, as ``ninfer serve --random-weights``). For each batch size and
context: decode tok/s, ms a step, the host's share of a step where it can be told apart (CUDA: the
step's wall time less its graph replayed alone), the bytes a step must move (weights + KV) and the
achieved GB/s and % of the roofline against a copy bandwidth measured in the same run: device to
device on a GPU, one-thread host ``memcpy`` on the CPU (the reference runner streams its fp32 weights
from host memory on one BLAS thread, so that copy is its bound). Then decode driven by the engine core
(the engine's host time a step), prefill tok/s of one prompt, and time to first token.

The measurements live in ``ninfer/commands/runner_timing.py``, shared with ``tools/gpu_bench.py``
(which adds the GPU-only figures and the transformers peer); nothing here imports torch, and nothing
imports the CUDA bindings unless ``--device N`` asks for the GPU. The KV a decode step reads is
whatever the pool holds (zeros at start): no kernel's time depends on the values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ninfer import options
from ninfer.commands.runner_timing import (DECODE_SLACK, ENGINE_STEPS, PAGE, bench_decode, bench_engine,
                                           bench_prefill, bench_ttft, copy_bandwidth, decode_step_bytes,
                                           host_copy_bandwidth)

DESCRIPTION = ("time a ModelRunner directly: the reference runner on the CPU (default: the demo model), or the "
               "CUDA runner with --device N over an artifact or --random-weights CONFIG. Per batch and context: "
               "decode tok/s, ms and host ms a step, achieved GB/s and % of the roofline (weights + KV bytes a "
               "step over a copy bandwidth measured in the same run); then engine host time a step, prefill "
               "tok/s and time to first token.")


class OptionError(ValueError):
    """An option that cannot be run here; the message names it."""


def size_list(lo: int, hi: int | None, what: str):
    """A comma-separated list of integers in ``lo..hi`` (an argparse type; ``bench`` uses it too)."""
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        for v in values:
            if v < lo:
                raise argparse.ArgumentTypeError(f"{what} must be >= {lo}, got {v}")
            if hi is not None and v > hi:
                raise argparse.ArgumentTypeError(f"batch {v} exceeds the maximum concurrency {hi} "
                                                 f"(the engine's lanes, --max-concurrency 1..{hi})")
        return values

    return parse


def count_arg(lo: int, what: str, skip: bool = True):
    """An integer >= ``lo``; with ``skip`` also 0, which skips the figure (an argparse type; ``bench``
    uses it too)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo and not (skip and value == 0):
            raise argparse.ArgumentTypeError(f"{what} must be {'0 (skip) or ' if skip else ''}>= {lo}, got {value}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ninfer.engine.config import MAX_LANES

    parser.add_argument("artifact", nargs="?", default=None,
                        help="a .ninfer artifact (default: the embedded SmolLM2 demo model)")
    parser.add_argument("--device", type=options.device_choice, default="cpu", metavar="cpu|N",
                        help="cpu: the reference runner (default); N: the CUDA runner on device N")
    parser.add_argument("--random-weights", metavar="CONFIG",
                        help="random bf16 weights made on the GPU for a dense preset (e.g. qwen3-8b) or "
                             "DenseConfig JSON instead of an artifact (needs --device N)")
    parser.add_argument("--batches", type=size_list(1, MAX_LANES, "a batch"), default=(1, 4, 8), metavar="B,...",
                        help=f"decode batch sizes, 1..{MAX_LANES} (default 1,4,8)")
    parser.add_argument("--contexts", type=size_list(0, None, "a context"), default=(512, 8192), metavar="N,...",
                        help="context lengths decode runs at; longer than the model's are skipped (default 512,8192)")
    parser.add_argument("--steps", type=count_arg(1, "--steps", skip=False), default=32, metavar="N",
                        help="timed decode steps per case (default 32)")
    parser.add_argument("--prefill", type=count_arg(1, "--prefill"), default=8192, metavar="N",
                        help="prompt tokens of the prefill figure; 0 skips (default 8192)")
    parser.add_argument("--ttft", type=size_list(1, None, "a TTFT prompt"), default=(512, 8192), metavar="N,...",
                        help="prompt lengths for time to first token, median of 3 on a GPU, one run on the "
                             "CPU; '' skips (default 512,8192)")
    parser.add_argument("--engine-steps", type=count_arg(16, "--engine-steps"), default=ENGINE_STEPS, metavar="N",
                        help=f"tokens per request of the engine-driven decode (engine host time a step) at the "
                             f"smallest and largest batch; 0 skips (default {ENGINE_STEPS})")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every figure to PATH as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        config, source, model = _model(args)
        runner, report = _open_runner(args, config, model, _plan(args, config))
    except OptionError as e:
        print(f"ninfer bench backend: {e}", file=sys.stderr)
        return 2
    report["model"] = source
    try:
        _measure(args, runner, config, report)
    finally:
        runner.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _model(args: argparse.Namespace) -> tuple[Any, str, Any]:
    """(dense config, how the report names the model, what the runner loads: a path or a RandomWeightsModel)."""
    from ninfer.models.dense import ARCHITECTURES, DenseConfig

    if args.device != "cpu":
        count = _cuda_devices()
        if count == 0:
            raise OptionError(f"--device {args.device}: no CUDA GPU is usable here (needs the cuda extra and a "
                              "driver); --device cpu times the reference runner")
        if args.device >= count:
            raise OptionError(f"--device {args.device}: this machine has {count} CUDA device(s), 0..{count - 1}")
    if args.random_weights is not None:
        if args.device == "cpu":
            raise OptionError("--random-weights makes its weights on the GPU, so it needs --device N")
        if args.artifact is not None:
            raise OptionError("give an artifact or --random-weights, not both")
        from ninfer.server.random_weights import RandomWeightsModel

        try:
            model = RandomWeightsModel(args.random_weights)
        except ValueError as e:
            raise OptionError(str(e)) from None
        return model.dense, model.source, model
    path = args.artifact
    if path is None:
        from ninfer import demo

        try:
            path = str(demo.default_artifact())
        except demo.DemoModelMissing as e:
            raise OptionError(str(e)) from None
    if not Path(path).is_file():
        raise OptionError(f"artifact {path} does not exist")
    from ninfer.artifact import open_artifact

    with open_artifact(path, components=("text",)) as art:
        raw = art.config
    architecture = raw.get("architecture")
    if architecture not in ARCHITECTURES:
        raise OptionError(f"{path} is a {architecture} model; `ninfer bench backend` times the dense "
                          f"runners ({', '.join(ARCHITECTURES)}); tools/gpu_bench_hybrid.py times hybrids")
    return DenseConfig.from_json(raw), path, path


def _cuda_devices() -> int:
    """CUDA devices that answer (0 without the cuda extra or a driver); no context is created."""
    from ninfer.server.backend import cuda_available

    if not cuda_available():
        return 0
    from cuda.bindings import driver

    return driver.cuDeviceGetCount()[1]


def _plan(args: argparse.Namespace, config) -> dict:
    """Which cases fit the model's context, each decode case's first position, and the runner's shape."""
    limit = config.max_position_embeddings
    skipped, decode = [], []
    for context in args.contexts:
        if context > limit:
            skipped.append(f"context {context}: longer than the model's max context {limit}")
        elif args.steps + DECODE_SLACK > limit:
            skipped.append(f"context {context}: --steps {args.steps} do not fit the model's max context {limit}")
        else:
            # A context at the model's limit decodes its steps just below it.
            decode.append((context, min(context, limit - args.steps - DECODE_SLACK)))
    engine = None
    if args.engine_steps:
        fitting = [c for c in args.contexts if 0 < c and c + args.engine_steps <= limit]
        if fitting:
            engine = min(fitting)
        else:
            skipped.append(f"engine-driven decode: no context + --engine-steps {args.engine_steps} fits the "
                           f"model's max context {limit}")
    prefill = args.prefill if args.prefill <= limit else 0
    if args.prefill > limit:
        skipped.append(f"prefill {args.prefill}: longer than the model's max context {limit}")
    ttft = [n for n in args.ttft if n <= limit]
    skipped += [f"TTFT prompt {n}: longer than the model's max context {limit}" for n in args.ttft if n > limit]
    needed = [16, prefill, *ttft, *(first + args.steps + DECODE_SLACK for _, first in decode),
              *([engine + args.engine_steps + 8] if engine is not None else [])]
    max_context = min(limit, max(needed))
    return {"decode": decode, "engine": engine, "prefill": prefill, "ttft": ttft, "skipped": skipped,
            "max_context": max_context, "num_pages": max(args.batches) * -(-max_context // PAGE)}


def _open_runner(args: argparse.Namespace, config, model: Any, plan: dict) -> tuple[Any, dict]:
    shape = dict(page_size=PAGE, num_pages=plan["num_pages"], max_batch=max(args.batches),
                 max_context=plan["max_context"])
    report: dict[str, Any] = {"plan": plan}
    if args.device == "cpu":
        from ninfer.backends.reference import ReferenceRunner

        report.update(backend="reference", device="CPU, one BLAS thread",
                      copy="host memcpy, one thread", copy_gb_s=host_copy_bandwidth() / 1e9)
        t0 = time.perf_counter()
        runner = ReferenceRunner(model, **shape)
        report["setup_s"] = time.perf_counter() - t0
        return runner, report
    from ninfer.backends.cuda import CudaRunner
    from ninfer.backends.cuda import runtime as rt
    from ninfer.engine import EngineConfig
    from ninfer.server.backend import prefill_gemm, prefill_rows

    device = rt.Device(args.device)
    report.update(backend="cuda", device=device.name, sync=device.sync, copy="device to device",
                  copy_gb_s=copy_bandwidth(device, device.stream()) / 1e9)
    t0 = time.perf_counter()
    # Prefill passes as `ninfer serve` makes them with its default --prefill-chunk.
    passes = prefill_rows(EngineConfig(max_context=plan["max_context"]))
    options = dict(shape, max_prefill_rows=passes, prefill_gemm=prefill_gemm())
    if isinstance(model, str):
        runner = CudaRunner(model, device=device, **options)
    else:
        from ninfer.backends.cuda.random_weights import random_weights_runner

        runner = random_weights_runner(device, config, model.seed, model.visible_ids, **options)
    report["setup_s"] = time.perf_counter() - t0
    report["startup"] = runner.startup
    return runner, report


def _measure(args: argparse.Namespace, runner, config, report: dict) -> None:
    plan = report.pop("plan")
    cuda = report["backend"] == "cuda"
    copy_bw = report["copy_gb_s"] * 1e9
    info = runner.info
    print(f"{report['model']} on {report['backend']} ({report['device']}); {report['copy']} bandwidth "
          f"{report['copy_gb_s']:.1f} GB/s; runner max context {info.max_context}, {info.num_pages} KV pages of "
          f"{info.page_size}, set up in {report['setup_s']:.1f} s", flush=True)
    report["weight_bytes_per_step"] = decode_step_bytes(config, report["backend"], 1, 0)
    report["skipped"] = plan["skipped"]
    for message in plan["skipped"]:
        print(f"skipped: {message}", flush=True)
    report["decode"] = []
    for context, first in plan["decode"]:
        if first != context:
            print(f"context {context}: decoding at positions {first}..{first + args.steps + DECODE_SLACK - 1}, "
                  f"below the model's max context {config.max_position_embeddings}", flush=True)
        for batch in args.batches:
            r = bench_decode(runner, config, batch, first, args.steps, copy_bw, pipelined=cuda)
            r.update(context=context, first_position=first,
                     step_bytes=decode_step_bytes(config, report["backend"], batch, first + args.steps // 2))
            report["decode"].append(r)
            _print_decode(r)
    report["engine"] = []
    if plan["engine"] is not None:
        for batch in sorted({min(args.batches), max(args.batches)}):
            r = bench_engine(runner, batch, plan["engine"], args.engine_steps)
            report["engine"].append(r)
            print("engine-driven decode b={batch} ctx={context} pipelined={pipelined}: {tok_s:.1f} tok/s, step "
                  "{step_ms:.3f} ms (median {runner_ms:.3f} ms in runner calls), engine host time "
                  "{engine_host_us:.1f} us a step".format(**r), flush=True)
    report["prefill"] = None
    if plan["prefill"]:
        r = report["prefill"] = bench_prefill(runner, plan["prefill"])
        print(f"prefill {r['tokens']} tokens: {r['seconds']:.2f} s = {r['tok_s']:.0f} tok/s"
              + (f" ({runner.startup['prefill_gemm']} GEMMs)" if cuda else ""), flush=True)
    report["ttft"] = [bench_ttft(runner, n, reps=3 if cuda else 1) for n in plan["ttft"]]
    for r in report["ttft"]:
        print(f"TTFT prompt {r['prompt']}: {r['ttft_ms']:.1f} ms (prefill + first sample, through the runner)",
              flush=True)


def _print_decode(r: dict) -> None:
    line = (f"decode b={r['batch']} ctx={r['context']}: {r['tok_s']:.1f} tok/s, step {r['step_ms']:.3f} ms")
    if r["gpu_step_ms"] is not None:
        line += f" (gpu {r['gpu_step_ms']:.3f}, host {r['host_ms']:.3f})"
    line += (f"; {r['step_bytes'] / 1e6:.1f} MB a step, {r['achieved_gb_s']:.1f} GB/s, "
             f"{r['pct_roofline']:.1f}% of roofline ({r['roofline_tok_s']:.0f} tok/s)")
    if r["pipelined_tok_s"] is not None:
        line += (f"; pipelined {r['pipelined_tok_s']:.1f} tok/s, {r['pipelined_pct_roofline']:.1f}% of roofline, "
                 f"host CPU {r['pipelined_host_cpu_ms']:.3f} ms a step")
    print(line, flush=True)
