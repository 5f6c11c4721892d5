"""Chat Completions end to end on the live server: SDKs, wire shapes, reasoning, tools, stops."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio

from server.scripted import script, sse_json

MODEL = "random-tiny-qwen3"
HI = [{"role": "user", "content": "Hello there"}]


def check_timings(t: dict, usage: dict) -> None:
    assert t["cache_n"] + t["prompt_n"] == usage["prompt_tokens"]
    assert t["predicted_n"] == usage["completion_tokens"]
    for key, v in t.items():
        assert isinstance(v, (int, float)) and v == v and v not in (float("inf"), float("-inf")), key
    if t["predicted_n"] <= 1:
        assert t["predicted_per_second"] == 0.0


async def test_openai_sdk_async_and_sync(start_server):
    srv = await start_server()
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused")
    r = await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.choices[0].message.refusal is None and r.choices[0].logprobs is None
    extra = r.model_extra
    check_timings(extra["timings"], r.usage.model_dump())
    text = (r.choices[0].message.content or "") + (r.choices[0].message.model_extra.get("reasoning_content") or "")

    # Same greedy request streamed: same text, and usage arrives in the final empty-choices chunk.
    stream = await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        d = chunk.choices[0].delta
        pieces.append((d.content or "") + ((d.model_extra or {}).get("reasoning_content") or ""))
    assert "".join(pieces) == text
    assert usage.completion_tokens == 5
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again reuses its prefix
    await client.close()

    def sync_calls():
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused") as c:
            a = c.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=3)
            s = list(c.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, stream=True))
            return a, s

    agg, chunks = await trio.to_thread.run_sync(sync_calls)
    assert agg.usage.completion_tokens == 3
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "length"


async def test_stream_wire_sequence(start_server):
    srv = await start_server(scripted=True)
    tok = srv.state.prompts.tokenizer
    async with httpx.AsyncClient(base_url=srv.url) as c:
        body = {"model": MODEL, "messages": HI, "max_tokens": 4, "stream": True}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-request-id"]
        frames = sse_json(r.text)
        assert frames[-1] == "[DONE]"
        first, *middle, finish = frames[:-1]
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
        assert "timings" in finish and "usage" not in finish  # timings ride on the last JSON chunk
        ids = {f["id"] for f in frames[:-1]}
        assert len(ids) == 1 and first["object"] == "chat.completion.chunk"
        for f in middle:
            (choice,) = f["choices"]
            assert set(choice["delta"]) <= {"content", "reasoning_content"} and choice["logprobs"] is None
            assert "timings" not in f

        body.update(stream_options={"include_usage": True}, timings_per_token=True, return_progress=True,
                    max_tokens=50)
        start_server.runner.scripts.append(script(tok, "Hmm, so.", ("</think>",), "\n\nIt is Paris.", ("<|im_end|>",)))
        frames = sse_json((await c.post("/v1/chat/completions", json=body)).text)[:-1]
        usage_chunk = frames[-1]
        assert usage_chunk["choices"] == [] and "timings" in usage_chunk
        check_timings(usage_chunk["timings"], usage_chunk["usage"])
        assert "timings" not in frames[-2]
        progress = [f["prompt_progress"] for f in frames if "prompt_progress" in f]
        # The handle may coalesce progress for a slow consumer, so the initial processed == cache event
        # can be merged into a later one; cumulative values never move backwards.
        assert progress and progress[0]["cache"] <= progress[0]["processed"]
        assert progress[-1]["processed"] == progress[-1]["total"] == usage_chunk["usage"]["prompt_tokens"]
        assert [p["processed"] for p in progress] == sorted(p["processed"] for p in progress)
        first_output = next(i for i, f in enumerate(frames) if f["choices"] and f["choices"][0]["delta"].get(
            "content", f["choices"][0]["delta"].get("reasoning_content")))
        last_progress = max(i for i, f in enumerate(frames) if "prompt_progress" in f)
        assert last_progress < first_output
        visible = [f for f in frames if f["choices"] and {"content", "reasoning_content"} & set(f["choices"][0]["delta"])
                   and f is not frames[0]]
        assert visible and all("timings" in f for f in visible)

        # A slow prefill: the snapshots count prompt time from admission, not from when the first
        # progress event reached the server (it is published once the prefill step has run).
        start_server.runner.prefill_delay = 0.3
        start_server.runner.scripts.append(script(tok, "Hmm.", ("</think>",), "\n\nParis.", ("<|im_end|>",)))
        frames = sse_json((await c.post("/v1/chat/completions", json=body)).text)[:-1]
        snapshot = next(f["timings"] for f in frames if f["choices"] and f is not frames[0]
                        and {"content", "reasoning_content"} & set(f["choices"][0]["delta"]))
        assert snapshot["prompt_ms"] >= 300 and snapshot["prompt_ms"] <= frames[-1]["timings"]["prompt_ms"] + 50


async def test_a_stream_starts_with_the_initial_progress_while_the_first_prefill_runs(start_server):
    """Admission publishes the initial prompt_progress (processed == cache) before the runner's
    first prefill call: the stream's role chunk and that event arrive while the prefill is held."""
    srv = await start_server(scripted=True)
    runner = start_server.runner
    runner.scripts.append(script(srv.state.prompts.tokenizer, "Hmm.", ("</think>",), "\n\nParis.", ("<|im_end|>",)))
    body = {"model": MODEL, "messages": HI, "max_tokens": 16, "stream": True, "return_progress": True}
    runner.prefill_gate.clear()
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            frames = r.aiter_lines()
            data = []
            async for line in frames:
                if line.startswith("data: "):
                    data.append(json.loads(line[6:]))
                if len(data) == 2:
                    break
            assert data[0]["choices"][0]["delta"]["role"] == "assistant"
            initial = data[1]["prompt_progress"]
            assert initial["processed"] == initial["cache"] < initial["total"]
            runner.prefill_gate.set()
            rest = [line async for line in frames if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"


async def test_reasoning_content_and_stop_via_scripted_runner(start_server):
    srv = await start_server(scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    want = script(tok, "Let me think.", ("</think>",), "\n\nThe answer is Paris. STOP here", ("<|im_end|>",))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        runner.scripts.append(want)
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 64})
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning_content"].strip() == "Let me think."
        assert msg["content"] == "The answer is Paris. STOP here"
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == len(want)
        assert 0 < usage["completion_tokens_details"]["reasoning_tokens"] < len(want)

        runner.scripts.append(want)
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 64,
                                                       "stop": [" STOP"], "stream": True})
        frames = sse_json(r.text)[:-1]
        content = "".join(f["choices"][0]["delta"].get("content", "") for f in frames if f["choices"])
        reasoning = "".join(f["choices"][0]["delta"].get("reasoning_content", "") for f in frames if f["choices"])
        assert reasoning.strip() == "Let me think." and content == "The answer is Paris."
        assert frames[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stop_string_at_the_token_limit_is_a_stop(start_server):
    """A stop string that ends the output as max_tokens is reached (or while the engine's stop is still
    taking effect) finishes with "stop": the answer ended at the stop, it was not truncated."""
    srv = await start_server(scripted=True)
    tok = srv.state.prompts.tokenizer
    want = script(tok, ("</think>",), "\n\nThe answer is Paris. STOP here and more words follow", ("<|im_end|>",))
    upto = len(script(tok, ("</think>",), "\n\nThe answer is Paris. STOP"))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        for extra in (0, 1, 2):
            body = {"model": MODEL, "messages": HI, "max_tokens": upto + extra, "stop": [" STOP"]}
            start_server.runner.scripts.append(want)
            choice = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
            assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", "The answer is Paris."), extra
            start_server.runner.scripts.append(want)
            frames = sse_json((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)
            assert frames[-2]["choices"][0]["finish_reason"] == "stop", extra
        # Without a stop string the same budget is a truncation.
        start_server.runner.scripts.append(want)
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": upto})
        assert r.json()["choices"][0]["finish_reason"] == "length"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


async def test_tool_calls_aggregate_and_stream(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)  # the tool prompt is long
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    call = script(tok, ("</think>",), "\n\nChecking.\n", ("<tool_call>",),
                  "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                  "</parameter>\n</function>\n", ("</tool_call>",), ("<|im_end|>",))
    body = {"model": MODEL, "messages": HI, "max_tokens": 100, "tools": TOOLS}
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    runner.scripts.append(call)
    r = await client.chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking.\n"
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather" and tc.id.startswith("call_")
    assert json.loads(tc.function.arguments) == {"city": "Paris", "days": 3}
    assert list(json.loads(tc.function.arguments)) == ["city", "days"]

    runner.scripts.append(call)
    stream = await client.chat.completions.create(**body, stream=True)
    args, names, finish = "", [], None
    async for chunk in stream:
        ch = chunk.choices[0]
        for d in ch.delta.tool_calls or []:
            if d.function.name:
                names.append(d.function.name)
                assert d.id.startswith("call_") and d.index == 0
            args += d.function.arguments or ""
        finish = ch.finish_reason or finish
    assert names == ["get_weather"] and json.loads(args) == {"city": "Paris", "days": 3} and finish == "tool_calls"

    # tool_choice none: the same markup stays text.
    runner.scripts.append(call)
    r = await client.chat.completions.create(**body, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"

    # The call replays as history, with its tool result.
    history = HI + [{"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
                    {"role": "tool", "tool_call_id": tc.id, "content": "sunny", "name": "get_weather"}]
    r = await client.chat.completions.create(model=MODEL, messages=history, max_tokens=2, tools=TOOLS)
    assert r.usage.prompt_tokens > 0
    await client.close()


async def test_default_thinking_budget_forces_the_close(start_server):
    srv = await start_server("--default-thinking-budget", "3", scripted=True)
    tok = srv.state.prompts.tokenizer
    # Forced tokens still pass through decode steps whose samples are discarded, so the script is
    # long enough to outlast the close suffix and then supply answer text.
    start_server.runner.scripts.append(script(tok, " one two three" + " word" * 60, ("<|im_end|>",)))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 100})
    body = r.json()
    msg = body["choices"][0]["message"]
    assert "Considering the limited time" in msg["reasoning_content"]  # the guidance streams as reasoning
    assert "</think>" not in msg["reasoning_content"] and msg["content"]  # generation continued after it
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 3  # forced guidance counts


async def test_zero_max_tokens_is_prompt_processing_only(start_server):
    srv = await start_server()
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = (await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 0})).json()
    assert r["usage"]["completion_tokens"] == 0 and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["message"]["content"] == ""
    t = r["timings"]
    assert t["predicted_n"] == 0 and t["predicted_per_second"] == 0.0 and t["predicted_per_token_ms"] == 0.0
    check_timings(t, r["usage"])


async def test_capacity_rejection_names_the_max_tokens_spelling_sent(start_server):
    srv = await start_server("--default-thinking-budget", "4")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        for field in ("max_tokens", "max_completion_tokens"):
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, field: 6})
            err = r.json()["error"]
            assert (r.status_code, err["code"], err["param"]) == (400, "thinking_budget_capacity_insufficient", field)


