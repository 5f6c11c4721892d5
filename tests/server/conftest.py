"""Live-server fixtures: a tiny random artifact served by hypercorn on a free loopback port."""

from __future__ import annotations

import pytest

from ninfer.backends.reference import ReferenceRunner
from ninfer.cli import build_parser
from ninfer.convert.random_model import make_random_artifact
from ninfer.server.main import run_server
from server.scripted import ScriptedRunner


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("artifact") / "tiny.ninfer"
    make_random_artifact(path, "tiny-qwen3", seed=3)
    return str(path)


@pytest.fixture(scope="session")
def smollm2_artifact():
    """The real demo model (converted once into the shared NINFER_CACHE); skipped when not installed."""
    from ninfer import demo

    try:
        return str(demo.default_artifact())
    except demo.DemoModelMissing as e:
        pytest.skip(str(e))


def serve_args(artifact: str, *extra: str):
    return build_parser().parse_args(["serve", artifact, "--port", "0", "--max-context", "256",
                                      "--log-stats-interval-ms", "0", "--log-level", "warning", "--device", "cpu", *extra])


@pytest.fixture
def start_server(nursery, tiny_artifact):
    """``await start_server(*cli_args, keepalive_s=..., scripted=False)`` → RunningServer."""

    async def start(*extra: str, keepalive_s: float = 5.0, scripted: bool = False, artifact: str | None = None):
        args = serve_args(artifact or tiny_artifact, *extra)
        factory = None
        if scripted:
            def factory(art, config):
                inner = ReferenceRunner(art, page_size=config.page_size, num_pages=config.kv_pages,
                                        max_batch=config.max_concurrency, max_context=config.max_context)
                runner = ScriptedRunner(inner)
                start.runner = runner
                return runner
        return await nursery.start(lambda task_status: run_server(
            args, ["serve", *extra], keepalive_s=keepalive_s, runner_factory=factory, task_status=task_status))

    return start
