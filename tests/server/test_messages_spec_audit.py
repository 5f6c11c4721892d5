"""Messages contract points from the spec audit that no other test pins, on the live server.

The streamed stop_sequence terminal, tool_choice none on call-shaped output, and the Anthropic
envelope of authentication and routing failures (the x-api-key header, request-id).
"""

from __future__ import annotations

import anthropic
import httpx

from server.scripted import script, sse_events, tool_call

HI = [{"role": "user", "content": "Hello there"}]
TOOLS = [{"name": "get_weather", "description": "Weather by city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


async def test_streamed_stop_sequence_matches_the_aggregate(start_server):
    srv = await start_server(scripted=True)
    answer = script(srv.state.prompts.tokenizer, "Paris it is.", ("<|im_end|>",))
    body = {"model": "m", "max_tokens": 100, "messages": HI, "stop_sequences": ["END", " it"],
            "thinking": {"type": "disabled"}}
    async with httpx.AsyncClient(base_url=srv.url) as c:
        start_server.runner.scripts.append(answer)
        aggregate = (await c.post("/v1/messages", json=body)).json()
        start_server.runner.scripts.append(answer)
        events = sse_events((await c.post("/v1/messages", json=dict(body, stream=True))).text)
    assert (aggregate["stop_reason"], aggregate["stop_sequence"]) == ("stop_sequence", " it")
    # The terminal names the stop the output matched, not the first one requested.
    assert [n for n, _ in events][-2:] == ["message_delta", "message_stop"]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": " it"}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == aggregate["content"][0]["text"] == "Paris"


async def test_tool_choice_none_never_returns_tool_use(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)
    tok = srv.state.prompts.tokenizer
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x")
    start_server.runner.scripts.append(tool_call(tok))
    m = await client.messages.create(model="m", max_tokens=100, messages=HI, tools=TOOLS,
                                     tool_choice={"type": "none"})
    # Not callable: call-shaped output stays text and the turn ends normally.
    assert [b.type for b in m.content] == ["text"] and "get_weather" in m.content[0].text
    assert m.stop_reason == "end_turn"
    await client.close()


async def test_auth_and_routing_failures_use_the_anthropic_envelope(start_server):
    srv = await start_server("--api-key", "sekret")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        for path, body in (("/v1/messages", {"model": "m", "max_tokens": 1, "messages": HI}),
                           ("/v1/messages/count_tokens", {"model": "m", "messages": HI})):
            for headers in ({}, {"x-api-key": "wrong"}):
                r = await c.post(path, json=body, headers=headers)
                err = r.json()
                assert r.status_code == 401 and err["type"] == "error", r.text
                assert err["error"]["type"] == "authentication_error"
                assert err["request_id"] == r.headers["request-id"]
        r = await c.post("/v1/messages/batches", json={}, headers={"x-api-key": "sekret"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert r.json()["request_id"] == r.headers["request-id"]
    # The SDK sends x-api-key and anthropic-version; neither version nor beta headers gate a request.
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="sekret",
                                      default_headers={"anthropic-beta": "some-future-beta"})
    n = await client.messages.count_tokens(model="m", messages=HI)
    m = await client.messages.create(model="m", max_tokens=1, messages=HI)
    assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    await client.close()
