"""CUDA startup options on the CPU (the GPU side: test_serve_cuda.py): `--kv-capacity auto`,
`--random-weights`, `--no-cuda-graph`, NINFER_CUDA_SYNC, and CUDA startup failures."""

from __future__ import annotations

import json
import logging

import pytest

from ninfer import cli, options
from ninfer.backends.reference import ReferenceRunner
from ninfer.cli import build_parser
from ninfer.observability import logs
from ninfer.server import backend
from ninfer.server.main import engine_config, run_server
from ninfer.server.random_weights import RandomWeightsModel
from server.conftest import serve_args


def _refusal(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    with pytest.raises(options.OptionError) as e:
        options.check_capabilities(args, cuda_available=True)
    return str(e.value)


def test_auto_capacity_and_random_weights_need_a_device():
    assert "needs a CUDA --device" in _refusal(["serve", "model.ninfer", "--device", "cpu", "--kv-capacity", "auto"])
    assert "needs a CUDA --device" in _refusal(["serve", "--device", "cpu", "--random-weights", "qwen3-8b"])
    # The executable default is CUDA device 0 (the spec's option table), so neither needs --device spelled out.
    options.check_capabilities(build_parser().parse_args(["serve", "model.ninfer", "--kv-capacity", "auto"]),
                               cuda_available=True)
    assert "one or the other" in _refusal(["serve", "model.ninfer", "--device", "0", "--random-weights", "qwen3-8b"])
    args = build_parser().parse_args(["serve", "--device", "0", "--random-weights", "qwen3-8b", "--kv-capacity", "auto"])
    options.check_capabilities(args, cuda_available=True)  # accepted


def test_random_weights_model_is_the_random_artifact_header_without_a_file():
    model = RandomWeightsModel("qwen3-8b")
    assert model.dense.vocab_size == 151936 and model.dense.num_layers == 36
    assert model.metadata["name"] == "random-qwen3-8b" and model.source == "random-weights:qwen3-8b"
    assert model.visible_ids == 1024 and "<|im_start|>" in model.chat_template
    with pytest.raises(ValueError, match="dense"):
        RandomWeightsModel("tiny-qwen3-next")
    with pytest.raises(ValueError, match="--random-weights: 'nope' is neither a preset"):
        RandomWeightsModel("nope")


async def test_auto_capacity_is_what_the_runner_sized(nursery, tiny_artifact, caplog):
    """The runner decides the pool (the CUDA runner from free memory); the Engine gets exactly that."""
    def factory(art, config):
        return ReferenceRunner(art, page_size=config.page_size, num_pages=40, max_batch=config.max_concurrency,
                               max_context=config.max_context)

    caplog.set_level(logging.INFO, logger="ninfer")
    args = serve_args(tiny_artifact, "--kv-capacity", "auto")
    srv = await nursery.start(lambda task_status: run_server(args, [], runner_factory=factory, task_status=task_status))
    assert srv.state.engine.config.kv_capacity == 40 * 16
    assert any("--kv-capacity auto: 640 tokens (40 pages" in r.getMessage() for r in caplog.records)
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("flags, graphs", [((), True), (("--no-cuda-graph",), False)])
def test_cuda_graph_flag_reaches_the_runner(monkeypatch, flags, graphs):
    hybrid_runner = pytest.importorskip("ninfer.backends.cuda.hybrid_runner")
    seen = {}
    monkeypatch.setattr(hybrid_runner, "open_runner", lambda path, **kw: seen.update(kw, path=path) or "built")
    args = build_parser().parse_args(["serve", "m.ninfer", "--device", "1", "--max-concurrency", "2", *flags])
    runner = backend.cuda_runner("m.ninfer", args, engine_config(args))
    assert not seen  # built on first use, by the engine worker
    assert runner.runner == "built"
    assert seen["cuda_graph"] is graphs and (seen["path"], seen["device"], seen["max_batch"]) == ("m.ninfer", 1, 2)
    assert seen["max_prefill_rows"] == 1024  # one pass a --prefill-chunk


@pytest.mark.parametrize("flags, rows", [(("--prefill-chunk", "2048"), 2048),
                                         (("--prefill-chunk", "4096", "--max-context", "3000"), 3000)])
def test_the_runners_prefill_pass_is_one_engine_chunk(monkeypatch, flags, rows):
    hybrid_runner = pytest.importorskip("ninfer.backends.cuda.hybrid_runner")
    seen = {}
    monkeypatch.setattr(hybrid_runner, "open_runner", lambda path, **kw: seen.update(kw) or "built")
    args = build_parser().parse_args(["serve", "m.ninfer", "--device", "0", *flags])
    assert backend.cuda_runner("m.ninfer", args, engine_config(args)).runner == "built"
    assert seen["max_prefill_rows"] == rows  # a chunk never holds more tokens than a sequence


def _serve_on_cuda(monkeypatch, *argv: str) -> int:
    """The real `ninfer serve` entry, told a GPU is usable. logs.setup would take the process-wide
    "ninfer" logger away from pytest (no propagation): the records are not what these tests check."""
    monkeypatch.setattr(backend, "cuda_available", lambda: True)
    monkeypatch.setattr(logs, "setup", lambda level: None)
    return cli.main(["serve", *argv, "--device", "0", "--port", "0", "--log-stats-interval-ms", "0"])


@pytest.mark.parametrize("failure, extra", [
    ("oom", ()), ("no_device", ()), ("auto_sizing", ("--kv-capacity", "auto")),  # auto builds before the Engine
])
def test_cuda_startup_failures_exit_1_with_one_line(monkeypatch, capsys, tiny_artifact, failure, extra):
    hybrid_runner = pytest.importorskip("ninfer.backends.cuda.hybrid_runner")
    rt = hybrid_runner.rt
    error = {"oom": rt.CudaError("cuMemAlloc(workspace, 8 bytes)", rt.cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY),
             "no_device": ValueError("device 0 does not exist (0 CUDA devices)"),
             "auto_sizing": MemoryError("--kv-capacity auto: 5 bytes free leave no room for a KV pool")}[failure]

    def fail(path, **kw):
        raise error

    monkeypatch.setattr(hybrid_runner, "open_runner", fail)
    assert _serve_on_cuda(monkeypatch, tiny_artifact, *extra) == 1
    assert capsys.readouterr().err == f"ninfer serve: cannot start the CUDA backend on device 0: {error}\n"


def test_bad_cuda_sync_is_refused_before_loading(monkeypatch, capsys):
    pytest.importorskip("ninfer.backends.cuda.runtime")
    monkeypatch.setenv("NINFER_CUDA_SYNC", "bogus")
    assert _serve_on_cuda(monkeypatch, "missing.ninfer") == 2  # refused before the artifact is even opened
    assert capsys.readouterr().err == ("ninfer serve: NINFER_CUDA_SYNC must be one of spin, yield, blocking, got "
                                       "'bogus' (how the host waits for the GPU; see docs/cli.md, Environment).\n")
    options.check_capabilities(build_parser().parse_args(["serve", "m.ninfer", "--device", "cpu"]))  # read only for a GPU
    monkeypatch.setenv("NINFER_CUDA_SYNC", " Blocking ")
    options.check_capabilities(build_parser().parse_args(["serve", "m.ninfer", "--device", "0"]), cuda_available=True)


async def test_random_weights_server_start_record_has_no_file_formats(nursery, tiny_artifact, tmp_path):
    """--random-weights with --request-log-jsonl: server_start names the weights' source and counts no
    file's tensors (it raised AttributeError on the RandomWeightsModel). The runner here is a
    reference runner standing in for the GPU's; the record is what is checked."""
    def factory(art, config):
        return ReferenceRunner(tiny_artifact, page_size=config.page_size, num_pages=config.kv_pages,
                               max_batch=config.max_concurrency, max_context=config.max_context)

    log = tmp_path / "requests.jsonl"
    args = build_parser().parse_args(["serve", "--random-weights", "qwen3-8b", "--device", "0", "--port", "0",
                                      "--max-context", "256", "--log-stats-interval-ms", "0",
                                      "--request-log-jsonl", str(log)])
    await nursery.start(lambda task_status: run_server(args, [], runner_factory=factory, task_status=task_status))
    start = json.loads(log.read_text().splitlines()[0])
    assert start["event"] == "server_start" and start["artifact"] == "random-weights:qwen3-8b"
    assert start["formats"]["artifact"] is None
    nursery.cancel_scope.cancel()
