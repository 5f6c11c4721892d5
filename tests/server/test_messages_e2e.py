"""Anthropic Messages end to end on the live server: the anthropic SDK, raw SSE, errors, count_tokens."""

from __future__ import annotations

import json

import anthropic
import httpx

from server.scripted import script, sse_events, thinking_answer, tool_call


HI = [{"role": "user", "content": "Hello there"}]
TOOLS = [{"name": "get_weather", "description": "Weather by city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]


async def test_sdk_create_thinking_and_usage(start_server):
    srv = await start_server(scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x")
    want = thinking_answer(tok)
    runner.scripts.append(want)
    m = await client.messages.create(model="claude-local", max_tokens=2000, messages=HI,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.model == "claude-local" and m.id.startswith("msg_") and m.role == "assistant"
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking.strip() == "Let me think." and m.content[0].signature
    assert m.content[1].text == "Paris it is."
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.output_tokens == len(want)
    assert m.usage.input_tokens > 0 and m.usage.cache_read_input_tokens == 0
    assert m.usage.cache_creation_input_tokens is None

    # The same prompt again is read from the prefix cache: the split moves to cache_read.
    runner.scripts.append(want)
    m2 = await client.messages.create(model="claude-local", max_tokens=2000, messages=HI,
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    assert m2.usage.cache_read_input_tokens > 0
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == \
        m.usage.input_tokens + m.usage.cache_read_input_tokens

    # Stop sequence, max_tokens, and the model_context_window_exceeded path.
    runner.scripts.append(script(tok, "Paris it is.", ("<|im_end|>",)))
    m = await client.messages.create(model="m", max_tokens=100, messages=HI, stop_sequences=[" it"],
                                     thinking={"type": "disabled"})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " it"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "Paris"
    m = await client.messages.create(model="m", max_tokens=2, messages=HI)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2
    await client.close()


async def test_sdk_stream_accumulator_and_raw_lifecycle(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)  # tool declarations are long
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x")
    runner.scripts.append(thinking_answer(tok))
    async with client.messages.stream(model="m", max_tokens=2000, messages=HI,
                                      thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "Paris it is." and final.content[0].signature
    assert final.stop_reason == "end_turn"

    runner.scripts.append(tool_call(tok))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 100, "messages": HI, "tools": TOOLS,
                                               "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream"), r.text
    assert r.headers["request-id"].startswith("req_")
    events = sse_events(r.text)
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["output_tokens"] == 0
    # Every block opens, streams and closes in order; indices are stable.
    blocks: dict[int, dict] = {}
    for n, d in events:
        if n == "content_block_start":
            assert d["index"] == len(blocks)
            blocks[d["index"]] = dict(d["content_block"], _json="", _open=True)
        elif n == "content_block_delta":
            b = blocks[d["index"]]
            assert b["_open"]
            delta = d["delta"]
            if delta["type"] == "text_delta":
                b["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                b["_json"] += delta["partial_json"]
        elif n == "content_block_stop":
            blocks[d["index"]]["_open"] = False
    assert [b["type"] for b in blocks.values()] == ["text", "tool_use"]
    assert blocks[0]["text"] == "Checking.\n"
    assert blocks[1]["name"] == "get_weather" and blocks[1]["id"].startswith("toolu_")
    assert json.loads(blocks[1]["_json"]) == {"city": "Paris", "days": 3}
    final_delta = events[-2][1]
    assert final_delta["delta"]["stop_reason"] == "tool_use"
    assert final_delta["usage"]["input_tokens"] == start["usage"]["input_tokens"]

    # The same request again: message_start already carries the exact cache-read split.
    runner.scripts.append(tool_call(tok))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 100, "messages": HI, "tools": TOOLS,
                                               "stream": True})
    events = sse_events(r.text)
    start_usage, end_usage = events[0][1]["message"]["usage"], events[-2][1]["usage"]
    assert start_usage["cache_read_input_tokens"] > 0
    for key in ("input_tokens", "cache_read_input_tokens"):
        assert start_usage[key] == end_usage[key]
    assert start_usage["input_tokens"] + start_usage["cache_read_input_tokens"] == \
        start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"]
    await client.close()


async def test_thinking_signature_delta_precedes_stop(start_server):
    srv = await start_server(scripted=True)
    start_server.runner.scripts.append(thinking_answer(srv.state.prompts.tokenizer))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 2000, "messages": HI, "stream": True,
                                               "thinking": {"type": "adaptive"}})
    events = sse_events(r.text)
    thinking = [d for n, d in events if d.get("index") == 0]
    assert thinking[0]["content_block"]["type"] == "thinking"
    assert thinking[-2]["delta"]["type"] == "signature_delta" and thinking[-1]["type"] == "content_block_stop"
    text = "".join(d["delta"].get("thinking", "") for d in thinking if d["type"] == "content_block_delta")
    assert text.strip() == "Let me think."


async def test_errors_count_tokens_and_prefill(start_server):
    srv = await start_server("--max-context", "1024")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 0, "messages": HI})
        body = r.json()
        assert r.status_code == 400 and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]
        assert body["request_id"] == r.headers["request-id"]
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HI, "stop_sequences": "END"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "stop_sequences" in r.json()["error"]["message"]
        # More than Chat's four stop strings run (the text layer used to refuse a fifth as an internal error).
        stops = [f"zq{i}" for i in range(8)]
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HI, "stop_sequences": stops})
        assert r.status_code == 200 and r.json()["stop_reason"] == "max_tokens", r.text
        r = await c.post("/v1/messages", content=b"{oops")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await c.post("/v1/messages", json={"model": "m", "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]}]})
        assert r.status_code == 400 and "--vision" in r.json()["error"]["message"]

        count = await c.post("/v1/messages/count_tokens", json={"model": "m", "messages": HI})
        assert count.status_code == 200 and count.headers["request-id"]
        n = count.json()["input_tokens"]
        # The count is the prompt the create call would run: same as its usage.
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": HI})
        u = r.json()["usage"]
        assert u["input_tokens"] + u["cache_read_input_tokens"] == n
        # The billing header block is consumed before counting; tools add prompt tokens.
        billed = await c.post("/v1/messages/count_tokens", json={
            "model": "m", "messages": HI,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1"}]})
        assert billed.json()["input_tokens"] == n
        plain = await c.post("/v1/messages/count_tokens", json={
            "model": "m", "messages": HI, "system": "x-anthropic-billing-header: cc_version=1"})
        assert plain.json()["input_tokens"] > n
        with_tools = await c.post("/v1/messages/count_tokens", json={"model": "m", "messages": HI, "tools": TOOLS})
        assert with_tools.json()["input_tokens"] > n

        # An assistant prefill: the prompt continues the given text (it is counted), no thinking.
        prefill = HI + [{"role": "assistant", "content": "The answer is"}]
        pc = await c.post("/v1/messages/count_tokens", json={"model": "m", "messages": prefill})
        assert pc.json()["input_tokens"] > n
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 3, "messages": prefill})
        assert r.status_code == 200
        assert r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"] == \
            pc.json()["input_tokens"]
        assert all(b["type"] == "text" for b in r.json()["content"])
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 3000, "messages": prefill,
                                               "thinking": {"type": "enabled", "budget_tokens": 1024}})
        assert r.status_code == 400 and "prefill" in r.json()["error"]["message"]


