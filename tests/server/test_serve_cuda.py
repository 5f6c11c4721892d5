"""`ninfer serve --device 0`: the CUDA backend behind the same HTTP surface (GPU hosts only)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ninfer.convert.random_model import make_random_artifact
from ninfer.models import DenseConfig

pytestmark = pytest.mark.cuda

QWEN3 = DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=2048, hidden_size=256, intermediate_size=384,
                    num_layers=3, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=True, qk_norm=True)


@pytest.fixture(scope="module")
def gpu_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "qwen3.ninfer"
    make_random_artifact(path, QWEN3, seed=3)
    return str(path)


async def _served_greedy_ids(artifact: str, log, flags: list[str]) -> list[list[int]]:
    """Serve ``artifact`` with ``flags``; one plain and one streamed greedy chat; the generated ids."""
    import trio

    from ninfer.cli import build_parser
    from ninfer.server.main import run_server

    body = {"model": "random-Qwen3ForCausalLM", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 24, "temperature": 0}
    args = build_parser().parse_args(["serve", artifact, "--port", "0", "--max-context", "512",
                                      "--log-stats-interval-ms", "0", "--request-log-jsonl", str(log), *flags])
    async with trio.open_nursery() as nursery:
        srv = await nursery.start(lambda task_status: run_server(args, [], task_status=task_status))
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
        r = await client.chat.completions.create(**body)
        assert r.usage.completion_tokens == 24
        chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
        assert chunks[-1].choices[0].finish_reason == "length"
        await client.close()
        async with httpx.AsyncClient(base_url=srv.url) as c:
            assert "ninfer_model_info" in (await c.get("/metrics")).text
        nursery.cancel_scope.cancel()
    done = [json.loads(line) for line in log.read_text().splitlines() if '"request_done"' in line]
    return [d["result"]["generated_token_ids"] for d in done]


def test_cuda_serve_matches_reference(gpu_artifact, tmp_path):
    """Greedy tokens agree across backends. Runs under trio.run (no async pytest plugin on the GPU host)."""
    import trio

    ids = {name: trio.run(_served_greedy_ids, gpu_artifact, tmp_path / f"{name}.jsonl", flags)
           for name, flags in (("cuda", ["--device", "0"]), ("reference", []))}
    assert len(ids["cuda"]) == 2 and ids["cuda"] == ids["reference"]


def test_random_weights_with_auto_kv_capacity(tmp_path, caplog):
    """`--random-weights CONFIG --kv-capacity auto`: no artifact; the pool fills the free memory; text is visible.
    Runs under trio.run (no async pytest plugin needed on the GPU host)."""
    import logging

    import trio

    from ninfer.cli import build_parser
    from ninfer.server.main import run_server

    config = tmp_path / "qwen3.json"
    # Untied, as the 8B shape is: a tied random head mostly repeats its input token (a held-back newline).
    config.write_text(json.dumps({**QWEN3.to_json(), "tie_word_embeddings": False}))
    caplog.set_level(logging.INFO, logger="ninfer")
    args = build_parser().parse_args(["serve", "--port", "0", "--max-context", "512", "--log-stats-interval-ms", "0",
                                      "--device", "0", "--random-weights", str(config), "--kv-capacity", "auto",
                                      "--max-concurrency", "4", "--temperature", "1.0"])

    async def main():
        async with trio.open_nursery() as nursery:
            srv = await nursery.start(lambda task_status: run_server(args, [], task_status=task_status))
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                r = await c.post("/v1/chat/completions", json={
                    "model": "random-Qwen3ForCausalLM", "max_tokens": 32,
                    "messages": [{"role": "user", "content": "Hello there"}]})
            nursery.cancel_scope.cancel()
        return srv, r.json()

    srv, body = trio.run(main)
    assert srv.state.engine.config.kv_capacity > 100_000  # tokens: far beyond --max-context
    assert any("--kv-capacity auto" in r.getMessage() for r in caplog.records)
    assert any("CUDA startup" in r.getMessage() for r in caplog.records)
    message = body["choices"][0]["message"]
    text = (message.get("content") or "") + (message.get("reasoning_content") or "")
    assert body["usage"]["completion_tokens"] > 0 and text.strip(), body
