"""Chat Completions against serving.md, where the other chat tests leave the spec's words unchecked:
parallel tool-call deltas, stop strings in the reasoning channel, and the media refusals of a
server without --vision, each over the live server's wire."""

from __future__ import annotations

import json

import httpx
import pytest

from server.scripted import script, sse_json

MODEL = "random-tiny-qwen3"
HI = [{"role": "user", "content": "Hello there"}]
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}} for name in ("get_weather", "get_time")]


def two_calls(tok):
    def call(name, city):
        return [("<tool_call>",), f"\n<function={name}>\n<parameter=city>\n{city}\n</parameter>\n</function>\n",
                ("</tool_call>",)]

    return script(tok, ("</think>",), "\n\nOK.\n", *call("get_weather", "Paris"), "\n", *call("get_time", "Rome"),
                  ("<|im_end|>",))


async def test_parallel_tool_calls_aggregate_and_stream(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)  # the tool prompt is long
    runner = start_server.runner
    body = {"model": MODEL, "messages": HI, "max_tokens": 200, "tools": TOOLS}
    async with httpx.AsyncClient(base_url=srv.url) as c:
        runner.scripts.append(two_calls(srv.state.prompts.tokenizer))
        choice = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"city": "Rome"})]
        assert len({t["id"] for t in calls}) == 2 and choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "OK.\n" and choice["message"]["refusal"] is None

        runner.scripts.append(two_calls(srv.state.prompts.tokenizer))
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        r = await c.post("/v1/chat/completions", json={**body, **stream})
    frames = sse_json(r.text)
    assert frames[-1] == "[DONE]"
    *deltas, finish, usage = frames[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens_details"]["reasoning_tokens"] >= 1
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    pieces = [d for f in deltas for d in f["choices"][0]["delta"].get("tool_calls", [])]
    # Each call opens with its id, type and name (arguments ""), then only its index and argument text.
    opening = [p for p in pieces if "id" in p]
    assert [(p["index"], p["type"], p["function"]) for p in opening] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""})]
    args = {i: "".join(p["function"]["arguments"] for p in pieces if p["index"] == i) for i in (0, 1)}
    assert json.loads(args[0]) == {"city": "Paris"} and json.loads(args[1]) == {"city": "Rome"}
    assert all(set(p) == {"index", "function"} for p in pieces if "id" not in p)


async def test_stop_strings_apply_to_reasoning(start_server):
    srv = await start_server(scripted=True)
    thinking = script(srv.state.prompts.tokenizer, "Let me STOP think.", ("</think>",), "\n\nParis.", ("<|im_end|>",))
    body = {"model": MODEL, "messages": HI, "max_tokens": 64, "stop": ["STOP"]}
    async with httpx.AsyncClient(base_url=srv.url) as c:
        start_server.runner.scripts.append(thinking)
        choice = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["message"]["reasoning_content"] == "Let me " and choice["message"]["content"] == ""
        assert choice["finish_reason"] == "stop"
        start_server.runner.scripts.append(thinking)
        frames = sse_json((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)[:-1]
    deltas = [f["choices"][0]["delta"] for f in frames[1:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me "
    assert not any("content" in d for d in deltas) and frames[-1]["choices"][0]["finish_reason"] == "stop"


def _user(part, role="user"):
    message = {"role": role, "content": [part]}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    return [{"role": "user", "content": "hi"}, message]


@pytest.mark.parametrize("messages, code, param", [
    (_user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}), "vision_disabled",
     "messages[1].content[0]"),
    (_user({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}), "vision_disabled",
     "messages[1].content[0]"),
    (_user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "tool"), "vision_disabled",
     "messages[1].content[0]"),
    (_user({"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}), "vision_disabled",
     "messages[1].content[0]"),
    (_user({"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}),
     "unsupported_parameter", "messages[1].content[0].image_url.detail"),
    (_user({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}), "unsupported_parameter",
     "messages[1].content[0]"),
    (_user({"type": "file", "file": {"file_id": "f"}}), "unsupported_parameter", "messages[1].content[0]"),
])
async def test_media_is_refused_without_vision(start_server, messages, code, param):
    srv = await start_server()
    async with httpx.AsyncClient(base_url=srv.url) as c:
        for stream in (False, True):  # a stream is refused before it starts: a plain JSON error
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "stream": stream})
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
            assert r.headers["x-request-id"]
            err = r.json()["error"]
            assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param)
