"""`ninfer serve` as a process: startup records, readiness, redirected stderr format, SIGTERM."""

from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (TRACE|DEBUG|INFO|WARNING|ERROR|CRITICAL) \S")


def test_serve_process_lifecycle(tiny_artifact, tmp_path):
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", tiny_artifact, "--port", "0",
                                 "--max-context", "256", "--api-key", "k"], cwd=ROOT, stderr=err,
                                stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"ready: serving \S+ on (http://\S+)", err_path.read_text())
            url = m.group(1) if m else None
            time.sleep(0.05)
        assert url, err_path.read_text()
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert httpx.get(url + "/v1/models").status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err_path.read_text()
    assert "\x1b" not in text and "\r" not in text  # redirected stderr has no terminal control
    lines = text.splitlines()
    assert lines and all(RECORD.match(line) for line in lines), lines
    assert "shutting down" in lines[-1]


def test_startup_failures_are_clear(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", str(tmp_path / "missing.ninfer")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "does not exist" in r.stderr
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"not an artifact at all, but long enough to hold a preamble")
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", str(bad), "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"ninfer serve: {bad}: not a .ninfer artifact")


def test_malformed_context_cost_presets_abort_startup(tiny_artifact, tmp_path):
    bad = tmp_path / "presets.json"
    bad.write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", tiny_artifact, "--port", "0",
                        "--context-cost-presets", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "presets" in r.stderr.lower() and "Traceback" not in r.stderr


def test_request_log_path_checks(tiny_artifact, tmp_path):
    for path, why in ((tmp_path / "missing" / "log.jsonl", "does not exist"), (tiny_artifact, "artifact")):
        r = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", tiny_artifact, "--port", "0",
                            "--request-log-jsonl", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and why in r.stderr and "Traceback" not in r.stderr


def test_listen_address_in_use_is_one_clear_line(tiny_artifact):
    """A port another process holds (or a host that is not local) ends startup with one line, status 1."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        r = subprocess.run([sys.executable, "-m", "ninfer.cli", "serve", "--device", "cpu", tiny_artifact, "--port", port,
                            "--log-level", "warning"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == [f"ninfer serve: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_cuda_bindings_without_a_driver_mean_no_gpu(monkeypatch, capsys):
    """cuda-bindings installed on a machine without libcuda: cuInit raises; that is "no GPU", not a crash."""
    import argparse
    import types

    from ninfer.commands import serve
    from ninfer.server.backend import cuda_available

    def no_driver(flags):
        raise RuntimeError("Failed to dlopen libcuda.so.1")

    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = types.SimpleNamespace(cuInit=no_driver)
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", bindings.driver)
    assert cuda_available() is False
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.run(parser.parse_args(["--device", "0"])) == 2
    assert "--device 0: no CUDA GPU is usable here" in capsys.readouterr().err
