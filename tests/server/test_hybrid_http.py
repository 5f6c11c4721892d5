"""A hybrid (Gated DeltaNet) model served by `ninfer serve` reuses its previous turn over HTTP.

A hybrid layer's past is one recurrent state, so reuse lands only where a StateImage checkpoint
was kept; a short multi-turn chat must still find its first turn (issue 7: unlike a fixed
528-token grid). Driven through the real server, reference backend, tiny random ``tiny-qwen3-next``.
"""

from __future__ import annotations

import re

import httpx
import pytest

from ninfer.convert.random_model import make_random_artifact

MODEL = "random-tiny-qwen3-next"
# About 50 prompt tokens with the synthetic tokenizer and the Qwen3 template.
FIRST = [{"role": "system", "content": "You are a terse assistant that answers questions about the weather."},
         {"role": "user", "content": "What is the weather like in Paris today, and should I take an umbrella?"}]
FOLLOW_UP = "And tomorrow in Lyon?"


@pytest.fixture(scope="module")
def hybrid_artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid") / "hybrid.ninfer"
    make_random_artifact(path, "tiny-qwen3-next", seed=4)
    return str(path)


def messages_tokens(srv, messages: list[dict]) -> int:
    """Tokens of ``messages`` rendered without the generation prompt: the first turn as it reappears
    in the second turn's prompt. The generation prompt (``<|im_start|>assistant\\n<think>\\n``) does
    not reappear (history renders the assistant turn without ``<think>``), so the server marks this
    frontier (``prefix_before_generation``) as the request's input checkpoint."""
    prompt = srv.state.prompts.formatter.render(messages, None, add_generation_prompt=False, boundary_messages=())
    return len(prompt.token_ids)


def state_ops(metrics: str) -> dict[str, float]:
    """ninfer_state_image_operations_total by operation, from the /metrics text."""
    found = re.findall(r'^ninfer_state_image_operations_total\{operation="(\w+)"\} (\S+)$', metrics, re.M)
    assert found, "no StateImage operation counters on /metrics"
    return {op: float(v) for op, v in found}


async def test_chat_completions_second_turn_reuses_the_first(start_server, hybrid_artifact):
    # Room for both first-turn checkpoints (input frontier and generation end) on the device, so the
    # second turn copies its state device to device ("reuse"); the default is tested below.
    srv = await start_server("--device-state-slots", "2", artifact=hybrid_artifact)
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        body = {"model": MODEL, "messages": FIRST, "max_tokens": 8, "temperature": 0}
        one = (await c.post("/v1/chat/completions", json=body)).json()
        assert 40 <= one["usage"]["prompt_tokens"] <= 80, one["usage"]
        answer = one["choices"][0]["message"]["content"] or ""
        turn2 = [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
        two = (await c.post("/v1/chat/completions", json={**body, "messages": turn2})).json()
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        first_turn = messages_tokens(srv, FIRST)
        assert 0 < one["usage"]["prompt_tokens"] - first_turn <= 8  # only the generation prompt is left out
        assert cached >= first_turn, (cached, first_turn, one["usage"], two["usage"])
        assert cached < two["usage"]["prompt_tokens"]
        ops = state_ops((await c.get("/metrics")).text)
        assert ops["reuse"] == 1 and ops["restore_from_host"] == 0, ops
    # The reused state changes nothing: a cold server answers turn two with the same greedy tokens.
    cold = await start_server(artifact=hybrid_artifact)
    async with httpx.AsyncClient(base_url=cold.url, timeout=30) as c:
        fresh = (await c.post("/v1/chat/completions", json={**body, "messages": turn2})).json()
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    said = two["choices"][0]["message"]
    assert (said["content"] or "") + (said.get("reasoning_content") or "")  # 8 tokens of something
    assert fresh["choices"][0]["message"] == said


async def test_messages_second_turn_reads_the_cache(start_server, hybrid_artifact):
    # Default serve options: one spare device StateImage at --max-concurrency 1, so the first turn's
    # generation-end checkpoint spills its input checkpoint to Host; turn two restores it from there.
    srv = await start_server(artifact=hybrid_artifact)
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        system, user = FIRST[0]["content"], FIRST[1:]
        body = {"model": MODEL, "system": system, "messages": user, "max_tokens": 8, "temperature": 0}
        one = (await c.post("/v1/messages", json=body)).json()
        assert one["usage"]["cache_read_input_tokens"] == 0, one["usage"]
        answer = "".join(b["text"] for b in one["content"] if b["type"] == "text")
        turn2 = [*user, {"role": "assistant", "content": answer or "ok"}, {"role": "user", "content": FOLLOW_UP}]
        two = (await c.post("/v1/messages", json={**body, "messages": turn2})).json()
        first_turn = messages_tokens(srv, FIRST)
        assert two["usage"]["cache_read_input_tokens"] >= first_turn, (first_turn, one["usage"], two["usage"])
        ops = state_ops((await c.get("/metrics")).text)
        assert ops["restore_from_host"] == 1 and ops["spill"] > 0, ops
