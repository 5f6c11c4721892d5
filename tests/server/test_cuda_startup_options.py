"""`--kv-capacity auto` and `--random-weights` at startup, on the CPU (the GPU side: test_serve_cuda.py)."""

from __future__ import annotations

import logging

import pytest

from ninfer import options
from ninfer.backends.reference import ReferenceRunner
from ninfer.cli import build_parser
from ninfer.server.main import run_server
from ninfer.server.random_weights import RandomWeightsModel
from server.conftest import serve_args


def _refusal(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    with pytest.raises(options.OptionError) as e:
        options.check_capabilities(args, cuda_available=True)
    return str(e.value)


def test_auto_capacity_and_random_weights_need_a_device():
    assert "needs --device" in _refusal(["serve", "model.ninfer", "--kv-capacity", "auto"])
    assert "needs --device" in _refusal(["serve", "--random-weights", "qwen3-8b"])
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
