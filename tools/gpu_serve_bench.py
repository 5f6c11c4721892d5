"""End to end on the GPU host: `ninfer serve --device 0` with the synthetic Qwen3-8B under the load tool.

    python tools/gpu_serve_bench.py [--config qwen3-8b] [--streams 1,4,8] [--requests-per-stream 3]
                                    [--prompt-words 64] [--max-tokens 128] [--json OUT.json]

Starts one server process (``--random-weights CONFIG``: random bf16 weights made on the GPU, the
synthetic tokenizer; ``--kv-capacity auto``; ``--max-concurrency`` = the largest stream count;
``--temperature 1.0`` so that sampled tokens are visible text, see docs/cli.md) and drives it with
``ninfer bench http`` (ninfer/server/load.py) at each stream count in turn: N concurrent streaming
clients, N x ``--requests-per-stream`` requests. Prints one line per level (client-side TTFT and
inter-token p50/p99, aggregate output tok/s, requests/s) plus the server's own figures from
/metrics (engine TTFT), its one-second throughput records (engine decode tok/s, host share) and its
startup record; exits 1 if any answer was incorrect.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.server.load import run_load  # noqa: E402


def start_server(args, streams: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    if args.cpu_artifact:  # a dry run of this tool on the reference backend (no GPU)
        model = [args.cpu_artifact, "--device", "cpu", "--kv-capacity", str(streams * args.max_context)]
    else:
        model = ["--random-weights", args.config, "--device", "0", "--kv-capacity", "auto"]
    serve = ["serve", *model, "--port", "0", "--max-context", str(args.max_context),
             "--max-concurrency", str(streams), "--temperature", "1.0", "--log-stats-interval-ms", "1000"]
    cmd = [sys.executable, "-m", "ninfer.cli", *serve]
    if args.gil_switch_ms is not None:  # the interpreter's thread switch interval (Python's default: 5 ms)
        cmd = [sys.executable, "-c", f"import sys; sys.setswitchinterval({args.gil_switch_ms / 1000}); "
               f"from ninfer.cli import main; sys.exit(main({serve!r}))"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        m = re.search(r"ready: serving \S+ on (http://\S+)", log_path.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become ready:\n{log_path.read_text()[-3000:]}")


def engine_ttft(url: str) -> tuple[float, int]:
    """(sum of seconds, count) of the server's time-to-first-token histogram."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values = {}
    for name in ("sum", "count"):
        m = re.search(rf"^ninfer_time_to_first_token_seconds_{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        values[name] = float(m.group(1)) if m else 0.0
    return values["sum"], int(values["count"])


def ms(value: float | None) -> str:
    """None: no visible text reached the client (TTFT counts the first non-empty delta)."""
    return "n/a" if value is None else f"{value:.1f} ms"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-8b", help="--random-weights CONFIG (default qwen3-8b)")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--startup-timeout", type=float, default=120)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--gil-switch-ms", type=float, help="run the server with this sys.setswitchinterval")
    parser.add_argument("--cpu-artifact", help="serve this artifact on the reference backend instead (dry run)")
    args = parser.parse_args(argv)
    levels = [int(s) for s in args.streams.split(",")]
    log_path = Path(tempfile.mkdtemp()) / "serve.log"
    t0 = time.monotonic()
    proc, url = start_server(args, max(levels), log_path)
    report: dict = {"config": args.config, "gil_switch_ms": args.gil_switch_ms, "startup_s": round(time.monotonic() - t0, 1), "levels": []}
    startup = [line for line in log_path.read_text().splitlines() if "CUDA startup" in line or "kv-capacity" in line]
    report["startup_log"] = [line.split(" ", 3)[-1] for line in startup]
    for line in report["startup_log"]:
        print(line, flush=True)
    failed = False
    try:
        # Warm-up: the first request of each batch size, so no level pays one-time costs.
        trio.run(lambda: run_load(url, clients=max(levels), requests=max(levels), prompt_words=(8,),
                                  max_tokens=(4,)))
        for streams in levels:
            seen = len(log_path.read_text().splitlines())
            ttft_sum0, ttft_n0 = engine_ttft(url)
            r = trio.run(lambda: run_load(url, clients=streams, requests=streams * args.requests_per_stream,
                                          prompt_words=(args.prompt_words,), max_tokens=(args.max_tokens,)))
            ttft_sum, ttft_n = engine_ttft(url)
            r["engine_ttft_mean_ms"] = 1000 * (ttft_sum - ttft_sum0) / max(1, ttft_n - ttft_n0)
            r["streams"] = streams
            # The server's own one-second throughput records of this level (engine decode rate, host share).
            r["server_throughput"] = [line.split("throughput: ", 1)[1] for line in
                                      log_path.read_text().splitlines()[seen:] if "throughput: " in line]
            report["levels"].append(r)
            failed |= bool(r["incorrect"])
            print(f"streams {streams}: {r['output_tokens_per_second']:.0f} output tok/s, "
                  f"{r['requests_per_second']:.2f} req/s; TTFT p50 {ms(r['ttft_p50_ms'])} p99 {ms(r['ttft_p99_ms'])} "
                  f"(engine mean {ms(r['engine_ttft_mean_ms'])}); inter-token p50 {ms(r['inter_token_p50_ms'])} "
                  f"p99 {ms(r['inter_token_p99_ms'])}; {r['completed']} completed, incorrect {r['incorrect']}",
                  flush=True)
            for line in r["server_throughput"][:3]:
                print(f"  server: {line}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
