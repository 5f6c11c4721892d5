"""End-to-end smoke test of `ninfer serve --device 0` on the GPU host: same greedy answer as the CPU.

    python tools/gpu_serve_smoke.py [--port 8123]

Writes a small random Qwen3 artifact (head_dim 128, so the CUDA kernels apply), serves it once with
the CUDA backend and once with the reference backend, sends the same greedy chat completion to each
over loopback HTTP, and prints both answers; exits 1 if they differ or a server fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.convert.random_model import make_random_artifact  # noqa: E402
from ninfer.models.dense import DenseConfig  # noqa: E402

CONFIG = DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=2048, hidden_size=256, intermediate_size=384,
                     num_layers=3, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=4096, qk_norm=True)


def ask(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy") from None
            time.sleep(0.5)
    body = {"model": "random-Qwen3ForCausalLM", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 24, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp()) / "qwen3.ninfer"
    make_random_artifact(path, CONFIG, seed=3)
    answers = {}
    for name, flags in (("cuda", ["--device", "0"]), ("reference", ["--device", "cpu"])):
        cmd = [sys.executable, "-m", "ninfer.cli", "serve", str(path), "--max-context", "512",
               "--port", str(args.port), *flags]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            answer = ask(args.port, proc)
            message = answer["choices"][0]["message"]  # content, and reasoning for thinking templates
            answers[name] = {k: message.get(k) for k in ("content", "reasoning_content")}
            print(f"{name}: {answers[name]!r} usage={answer.get('usage')}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report the server's own output with the failure
            proc.terminate()
            print(f"{name}: FAILED {exc}\n{proc.communicate(timeout=30)[0][-3000:]}", flush=True)
            return 1
        proc.terminate()
        proc.wait(timeout=30)
    return 0 if answers["cuda"] == answers["reference"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