async def test_overload_is_529(start_server):
    srv = await start_server("--max-concurrency", "1", "--max-pending-requests", "0")
    ticket = srv.state.engine.reserve()  # holds the server's only request slot
    try:
        async with httpx.AsyncClient(base_url=srv.url) as c:
            r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": HI})
            assert r.status_code == 529
            assert r.json()["error"]["type"] == "overloaded_error" and r.json()["request_id"]
            r = await c.post("/v1/messages/count_tokens", json={"model": "m", "messages": HI})
            assert r.status_code == 200  # counting runs no generation and needs no slot
    finally:
        ticket.release()


async def test_sdk_count_tokens(start_server):
    srv = await start_server("--max-context", "1024")
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x")
    plain = await client.messages.count_tokens(model="m", messages=HI)
    tools = await client.messages.count_tokens(model="m", messages=HI, tools=TOOLS)
    assert 0 < plain.input_tokens < tools.input_tokens
    await client.close()


async def test_queue_timeout_is_504(start_server):
    srv = await start_server("--max-context", "1024", "--pending-timeout-ms", "50", scripted=True)
    start_server.runner.scripts.append(srv.state.prompts.tokenizer.encode(" word" * 400))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        body = {"model": "m", "max_tokens": 400, "messages": HI, "stream": True}
        async with c.stream("POST", "/v1/messages", json=body) as running:
            lines = running.aiter_lines()
            assert await anext(lines) == "event: message_start"  # admitted: it holds the only lane
            r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": HI})
            assert r.status_code == 504
            assert r.json()["error"]["type"] == "timeout_error" and r.json()["request_id"] == r.headers["request-id"]


