"""`ninfer bench MODE`: measurements. Each mode is one function below; modes share nothing else.

``engine``: the Engine's own host time per decode step — scheduling, page bookkeeping, building
the runner inputs, committing tokens and delivering events through the worker to trio consumers —
with model math excluded (time inside runner calls is measured separately and subtracted). By
default it runs 8 lanes on the zero-cost simulated runner; ``--runner reference`` uses the NumPy
backend on a tiny random model instead (its model math is then reported beside the host time).

``backend [ARTIFACT]``: a ModelRunner timed directly (ninfer/commands/bench_backend.py): the reference
runner on the CPU, or the CUDA runner with ``--device N`` (``--random-weights`` for a shape without a
file): decode tok/s per batch and context with achieved GB/s and % of the roofline, engine host time a
step, prefill tok/s and time to first token.

``http URL``: N concurrent streaming Chat Completions clients against a running server
(ninfer/server/load.py): requests/s, TTFT and inter-token p50/p99, and a check of every answer.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

GOAL_HOST_SECONDS_PER_STEP = 100e-6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ninfer.commands import bench_backend
    from ninfer.engine.config import MAX_LANES

    # Bad counts stop at parsing with a usage error (exit status 2), as `bench backend`'s do.
    count = bench_backend.count_arg
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    engine = modes.add_parser("engine", help="engine host time per decode step, model math excluded")
    engine.add_argument("--lanes", type=int, choices=range(1, MAX_LANES + 1), default=8, metavar="N",
                        help=f"concurrent requests = lanes, 1..{MAX_LANES} (default 8)")
    engine.add_argument("--steps", type=count(1, "--steps", skip=False), default=2000,
                        help="output tokens per request (default 2000)")
    engine.add_argument("--prompt-tokens", type=count(1, "--prompt-tokens", skip=False), default=32,
                        help="prompt length per request (default 32)")
    engine.add_argument("--runner", choices=("simulated", "reference"), default="simulated",
                        help="zero-cost simulated runner (default) or the reference backend")
    engine.add_argument("--artifact", type=Path, help="reference runner: a .ninfer file (default: random tiny-qwen3)")
    engine.add_argument("--repeat", type=count(1, "--repeat", skip=False), default=5,
                        help="runs; the median is the figure (default 5)")
    engine.set_defaults(_mode=bench_engine)

    backend = modes.add_parser("backend", help="time a ModelRunner directly: decode, roofline, prefill, TTFT",
                               description=bench_backend.DESCRIPTION)
    bench_backend.add_arguments(backend)
    backend.set_defaults(_mode=bench_backend.run)

    http = modes.add_parser("http", help="load a running server with concurrent streaming clients")
    http.add_argument("url", help="base URL of a running `ninfer serve`, e.g. http://127.0.0.1:8080")
    http.add_argument("--clients", type=count(1, "--clients", skip=False), default=4,
                      help="concurrent streaming clients (default 4)")
    http.add_argument("--requests", type=count(1, "--requests", skip=False), default=16,
                      help="requests in all (default 16)")
    http.add_argument("--prompt-words", type=_mix("prompt length"), default=(8, 64, 200),
                      help="comma-separated prompt mix")
    http.add_argument("--max-tokens", type=_mix("output length"), default=(8, 32, 64),
                      help="comma-separated output mix")
    http.add_argument("--api-key")
    http.add_argument("--model", help="default: the server's advertised model id")
    http.add_argument("--seed", type=int, default=0)
    http.set_defaults(_mode=bench_http)


def run(args: argparse.Namespace) -> int:
    from ninfer.artifact import ArtifactError

    try:
        return args._mode(args)
    except BrokenPipeError:
        raise  # the reader of stdout left; ninfer.cli ends quietly
    # A truncated or foreign artifact, a missing file, an unwritable --json or $NINFER_CACHE.
    except (ArtifactError, OSError) as exc:
        print(f"ninfer bench {args.mode}: {exc}", file=sys.stderr)
        return 1


def _mix(what: str):
    """A comma-separated mix of integers >= 1 to draw from; it cannot be empty."""
    from ninfer.commands.bench_backend import size_list

    parse = size_list(1, None, what)

    def mix(text: str) -> tuple[int, ...]:
        values = parse(text)
        if not values:
            raise argparse.ArgumentTypeError(f"expected at least one {what}, got {text!r}")
        return values

    return mix


def bench_http(args: argparse.Namespace) -> int:
    """Every answer is checked; exit status 1 when any was incorrect (a correct 429 is correct)."""
    import json

    import trio

    from ninfer.server.load import run_load

    try:
        report = trio.run(lambda: run_load(args.url, model=args.model, clients=args.clients,
                                           requests=args.requests, prompt_words=args.prompt_words,
                                           max_tokens=args.max_tokens, api_key=args.api_key, seed=args.seed))
    except Exception as exc:
        failure = _http_failure(exc)
        if failure is None:
            raise
        print(f"ninfer bench http: {args.url}: {failure}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2))
    return 1 if report["incorrect"] else 0


def _http_failure(exc: Exception) -> Exception | None:
    """The connection or URL failure behind ``exc`` (no server there, not a usable URL, not a NInfer
    server's base URL), or None
    when something else went wrong. The clients' nursery wraps their failures in a group."""
    import httpx

    from ninfer.server.load import LoadError

    failures = (httpx.HTTPError, httpx.InvalidURL, LoadError)
    if isinstance(exc, ExceptionGroup):
        match, rest = exc.split(failures)
        return None if match is None or rest is not None else _http_failure(match.exceptions[0])
    return exc if isinstance(exc, failures) else None


def bench_engine(args: argparse.Namespace) -> int:
    import trio

    from ninfer.engine import EngineConfig

    steps = args.steps
    context = args.prompt_tokens + steps + 16
    config = EngineConfig(max_concurrency=args.lanes, max_context=context,
                          kv_capacity=context * args.lanes, prefix_reuse=False,
                          prefill_chunk=max(args.prompt_tokens, 16))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(max(1, args.repeat)):
            runner = _make_runner(args, config, tmp)
            try:
                results.append(trio.run(_drive_engine, runner, config, args.lanes, args.prompt_tokens, steps))
            finally:
                runner.close()
    for i, result in enumerate(results):
        _report(result, args, f"run {i + 1}/{len(results)}")
    per_step = sorted(_host_per_step(r) for r in results)
    median = per_step[len(per_step) // 2]
    print(f"engine host time per step: median {median * 1e6:.1f} us over {len(results)} runs "
          f"(min {per_step[0] * 1e6:.1f}, max {per_step[-1] * 1e6:.1f}); goal < "
          f"{GOAL_HOST_SECONDS_PER_STEP * 1e6:.0f} us: {median / GOAL_HOST_SECONDS_PER_STEP:.2f}x of goal")
    return 0


def _host_per_step(r: dict) -> float:
    return sum(r["host"].values()) / max(r["rounds"] + r["prefill_units"], 1)


def _make_runner(args: argparse.Namespace, config, tmp: str):
    if args.runner == "simulated":
        from ninfer.engine.simulated import SimulatedRunner

        return SimulatedRunner(page_size=config.page_size, num_pages=config.kv_pages,
                               max_batch=config.max_concurrency, max_context=config.max_context,
                               vocab_size=32000, verify=False)
    from ninfer.backends.reference import ReferenceRunner

    path = args.artifact
    if path is None:
        from ninfer.convert.random_model import make_random_artifact

        path = Path(tmp) / "tiny.ninfer"
        make_random_artifact(path, "tiny-qwen3", seed=0)
    return ReferenceRunner(str(path), page_size=config.page_size, num_pages=config.kv_pages,
                           max_batch=config.max_concurrency, max_context=config.max_context)


async def _drive_engine(runner, config, lanes: int, prompt_tokens: int, steps: int) -> dict:
    import trio

    from ninfer.engine import GenerationRequest, SamplingOverrides
    from ninfer.engine.api import Engine
    from ninfer.engine.events import Finished

    vocab = runner.info.vocab_size
    finished: list[Finished] = []

    async def one(engine, i: int) -> None:
        prompt = [(i * 97 + j * 13) % (vocab - 1) + 1 for j in range(prompt_tokens)]
        with engine.reserve() as ticket:
            # No stop ids: every request runs exactly `steps` tokens.
            async for event in ticket.submit(GenerationRequest(prompt=prompt, max_tokens=steps,
                                                               sampling=SamplingOverrides(temperature=0.0))):
                if isinstance(event, Finished):
                    finished.append(event)

    async with Engine.open(runner, config) as engine:
        before = engine.stats()
        wall = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(lanes):
                nursery.start_soon(one, engine, i)
        wall = time.perf_counter() - wall
        after = engine.stats()
    host = {k: after.host_work_seconds_total[k] - before.host_work_seconds_total[k]
            for k in after.host_work_seconds_total}
    return {
        "wall": wall,
        "host": host,
        "device": after.device_wait_seconds_total - before.device_wait_seconds_total,
        "rounds": after.decode_rounds_total - before.decode_rounds_total,
        "rows": after.decode_row_rounds_total - before.decode_row_rounds_total,
        "prefill_units": after.prefill_units_total - before.prefill_units_total,
        "tokens": sum(f.usage.completion_tokens for f in finished),
        "backend": runner.info.backend,
    }


def _report(r: dict, args: argparse.Namespace, label: str) -> None:
    steps = r["rounds"] + r["prefill_units"]
    per_step = _host_per_step(r)
    device_per_step = r["device"] / max(steps, 1)
    print(f"{label}: {args.lanes} lanes x {args.steps} tokens, prompt {args.prompt_tokens}, runner {r['backend']}; "
          f"steps {steps} (decode rounds {r['rounds']}, average batch {r['rows'] / max(r['rounds'], 1):.2f}), "
          f"wall {r['wall']:.3f} s, {r['tokens'] / r['wall']:.0f} tok/s")
    phases = ", ".join(f"{k} {v / max(steps, 1) * 1e6:.1f}" for k, v in r["host"].items())
    print(f"  host {per_step * 1e6:.1f} us/step ({phases}); inside runner calls (excluded) "
          f"{device_per_step * 1e6:.1f} us/step; host share {per_step / max(per_step + device_per_step, 1e-12):.1%}")
    sys.stdout.flush()
