"""A sticky CUDA error in the middle of serving (CPU: a runner that raises the CUDA backend's own error).

The error makes the engine unavailable: /health answers 503, in-flight requests end (an aggregate
with 503 engine_unavailable, a stream with that error frame and no [DONE]) with a log record each,
new requests get 503 engine_unavailable, and the server still shuts down promptly.
"""

from __future__ import annotations

import json
import logging
import threading

import httpx
import trio

from cuda.bindings import driver as cu
from ninfer.backends.cuda.runtime import CudaError
from ninfer.backends.reference import ReferenceRunner
from ninfer.server.main import run_server
from server.conftest import serve_args

MODEL = "random-tiny-qwen3"
HI = [{"role": "user", "content": "Hello there"}]


class IllegalAddressRunner:
    """The reference backend until ``armed`` decode steps have run, then CUDA_ERROR_ILLEGAL_ADDRESS on
    every call, as a CUDA runner whose context died does."""

    def __init__(self, inner: ReferenceRunner):
        self._inner = inner
        self.info = inner.info
        self.decodes = 0
        self.armed: int | None = None
        self.both_running = threading.Event()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def decode(self, batch):
        self.launch_decode(batch)
        return self.finish_decode()

    def launch_decode(self, batch, follow=False):
        self.decodes += 1
        if len(batch.lanes) == 2:
            self.both_running.set()
        if self.armed is not None and self.decodes >= self.armed:
            raise CudaError("cuGraphLaunch", cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
        self._inner.launch_decode(batch, follow)


async def test_sticky_cuda_error_makes_the_engine_unavailable(nursery, tiny_artifact, caplog):
    assert CudaError("x", cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS).sticky
    runners = []

    def factory(art, config):
        inner = ReferenceRunner(art, page_size=config.page_size, num_pages=config.kv_pages,
                                max_batch=config.max_concurrency, max_context=config.max_context)
        runners.append(IllegalAddressRunner(inner))
        return runners[0]

    caplog.set_level(logging.INFO, logger="ninfer")
    args = serve_args(tiny_artifact, "--max-concurrency", "2", "--kv-capacity", "512")
    cancel = trio.CancelScope()

    async def serve(task_status):
        with cancel:
            await run_server(args, [], runner_factory=factory, task_status=task_status)

    srv = await nursery.start(serve)
    runner = runners[0]
    body = {"model": MODEL, "messages": HI, "max_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    results = {}
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        assert (await c.get("/health")).status_code == 200

        async def aggregate():
            results["aggregate"] = await c.post("/v1/chat/completions", json=body)

        async def stream():
            async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                results["stream_status"] = r.status_code
                results["stream"] = [line async for line in r.aiter_lines() if line.startswith("data: ")]

        async def arm_when_both_run():
            await trio.to_thread.run_sync(runner.both_running.wait, 20)
            runner.armed = runner.decodes + 3

        with trio.fail_after(60):  # nothing hangs
            async with trio.open_nursery() as n:
                n.start_soon(aggregate)
                n.start_soon(stream)
                n.start_soon(arm_when_both_run)

        r = results["aggregate"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert results["stream_status"] == 200
        frames = results["stream"]
        assert frames[-1] != "data: [DONE]"
        error = json.loads(frames[-1][6:])["error"]
        assert error["code"] == "engine_unavailable"
        assert json.loads(frames[0][6:])["choices"][0]["delta"]["role"] == "assistant"  # it began first
        assert (await c.get("/health")).json() == {"status": "unavailable"}
        assert (await c.get("/health")).status_code == 503
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    failures = [rec.getMessage() for rec in caplog.records if "engine failure" in rec.getMessage()]
    assert len(failures) == 2 and all("CUDA_ERROR_ILLEGAL_ADDRESS" in m for m in failures)
    with trio.fail_after(20):
        cancel.cancel()
        while runners and not cancel.cancelled_caught:
            await trio.sleep(0.05)