async def test_cache_hints_become_exact_token_boundaries(start_server, tmp_path):
    log = tmp_path / "log.jsonl"
    srv = await start_server("--max-context", "1024", "--request-log-jsonl", str(log))
    enc = srv.state.prompts.tokenizer.encode
    closing = 3 + len(enc("\n")) * 2 + len(enc("assistant\n"))  # <|im_end|>\n<|im_start|>assistant\n<think>\n
    body_text = ("The capital of France is Paris and the capital of Germany is Berlin. " * 6).strip()
    marked = [{"role": "system", "content": [{"type": "text", "text": "Be brief.",
                                              "prompt_cache_breakpoint": {"mode": "explicit"}}]},
              {"role": "user", "content": body_text}]
    async with httpx.AsyncClient(base_url=srv.url) as c:
        async def ask(messages, **extra):
            return (await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                               "max_tokens": 1, **extra})).json()

        r1 = await ask([{"role": "user", "content": body_text}])
        r2 = await ask([{"role": "user", "content": body_text + " What about Spain?"}])
        r3 = await ask(marked)
        await ask(marked, prompt_cache_options={"mode": "explicit"})
    starts = [json.loads(line) for line in log.read_text().splitlines()]
    bounds = [r["cache_boundaries"] for r in starts if r["event"] == "request_start"]
    # The implicit boundary ends the latest content part, before the message's closing tokens.
    assert bounds[0] == [r1["usage"]["prompt_tokens"] - closing]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == bounds[0][0]  # the grown message reuses it
    system_end = len(enc("Be brief.")) + 1 + len(enc("system\n"))  # <|im_start|>system\nBe brief.
    assert bounds[2] == [system_end, r3["usage"]["prompt_tokens"] - closing]  # explicit first, then implicit
    assert bounds[3] == [system_end]  # mode explicit: no implicit write


