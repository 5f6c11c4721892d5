"""OpenAI Responses Core against the spec, on the live server: rules an audit found unenforced."""

from __future__ import annotations

import httpx

from server.scripted import thinking_answer

MODEL = "random-tiny-qwen3"
NS = {"type": "namespace", "name": "mcp__weather",
      "tools": [{"type": "function", "name": "alerts"}, {"type": "function", "name": "get_weather"}]}


def _error(r: httpx.Response) -> tuple[int, str, str]:
    err = r.json()["error"]
    return r.status_code, err["code"], err["param"]


async def test_empty_string_input_needs_a_previous_response(start_server):
    """'input may be omitted or empty only when previous_response_id already supplies a user query'."""
    srv = await start_server()
    async with httpx.AsyncClient(base_url=srv.url) as c:
        for path in ("/v1/responses", "/v1/responses/input_tokens"):
            r = await c.post(path, json={"model": MODEL, "input": ""})
            assert _error(r) == (400, "invalid_value", "input"), path
        parent = (await c.post("/v1/responses", json={"model": MODEL, "input": "Hello",
                                                      "max_output_tokens": 1})).json()
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "", "max_output_tokens": 1,
                                                "previous_response_id": parent["id"]})
        assert r.status_code == 200 and r.json()["previous_response_id"] == parent["id"]
        # "" is no input at all, as [] and an omitted input are: no empty user turn is added
        items = (await c.get(f"/v1/responses/{r.json()['id']}/input_items")).json()["data"]
        counts = [(await c.post("/v1/responses/input_tokens", json={
            "model": MODEL, "previous_response_id": parent["id"], **extra})).json()["input_tokens"]
            for extra in ({"input": ""}, {"input": []}, {})]
        assert items == [] and counts[0] == counts[1] == counts[2]


async def test_input_item_ids_may_not_repeat_the_previous_response_chain(start_server):
    """Duplicate Item ids fail, across the reconstructed history too: a replayed Item would be in the
    prompt twice (OpenAI: 'Duplicate item found with id ...')."""
    srv = await start_server("--max-context", "1024", scripted=True)
    start_server.runner.scripts.append(thinking_answer(srv.state.prompts.tokenizer))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        async def create(path="/v1/responses", **kw):
            return await c.post(path, json={"model": MODEL, **kw})

        parent = (await create(input=[{"id": "msg_q1", "role": "user", "content": "Hello"}],
                               max_output_tokens=64)).json()
        assert [i["type"] for i in parent["output"]] == ["reasoning", "message"]
        replayed_input = [{"id": "msg_q2", "role": "user", "content": "Again"},
                          {"id": "msg_q1", "role": "user", "content": "Hello"}]
        for path in ("/v1/responses", "/v1/responses/input_tokens"):  # one prompt path
            r = await create(path, input=replayed_input, previous_response_id=parent["id"])
            assert _error(r) == (400, "invalid_value", "input[1].id"), path
        # Re-sending the parent's own output Items alongside previous_response_id fails the same way.
        r = await create(input=parent["output"], previous_response_id=parent["id"])
        assert _error(r) == (400, "invalid_value", "input[0].id")
        # New Items with their own ids continue the chain.
        r = await create(input=[{"id": "msg_q3", "role": "user", "content": "More"}],
                         previous_response_id=parent["id"], max_output_tokens=1)
        assert r.status_code == 200


async def test_allowed_tools_select_namespaced_functions_by_both_fields(start_server):
    """'a namespaced selection carries both namespace and name': the joined engine identity, or another
    split of it, names no declared function."""
    srv = await start_server()
    async with httpx.AsyncClient(base_url=srv.url) as c:
        async def count(*selected):
            choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", **s} for s in selected]}
            return await c.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "Weather?",
                                                                    "tools": [NS], "tool_choice": choice})

        r = await count({"namespace": "mcp__weather", "name": "alerts"})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        for bad in ({"name": "mcp__weather__alerts"}, {"namespace": "mcp", "name": "weather__alerts"}):
            assert _error(await count(bad)) == (400, "invalid_value", "tool_choice.tools[0]"), bad


async def test_stored_response_reads_reject_any_non_empty_include(start_server):
    """'non-empty include are rejected rather than ignored', however many values the query repeats
    (the SDK sends include=a&include=b)."""
    srv = await start_server()
    async with httpx.AsyncClient(base_url=srv.url) as c:
        rid = (await c.post("/v1/responses", json={"model": MODEL, "input": "Hello",
                                                   "max_output_tokens": 1})).json()["id"]
        for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
            for key in ("include", "include[]"):
                r = await c.get(path, params=[(key, "reasoning.encrypted_content"), (key, "")])
                assert _error(r) == (400, "unsupported_parameter", "include"), (path, key)
            assert (await c.get(path, params={"include": ""})).status_code == 200  # an empty include
