"""OpenAI Responses end to end on the live server: the openai SDK, raw SSE, the local store."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.scripted import script, sse_events, thinking_answer, tool_call

MODEL = "random-tiny-qwen3"
FN = {"type": "function", "name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
NS = {"type": "namespace", "name": "mcp__wx", "description": "Weather service",
      "tools": [{"type": "function", "name": "get_weather", "parameters": FN["parameters"]}]}


async def test_sdk_create_retrieve_delete_input_items(start_server):
    srv = await start_server(scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    want = thinking_answer(tok)
    runner.scripts.append(want)
    r = await client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.",
                                      max_output_tokens=64, metadata={"k": "v"})
    assert r.status == "completed" and r.id.startswith("resp_") and r.completed_at is not None
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text.strip() == "Let me think." and r.output[0].summary == []
    assert r.output_text == "Paris it is."
    assert r.usage.output_tokens == len(want) and 0 < r.usage.output_tokens_details.reasoning_tokens < len(want)
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.metadata == {"k": "v"} and r.instructions == "Be brief." and r.service_tier == "default"

    got = await client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    items = await client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Hello there"
    deleted = await client.responses.delete(r.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)

    # max_output_tokens exhaustion: incomplete, no completed_at, reasoning-only output stays reasoning-only.
    runner.scripts.append(thinking_answer(tok))
    r = await client.responses.create(model=MODEL, input="Hello there", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.completed_at is None and [i.type for i in r.output] == ["reasoning"]
    await client.close()


async def test_sdk_stream_and_raw_event_sequence(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    runner.scripts.append(thinking_answer(tok))
    async with client.responses.stream(model=MODEL, input="Hello there", max_output_tokens=64) as stream:
        deltas = [ev.delta async for ev in stream if ev.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Paris it is." and final.status == "completed"

    runner.scripts.append(tool_call(tok, "mcp__wx__get_weather"))  # the SDK accumulator over a namespaced call
    async with client.responses.stream(model=MODEL, input="Weather?", tools=[FN, NS]) as stream:
        final = await stream.get_final_response()
    (fc,) = [i for i in final.output if i.type == "function_call"]
    assert (fc.name, fc.namespace, json.loads(fc.arguments)) == ("get_weather", "mcp__wx", {"city": "Paris", "days": 3})

    runner.scripts.append(tool_call(tok, "mcp__wx__get_weather"))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "Weather?", "tools": [FN, NS],
                                                "stream": True, "max_output_tokens": 100})
    assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-request-id"]
    assert "[DONE]" not in r.text
    events = sse_events(r.text)
    assert all(name == d["type"] for name, d in events)
    seqs = [d["sequence_number"] for _, d in events]
    assert seqs == list(range(len(seqs)))
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    done = events[-1][1]["response"]
    msg, fc = done["output"]
    assert msg["content"][0]["text"] == "Checking.\n"
    assert (fc["type"], fc["name"], fc["namespace"]) == ("function_call", "get_weather", "mcp__wx")
    assert json.loads(fc["arguments"]) == {"city": "Paris", "days": 3}
    arg_deltas = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    assert arg_deltas == fc["arguments"]
    (args_done,) = [d for n, d in events if n == "response.function_call_arguments.done"]
    assert args_done["item_id"] == fc["id"] and args_done["arguments"] == fc["arguments"]
    added = [d["item"]["id"] for n, d in events if n == "response.output_item.added"]
    assert added == [msg["id"], fc["id"]]
    await client.close()


async def test_store_rules_and_endpoints(start_server):
    srv = await start_server("--response-store-max-records", "2")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        async def create(**kw):
            body = {"model": MODEL, "input": "Hello there", "max_output_tokens": 1, **kw}
            return await c.post("/v1/responses", json=body)

        unstored = (await create(store=False, parallel_tool_calls=None)).json()
        assert unstored["store"] is False and unstored["parallel_tool_calls"] is True  # null is the default
        r = await c.get(f"/v1/responses/{unstored['id']}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        r = await create(previous_response_id=unstored["id"])
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"

        ids = [(await create(input=[{"role": "user", "content": f"q{i}", "id": f"msg_{i}"}])).json()["id"]
               for i in range(3)]
        assert (await c.get(f"/v1/responses/{ids[0]}")).status_code == 404  # LRU evicted at two records
        assert (await c.get(f"/v1/responses/{ids[2]}")).status_code == 200

        many = [{"role": "user", "content": f"m{i}", "id": f"it_{i}"} for i in range(5)]
        rid = (await create(input=many)).json()["id"]
        page = (await c.get(f"/v1/responses/{rid}/input_items")).json()
        assert [i["id"] for i in page["data"]] == [f"it_{i}" for i in (4, 3, 2, 1, 0)]  # default desc
        page = (await c.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 2})).json()
        assert [i["id"] for i in page["data"]] == ["it_0", "it_1"] and page["has_more"] is True
        assert page["first_id"] == "it_0" and page["last_id"] == "it_1"
        page = (await c.get(f"/v1/responses/{rid}/input_items",
                            params={"order": "asc", "after": "it_3"})).json()
        assert [i["id"] for i in page["data"]] == ["it_4"] and page["has_more"] is False
        for bad in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "nope"}):
            r = await c.get(f"/v1/responses/{rid}/input_items", params=bad)
            assert r.status_code == 400, bad

        r = await c.get(f"/v1/responses/{rid}", params={"stream": "true"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        r = await c.post(f"/v1/responses/{rid}/cancel")
        assert r.status_code == 400 and r.json()["error"]["param"] == "background"
        r = await c.post("/v1/responses/compact", json={"model": MODEL, "input": "x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "compaction_not_supported"
        r = await c.delete(f"/v1/responses/{rid}")
        assert r.json() == {"id": rid, "object": "response.deleted", "deleted": True}
        assert (await c.delete(f"/v1/responses/{rid}")).status_code == 404

        r = await create(unknown_field=1)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


async def test_store_capacity_exceeded(start_server, caplog):
    srv = await start_server("--response-store-max-mib", "0", scripted=True)
    start_server.runner.scripts.append(thinking_answer(srv.state.prompts.tokenizer))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "response_store_capacity_exceeded"
        # after generation: a response failure, with its operational stderr record
        assert "ninfer_response_failures_total 1.0" in (await c.get("/metrics")).text
        assert any("not stored: response_store_capacity_exceeded" in rec.getMessage() for rec in caplog.records)
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 1,
                                                "store": False})
        assert r.status_code == 200
        start_server.runner.scripts.append(thinking_answer(srv.state.prompts.tokenizer))
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 64,
                                                "stream": True})
        events = sse_events(r.text)
        last_name, last = events[-1]
        assert last_name == "response.failed"
        # the open Item closed on the wire before the store failed, as the failed Response shows it
        names = [name for name, _ in events]
        assert names.count("response.output_item.added") == names.count("response.output_item.done") >= 1
        assert last["response"]["error"]["code"] == "response_store_capacity_exceeded"
        assert "ninfer_response_failures_total 2.0" in (await c.get("/metrics")).text


async def test_input_tokens_matches_create(start_server):
    srv = await start_server("--max-context", "1024")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        body = {"model": MODEL, "input": "Count this prompt.", "instructions": "Be brief.", "tools": [FN, NS]}
        n = (await c.post("/v1/responses/input_tokens", json=body)).json()
        assert n["object"] == "response.input_tokens" and n["input_tokens"] > 0
        r = (await c.post("/v1/responses", json={**body, "max_output_tokens": 1})).json()
        assert r["usage"]["input_tokens"] == n["input_tokens"]
        # The same path as create, continuation included.
        child = {"model": MODEL, "input": "And now?", "previous_response_id": r["id"]}
        n2 = (await c.post("/v1/responses/input_tokens", json=child)).json()["input_tokens"]
        r2 = (await c.post("/v1/responses", json={**child, "max_output_tokens": 1})).json()
        alone = (await c.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "And now?"})).json()
        assert r2["usage"]["input_tokens"] == n2 > alone["input_tokens"]  # the parent's Items are included
        r = await c.post("/v1/responses/input_tokens", json={**body, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
        # model is optional when counting (the served one); a wrong one is still refused
        no_model = {k: v for k, v in body.items() if k != "model"}
        assert (await c.post("/v1/responses/input_tokens", json=no_model)).json()["input_tokens"] == n["input_tokens"]
        r = await c.post("/v1/responses/input_tokens", json={**body, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_sdk_input_tokens_count(start_server):
    srv = await start_server()
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    n = await client.responses.input_tokens.count(model=MODEL, input="Count this prompt.")
    r = await client.responses.create(model=MODEL, input="Count this prompt.", max_output_tokens=1)
    assert n.input_tokens == r.usage.input_tokens > 0
    await client.close()


async def test_session_keys_follow_the_stored_chain(start_server, monkeypatch):
    from ninfer.server import generation

    srv = await start_server()
    seen = []
    real = generation.GenerationRequest

    def recording(**kw):
        seen.append((kw["session_key"], kw["capture_endpoint"]))
        return real(**kw)

    monkeypatch.setattr(generation, "GenerationRequest", recording)
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    root = await client.responses.create(model=MODEL, input="Hello", max_output_tokens=1)
    child = await client.responses.create(model=MODEL, input="More", previous_response_id=root.id,
                                          max_output_tokens=1)
    await client.responses.create(model=MODEL, input="Aside", previous_response_id=child.id, store=False,
                                  max_output_tokens=1)
    await client.responses.create(model=MODEL, input="Anonymous", store=False, max_output_tokens=1)
    key = "resp:" + root.id
    assert seen == [(key, True), (key, True), (key, False), (None, True)]
    await client.close()


async def test_internal_failure_mid_stream_is_response_failed(start_server, monkeypatch, caplog):
    from protocols.responses_output import OutputAssembler

    srv = await start_server(scripted=True)
    start_server.runner.scripts.append(script(srv.state.prompts.tokenizer, "Hi there"))

    def broken(self, ev):
        raise RuntimeError("assembler invariant broken")

    monkeypatch.setattr(OutputAssembler, "feed", broken)
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 3,
                                                "stream": True})
        metrics = (await c.get("/metrics")).text
    assert "ninfer_response_failures_total 1.0" in metrics  # a failure after the response started
    events = sse_events(r.text)
    assert [n for n, _ in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "internal_error"
    assert "invariant" not in r.text  # internals are logged, not sent
    assert any("assembler invariant broken" in str(rec.exc_info) for rec in caplog.records if rec.exc_info)


async def test_context_exhaustion_is_incomplete(start_server):
    srv = await start_server("--max-context", "64")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = (await c.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 1000})).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["usage"]["total_tokens"] == 64 and r["completed_at"] is None


async def test_undeclared_or_disabled_calls_stay_text(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    for tools, choice, name in (([FN], "auto", "not_declared"), ([FN], "none", "get_weather"),
                                ([FN, NS], {"type": "allowed_tools", "mode": "auto",
                                            "tools": [{"type": "function", "name": "get_weather"}]},
                                 "mcp__wx__get_weather")):
        runner.scripts.append(tool_call(tok, name))
        r = await client.responses.create(model=MODEL, input="Weather?", tools=tools, tool_choice=choice)
        assert [i.type for i in r.output] == ["message"], (choice, name)
        text = r.output_text
        assert text.startswith("Checking.\n") and f"<function={name}>" in text and "Paris" in text
    await client.close()


async def test_preserve_thinking_is_inherited_by_children(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)
    start_server.runner.scripts.append(thinking_answer(srv.state.prompts.tokenizer))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        root = (await c.post("/v1/responses", json={"model": MODEL, "input": "Hello there", "preserve_thinking": True,
                                                    "max_output_tokens": 64})).json()
        assert root["output"][0]["type"] == "reasoning"

        async def count(**kw):
            body = {"model": MODEL, "input": "Next?", "previous_response_id": root["id"], **kw}
            return (await c.post("/v1/responses/input_tokens", json=body)).json()["input_tokens"]

        inherited, kept, dropped = await count(), await count(preserve_thinking=True), \
            await count(preserve_thinking=False)
    # The child keeps the parent's reasoning unless it explicitly branches with false.
    assert inherited == kept > dropped


async def test_stream_cancelled_by_the_engine_ends_failed_and_is_not_stored(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)
    tok = srv.state.prompts.tokenizer
    start_server.runner.scripts.append(script(tok, ("</think>",), "\n\n" + "word " * 400))
    worker = srv.state.engine._worker  # no public server-side cancel exists: finish the lane as the engine would
    events = []
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        body = {"model": MODEL, "input": "Hello there", "max_output_tokens": 600, "stream": True}
        async with c.stream("POST", "/v1/responses", json=body) as r:
            buf = ""
            async for chunk in r.aiter_text():
                buf += chunk
                if not events and "response.output_text.delta" in buf:
                    seq = next(s for s in worker.core.scheduler.lanes if s is not None)
                    worker.post("cancel", seq)
                    events.append(True)
    evs = sse_events(buf)
    terminal = [d for name, d in evs if name in ("response.completed", "response.incomplete", "response.failed")]
    assert len(terminal) == 1 and terminal[0]["type"] == "response.failed"
    resp = terminal[0]["response"]
    assert resp["status"] == "failed" and resp["error"]["code"] == "cancelled"  # the event and status agree
    assert resp["completed_at"] is None and 0 < resp["usage"]["output_tokens"] < 400
    text = "".join(d["delta"] for name, d in evs if name == "response.output_text.delta")
    assert resp["output"][-1]["content"][0]["text"] == text  # what was streamed is what it reports
    async with httpx.AsyncClient(base_url=srv.url) as c:
        assert (await c.get(f"/v1/responses/{resp['id']}")).status_code == 404


async def test_preparation_errors_name_responses_fields(start_server):
    """Context and output-capacity rejections name the Responses fields, not Chat's messages/max_tokens."""
    srv = await start_server("--default-thinking-budget", "4")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "word " * 400})
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (400, "context_length_exceeded", "input")
        assert err["max_context_tokens"] == 256 and err["prompt_tokens"] > 256
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 6})
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (400, "thinking_budget_capacity_insufficient",
                                                              "max_output_tokens")