@pytest.mark.slow
async def test_smollm2_answers_over_http(start_server, smollm2_artifact):
    """The real SmolLM2 and its own template through the SDK: a greedy streamed answer names Paris."""
    srv = await start_server("--max-context", "512", artifact=smollm2_artifact)
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    stream = await client.chat.completions.create(
        model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    text, usage = "", None
    async for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert "Paris" in text and usage.completion_tokens <= 16
    await client.close()


async def test_internal_failure_mid_stream_is_an_error_frame(start_server, monkeypatch, caplog):
    from ninfer.server import chat

    srv = await start_server(scripted=True)
    start_server.runner.scripts.append(script(srv.state.prompts.tokenizer, "Hi there"))

    def broken(ev):
        raise RuntimeError("delta invariant broken")

    monkeypatch.setattr(chat, "_delta", broken)
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 3,
                                                       "stream": True})
        metrics = (await c.get("/metrics")).text
    frames = sse_json(r.text)
    assert frames[0]["choices"][0]["delta"]["role"] == "assistant"
    assert frames[-1]["error"]["code"] == "internal_error" and "[DONE]" not in frames
    assert "invariant" not in r.text  # internals are logged, not sent
    assert any("delta invariant broken" in str(rec.exc_info) for rec in caplog.records if rec.exc_info)
    assert "ninfer_response_failures_total 1.0" in metrics


async def test_request_sampling_fields_reach_the_engine(start_server, tmp_path):
    log = tmp_path / "log.jsonl"
    srv = await start_server("--request-log-jsonl", str(log))
    sampling = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "presence_penalty": 1.0,
                "frequency_penalty": -1.0, "seed": -7}
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 1, **sampling})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 1})
        assert r.status_code == 200, r.text
    starts = [rec for rec in map(json.loads, log.read_text().splitlines()) if rec["event"] == "request_start"]
    start, defaulted = starts
    assert start["sampling"] == sampling
    # Unspecified fields are logged as resolved: the seed drawn for the request, the defaults applied.
    assert isinstance(defaulted["sampling"]["seed"], int)
    assert set(defaulted["sampling"]) == set(sampling) and None not in defaulted["sampling"].values()
    assert start["shape"] == {"messages": 1, "tools": 0, "callable_tools": 0, "stream": False}