async def test_internal_failure_mid_stream_is_an_error_event(start_server, monkeypatch):
    from protocols.anthropic_output import BlockAssembler

    srv = await start_server(scripted=True)
    start_server.runner.scripts.append(script(srv.state.prompts.tokenizer, "Hi there"))

    def broken(self, ev):
        raise RuntimeError("assembler invariant broken")

    monkeypatch.setattr(BlockAssembler, "feed", broken)
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 3, "messages": HI, "stream": True})
        metrics = (await c.get("/metrics")).text
    assert "ninfer_response_failures_total 1.0" in metrics  # a failure after the response started
    events = sse_events(r.text)
    assert [n for n, _ in events] == ["message_start", "ping", "error"]
    err = events[-1][1]
    assert err["error"]["type"] == "api_error" and err["request_id"] == r.headers["request-id"]
    assert "invariant" not in r.text


async def test_context_exhaustion_is_model_context_window_exceeded(start_server):
    srv = await start_server("--max-context", "64")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 1000, "messages": HI})
    body = r.json()
    assert body["stop_reason"] == "model_context_window_exceeded"
    u = body["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["output_tokens"] == 64


async def test_thinking_budget_reaches_the_engine(start_server, monkeypatch):
    from ninfer.server import generation

    srv = await start_server("--max-context", "1024", "--default-thinking-budget", "64", scripted=True)
    for _ in range(3):  # short answers: the budget is a cap, not a length
        start_server.runner.scripts.append(script(srv.state.prompts.tokenizer, "Hi", ("<|im_end|>",)))
    seen = []
    real = generation.GenerationRequest

    def recording(**kw):
        seen.append((kw["thinking"].starts_in_thinking, kw["thinking"].budget, kw["max_tokens"]))
        return real(**kw)

    monkeypatch.setattr(generation, "GenerationRequest", recording)
    async with httpx.AsyncClient(base_url=srv.url) as c:
        for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}, {"type": "disabled"}):
            r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 2000, "messages": HI,
                                                   "thinking": thinking})
            assert r.status_code == 200, r.text
    # enabled: the request's budget; adaptive: the server default; disabled: no thinking, no cap.
    assert [s[:2] for s in seen] == [(True, 1024), (True, 64), (False, None)]
    assert all(s[2] == 2000 for s in seen)


async def test_thinking_budget_checked_against_the_default_max_tokens(start_server):
    srv = await start_server("--default-max-tokens", "1500", scripted=True)
    start_server.runner.scripts.append(thinking_answer(srv.state.prompts.tokenizer))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        # max_tokens omitted: the budget must stay below --default-max-tokens, as if it were explicit.
        r = await c.post("/v1/messages", json={"model": "m", "messages": HI,
                                               "thinking": {"type": "enabled", "budget_tokens": 1500}})
        body = r.json()
        assert r.status_code == 400 and body["error"]["type"] == "invalid_request_error"
        assert "thinking.budget_tokens" in body["error"]["message"] and "1500" in body["error"]["message"]
        explicit = await c.post("/v1/messages", json={"model": "m", "messages": HI, "max_tokens": 1500,
                                                      "thinking": {"type": "enabled", "budget_tokens": 1500}})
        assert explicit.status_code == 400 and "thinking.budget_tokens" in explicit.json()["error"]["message"]
        r = await c.post("/v1/messages", json={"model": "m", "messages": HI,
                                               "thinking": {"type": "enabled", "budget_tokens": 1024}})
        assert r.status_code == 200 and r.json()["content"][0]["type"] == "thinking"


async def test_every_sdk_effort_value_is_accepted(start_server):
    """output_config.effort takes the protocol's whole value set, xhigh included."""
    srv = await start_server("--max-context", "1024")
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x")
    for effort in ("low", "medium", "high", "xhigh", "max"):
        m = await client.messages.create(model="m", max_tokens=2, messages=HI, output_config={"effort": effort})
        assert m.usage.output_tokens > 0
        n = await client.messages.count_tokens(model="m", messages=HI, output_config={"effort": effort})
        assert n.input_tokens > 0
    await client.close()
