"""The non-serving commands on bad input: one line naming the problem, exit status 1 (2 for a usage
error), no traceback, and nothing of the user's destroyed or half-written."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from gguf_testing import write_tiny_llama
from ninfer.cli import main
from ninfer.convert.random_model import HYBRID_PRESETS, LARGE_PRESETS, PRESETS, make_random_artifact

QUICK_BACKEND = ["--batches", "1", "--contexts", "16", "--steps", "2", "--prefill", "0", "--ttft", "",
                 "--engine-steps", "0"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("audit") / "tiny.ninfer"
    make_random_artifact(path, "tiny-llama", seed=0)
    return path


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("audit-gguf") / "tiny.gguf"
    write_tiny_llama(path)
    return path


@pytest.fixture
def refused_port():
    """A loopback port that refuses connections: bound, never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def one_error_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


# --- convert ----------------------------------------------------------------------------------------

def test_convert_help_names_every_random_preset(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", "--help"])
    assert exc.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps "tiny-qwen3.5-moe" at its hyphens
    for name in [*PRESETS, *LARGE_PRESETS, *HYBRID_PRESETS]:
        assert f"{name}," in text or f"{name})" in text, name


def test_convert_never_replaces_its_own_gguf_source(tmp_path, capsys):
    source = tmp_path / "model.gguf"
    write_tiny_llama(source)
    before = source.read_bytes()
    assert main(["convert", str(source), str(source)]) == 1
    assert "exists and is not a .ninfer artifact" in one_error_line(capsys, "ninfer convert: error: ")
    assert source.read_bytes() == before
    assert list(tmp_path.iterdir()) == [source]


def test_convert_refuses_a_directory_or_a_special_file_as_output(gguf, tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    assert main(["convert", str(gguf), str(folder)]) == 1
    # Refused before converting: no progress lines, no partial file beside it.
    assert "out is a directory" in one_error_line(capsys, "ninfer convert: error: ")
    fifo = tmp_path / "pipe.ninfer"
    os.mkfifo(fifo)
    assert main(["convert", "--random", "tiny-llama", str(fifo)]) == 1
    assert "is not a regular file" in one_error_line(capsys, "ninfer convert: error: ")
    assert not fifo.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "pipe.ninfer"] and not any(folder.iterdir())


def test_convert_replaces_an_earlier_artifact(gguf, tmp_path):
    out = tmp_path / "m.ninfer"
    assert main(["convert", "--random", "tiny-llama", str(out)]) == 0
    assert main(["convert", str(gguf), str(out)]) == 0
    assert b"tiny.gguf" in out.read_bytes()[:4096]  # the GGUF's header replaced the random one


def test_convert_negative_seed_is_a_usage_error(tmp_path, capsys):
    line = usage_error(capsys, ["convert", "--random", "tiny-llama", str(tmp_path / "r.ninfer"), "--seed", "-1"])
    assert line == "ninfer convert: error: argument --seed: must be >= 0, got -1"
    assert not any(tmp_path.iterdir())


# --- the whole command line -------------------------------------------------------------------------

@pytest.mark.parametrize("tensors", [[], ["--tensors"]])
def test_a_reader_that_leaves_ends_the_command_quietly(artifact, tensors):
    # The read end is closed before the child writes: its output (flushed in the command or at exit)
    # meets a broken pipe, as under `ninfer inspect FILE | head -1`.
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "inspect", *tensors, str(artifact)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 141 and err == ""


# --- generate ---------------------------------------------------------------------------------------

def test_generate_names_a_foreign_or_truncated_artifact(artifact, gguf, tmp_path):
    truncated = tmp_path / "cut.ninfer"
    truncated.write_bytes(artifact.read_bytes()[:100_000])
    for path, problem in ((gguf, "not a .ninfer artifact: wrong magic"), (truncated, "truncated: tensor data")):
        with pytest.raises(SystemExit, match=f"^ninfer generate: {path}: {problem}"):
            main(["generate", str(path), "--prompt", "hello"])


@pytest.mark.parametrize("option, value, message", [
    ("--temperature", "nan", "--temperature must be finite, got nan"),
    ("--temperature", "inf", "--temperature must be finite, got inf"),
    ("--seed", str(2**63), f"--seed must fit a signed 64-bit integer, got {2**63}"),
])
def test_generate_refuses_what_the_sampler_cannot_take(artifact, option, value, message):
    with pytest.raises(SystemExit, match=f"^ninfer generate: {message}$"):
        main(["generate", str(artifact), "--prompt", "hello", option, value])


def test_generate_names_a_demo_cache_it_cannot_write(gguf, tmp_path, monkeypatch):
    from ninfer import demo

    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file")
    monkeypatch.setenv("NINFER_CACHE", str(not_a_folder))
    monkeypatch.setattr(demo, "demo_gguf", lambda: gguf)
    with pytest.raises(SystemExit, match=f"^ninfer generate: cannot prepare the demo model in {not_a_folder}: "):
        main(["generate", "--prompt", "hello"])


# --- bench ------------------------------------------------------------------------------------------

def test_bench_names_a_bad_artifact_in_one_line(gguf, capsys):
    assert main(["bench", "backend", str(gguf), *QUICK_BACKEND]) == 1
    assert "not a .ninfer artifact" in one_error_line(capsys, "ninfer bench backend: ")
    missing = str(gguf.with_name("missing.ninfer"))
    assert main(["bench", "engine", "--runner", "reference", "--artifact", missing, "--repeat", "1"]) == 1
    assert "missing.ninfer" in one_error_line(capsys, "ninfer bench engine: ")


def test_bench_backend_names_an_unwritable_json_path(artifact, tmp_path, capsys):
    assert main(["bench", "backend", str(artifact), *QUICK_BACKEND, "--json", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("ninfer bench backend: ")


@pytest.mark.parametrize("argv, message", [
    (["engine", "--lanes", "0"], "--lanes: invalid choice: 0"),
    (["engine", "--lanes", "9"], "--lanes: invalid choice: 9"),
    (["engine", "--steps", "0"], "--steps: --steps must be >= 1, got 0"),
    (["engine", "--prompt-tokens", "0"], "--prompt-tokens: --prompt-tokens must be >= 1, got 0"),
    (["engine", "--repeat", "0"], "--repeat: --repeat must be >= 1, got 0"),
    (["http", "URL", "--clients", "0"], "--clients: --clients must be >= 1, got 0"),
    (["http", "URL", "--requests", "-1"], "--requests: --requests must be >= 1, got -1"),
    (["http", "URL", "--prompt-words", ""], "--prompt-words: expected at least one prompt length, got ''"),
    (["http", "URL", "--max-tokens", "0,8"], "--max-tokens: output length must be >= 1, got 0"),
])
def test_bench_counts_below_their_range_are_usage_errors(refused_port, capsys, argv, message):
    argv = [f"http://127.0.0.1:{refused_port}" if a == "URL" else a for a in argv]
    assert usage_error(capsys, ["bench", *argv]).startswith(f"ninfer bench {argv[0]}: error: argument {message}")


@pytest.mark.parametrize("extra", [[], ["--model", "m", "--clients", "2"]])
def test_bench_http_names_a_server_it_cannot_reach(refused_port, capsys, extra):
    # Without --model the first request asks for the model list; with it the clients fail together.
    url = f"http://127.0.0.1:{refused_port}"
    assert main(["bench", "http", url, "--requests", "2", *extra]) == 1
    one_error_line(capsys, f"ninfer bench http: {url}: ")
    assert main(["bench", "http", "not-a-url", "--requests", "1", *extra]) == 1
    one_error_line(capsys, "ninfer bench http: not-a-url: ")

