"""Codex CLI request shapes on the live server: what NInfer runs, and what the spec makes it refuse.

The bodies follow what the Codex CLI's Rust client sends to ``POST {base_url}/responses``
(``ResponsesApiRequest`` in codex-rs/codex-api/src/common.rs, built in codex-rs/core/src/client.rs):
``model``, ``instructions``, ``input`` (every turn replays the whole conversation: ``store`` is
false and no ``previous_response_id`` is sent over HTTP), ``tools``, ``tool_choice: "auto"``,
``parallel_tool_calls``, ``reasoning`` (null, or ``{effort?, summary?, context?}``), ``store``,
``stream: true``, ``include``, ``prompt_cache_key`` (the conversation id), optional ``text``
(verbosity / output schema), ``service_tier``, ``stream_options`` and ``client_metadata``.

Codex keeps the Items of ``response.output_item.done`` and re-serializes them as its own
``ResponseItem``s on the next turn: some versions drop the Item ids (``skip_serializing``), others
keep them and may add ``phase`` to messages; reasoning always goes back with its ``content`` and
``encrypted_content: null``. Both forms of our own output must be accepted back. Capabilities NInfer cannot honour (non-empty ``include``,
``parallel_tool_calls: false`` with callable tools, non-medium verbosity, JSON output schemas,
priority/flex tiers, custom/hosted tools, deferred tools, Items from hosted or custom tools,
reasoning without raw text, non-auto image detail) fail with the field-specific 400 the spec
names, before any generation.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.scripted import script, sse_events
from server.test_responses_e2e import MODEL

HEADERS = {  # what Codex adds to the JSON body (none of it changes what NInfer does)
    "Authorization": "Bearer local-secret", "Accept": "text/event-stream", "OpenAI-Beta": "responses=experimental",
    "originator": "codex_cli_rs", "User-Agent": "codex_cli_rs/0.50.0 (Linux; x86_64) xterm-256color",
    "session_id": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "conversation_id": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
    "x-client-request-id": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "x-codex-turn-metadata": '{"turn_id":"t1"}',
    "x-codex-beta-features": "unified_exec",
}
EXEC = {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
        "parameters": {"type": "object", "properties": {
            "cmd": {"type": "string"}, "workdir": {"type": "string"}, "yield_time_ms": {"type": "number"}},
            "required": ["cmd"], "additionalProperties": False}}
PATCH = {"type": "function", "name": "apply_patch", "description": "Edit files with a patch.", "strict": False,
         "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                        "additionalProperties": False}}
PLAN = {"type": "function", "name": "update_plan", "description": "Updates the task plan.", "strict": False,
        "parameters": {"type": "object", "properties": {
            "explanation": {"type": "string"},
            "plan": {"type": "array", "items": {"type": "object", "properties": {
                "step": {"type": "string"}, "status": {"type": "string"}}, "required": ["step", "status"],
                "additionalProperties": False}}},
            "required": ["plan"], "additionalProperties": False}}
MCP = {"type": "namespace", "name": "mcp__wx__", "description": "", "tools": [
    {"type": "function", "name": "get_weather", "description": "Weather for a city.", "strict": False,
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]}
USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}
CONTEXT = [
    {"type": "message", "role": "developer",
     "content": [{"type": "input_text", "text": "<permissions instructions>workspace-write</permissions instructions>"}]},
    {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "# AGENTS.md instructions for /repo\n\nRun the tests."},
        {"type": "input_text", "text": "<environment_context>\n  <cwd>/repo</cwd>\n</environment_context>"}]},
]


def codex_body(**kw) -> dict:
    body = {"model": MODEL, "instructions": "You are Codex, a coding agent.", "input": CONTEXT + [USER],
            "tools": [EXEC, PATCH, PLAN, MCP], "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": None,
            "store": False, "stream": True, "include": [], "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"}
    body.update(kw)
    return body


def as_codex_item(item: dict, keep_ids: bool, phase: str | None = None) -> dict:
    """An output Item as Codex's ResponseItem serializes it back into the next request's input."""
    out: dict = {"type": item["type"]}
    if keep_ids:
        out["id"] = item["id"]
    if item["type"] == "message":
        out.update(role=item["role"], content=[{"type": p["type"], "text": p["text"]} for p in item["content"]])
        if phase is not None:
            out["phase"] = phase
    elif item["type"] == "reasoning":
        out.update(summary=item["summary"], content=item["content"], encrypted_content=None)
    else:
        out.update(name=item["name"], arguments=item["arguments"], call_id=item["call_id"])
        if "namespace" in item:
            out["namespace"] = item["namespace"]
    return out


async def codex_turn(c: httpx.AsyncClient, body: dict) -> tuple[list[dict], dict]:
    """One streamed turn read as Codex reads it: the output_item.done Items and the terminal Response."""
    r = await c.post("/v1/responses", json=body, headers=HEADERS)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-request-id"]
    events = sse_events(r.text)
    assert "[DONE]" not in r.text and all(name == data["type"] for name, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete") and names.count(names[-1]) == 1
    done = [d["item"] for n, d in events if n == "response.output_item.done"]
    final = events[-1][1]["response"]
    assert done == final["output"]  # what Codex keeps is what the Response reports
    return done, final


def tool_turn(tok):
    return script(tok, "The user wants weather.", ("</think>",), "\n\nChecking the forecast.\n", ("<tool_call>",),
                  "\n<function=mcp__wx__get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
                  ("</tool_call>",), ("<|im_end|>",))


def answer(tok, text="It is sunny in Paris."):
    return script(tok, "Done.", ("</think>",), "\n\n" + text, ("<|im_end|>",))


@pytest.mark.parametrize("keep_ids", [False, True], ids=["ids-dropped", "ids-kept"])
async def test_codex_tool_loop_replays_our_own_items(start_server, keep_ids):
    srv = await start_server("--max-context", "4096", scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        runner.scripts.append(tool_turn(tok))
        body = codex_body(client_metadata={"x-codex-turn-metadata": '{"turn_id":"t1"}'})
        done, final = await codex_turn(c, body)
        assert final["status"] == "completed" and final["store"] is False
        rs, msg, fc = done
        # The fields Codex's ResponseItem needs to deserialize each Item.
        assert rs["type"] == "reasoning" and rs["summary"] == []
        assert rs["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
        assert msg["role"] == "assistant" and msg["content"][0]["type"] == "output_text"
        assert (fc["name"], fc["namespace"]) == ("get_weather", "mcp__wx__") and fc["call_id"].startswith("call_")
        assert json.loads(fc["arguments"]) == {"city": "Paris"}

        history = body["input"] + [as_codex_item(i, keep_ids, "commentary" if keep_ids else None) for i in done]
        history.append({"type": "function_call_output", "call_id": fc["call_id"], "output": "sunny, 21 C"})
        runner.scripts.append(answer(tok))
        done2, final2 = await codex_turn(c, codex_body(input=history))
        assert final2["status"] == "completed" and done2[-1]["content"][0]["text"] == "It is sunny in Paris."
        assert final2["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the replay reuses turn one

        history += [as_codex_item(i, keep_ids, "final_answer" if keep_ids else None) for i in done2]
        history.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks!"}]})
        runner.scripts.append(answer(tok, "You're welcome."))
        _, final3 = await codex_turn(c, codex_body(input=history))
        assert final3["status"] == "completed"
        assert final3["usage"]["input_tokens_details"]["cached_tokens"] > final2["usage"]["input_tokens"] // 2


async def test_codex_parallel_calls_with_normalized_and_aborted_outputs(start_server):
    """Codex inserts an "aborted" output right after each call it never ran, and outputs may arrive in any order."""
    srv = await start_server("--max-context", "4096", scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    patch = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = 1\n+x = \"<b>\"\n*** End Patch"
    runner.scripts.append(script(
        tok, ("</think>",), "\n\n", ("<tool_call>",),
        "\n<function=exec_command>\n<parameter=cmd>\nls -la\n</parameter>\n<parameter=yield_time_ms>\n1000\n</parameter>\n"
        "</function>\n", ("</tool_call>",), "\n", ("<tool_call>",),
        f"\n<function=apply_patch>\n<parameter=input>\n{patch}\n</parameter>\n</function>\n", ("</tool_call>",),
        ("<|im_end|>",)))
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        body = codex_body()
        done, _ = await codex_turn(c, body)
        ex, ap = done
        assert json.loads(ex["arguments"]) == {"cmd": "ls -la", "yield_time_ms": 1000}
        assert json.loads(ap["arguments"]) == {"input": patch}
        calls = [as_codex_item(i, False) for i in done]
        out = {i["call_id"]: {"type": "function_call_output", "call_id": i["call_id"], "output": "ok"} for i in done}
        aborted = dict(out[ex["call_id"]], output="aborted")
        for tail in ([calls[0], aborted, calls[1], out[ap["call_id"]]],  # Codex's missing-output normalization
                     [calls[0], calls[1], out[ap["call_id"]], out[ex["call_id"]]]):  # results out of call order
            runner.scripts.append(answer(tok))
            _, final = await codex_turn(c, codex_body(input=body["input"] + tail))
            assert final["status"] == "completed"


async def test_codex_replays_incomplete_and_reasoning_only_outputs(start_server):
    srv = await start_server("--max-context", "4096", scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    cases = [(script(tok, "Only thinking here", ("</think>",), ("<|im_end|>",)), None, ["reasoning"]),
             (script(tok, "T.", ("</think>",), "\n\nA long answer that the budget cuts.", ("<|im_end|>",)), 8,
              ["reasoning", "message"]),
             (script(tok, ("</think>",), "\n\nx", ("<tool_call>",), "\n<function=exec_command>\n<parameter=cmd>\nls\n"
                     "</parameter>\n</function>\n", ("</tool_call>",), ("<|im_end|>",)), 12, ["message"])]
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        for sc, budget, kinds in cases:
            runner.scripts.append(sc)
            body = codex_body(**({"max_output_tokens": budget} if budget else {}))
            done, final = await codex_turn(c, body)
            assert [i["type"] for i in done] == kinds
            assert final["status"] == ("incomplete" if budget else "completed")
            for keep_ids in (False, True):
                history = body["input"] + [as_codex_item(i, keep_ids) for i in done] + [
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on."}]}]
                runner.scripts.append(answer(tok))
                _, again = await codex_turn(c, codex_body(input=history))
                assert again["status"] == "completed"


@pytest.mark.parametrize("fields", [
    {"reasoning": {"summary": "auto"}},  # Codex's default reasoning payload for a model it knows nothing about
    {"reasoning": {"effort": "none"}},
    {"reasoning": {"effort": "xhigh", "summary": "detailed", "context": "all_turns"}},
    {"text": {"verbosity": "medium"}},
    {"service_tier": "auto"},
    {"client_metadata": {"x-codex-turn-metadata": "{}", "ws_request_header_traceparent": "00-ab-cd-01"}},
    {"stream_options": {"reasoning_summary_delivery": "sequential_cutoff"}},
    {"tools": [], "parallel_tool_calls": False},  # no callable tool: single-call enforcement is vacuous
    {"instructions": ""},
    {"store": True},  # Codex's Azure workaround: store:true with the Item ids attached
], ids=lambda f: ",".join(f"{k}={json.dumps(v)}"[:40] for k, v in f.items()))
async def test_codex_request_fields_that_run(start_server, fields):
    srv = await start_server("--max-context", "4096", scripted=True)
    start_server.runner.scripts.append(answer(srv.state.prompts.tokenizer))
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        _, final = await codex_turn(c, codex_body(**fields))
    assert final["status"] == "completed"


CUSTOM_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}}
FC = {"type": "function_call", "name": "exec_command", "arguments": "{\"cmd\": \"ls\"}", "call_id": "call_1"}
FCO = {"type": "function_call_output", "call_id": "call_1", "output": "ok"}


def _with_input(*items):
    return {"input": CONTEXT + [USER, *items]}


@pytest.mark.parametrize("fields, code, param", [
    # include is omitted or empty only; Codex sends reasoning.encrypted_content with every reasoning payload.
    ({"reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"]},
     "unsupported_parameter", "include"),
    # Codex sends false when its model metadata lacks parallel tool calls.
    ({"parallel_tool_calls": False}, "unsupported_parameter", "parallel_tool_calls"),
    ({"text": {"verbosity": "low"}}, "unsupported_parameter", "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "strict": True, "schema": {"type": "object"},
                          "name": "codex_output_schema"}}}, "unsupported_parameter", "text.format"),
    ({"service_tier": "priority"}, "unsupported_parameter", "service_tier"),
    ({"tools": [EXEC, CUSTOM_PATCH]}, "unsupported_parameter", "tools[1].type"),
    ({"tools": [EXEC, {"type": "web_search", "external_web_access": False}]}, "unsupported_parameter", "tools[1].type"),
    ({"tools": [{"type": "local_shell"}]}, "unsupported_parameter", "tools[0].type"),
    ({"tools": [{"type": "image_generation", "output_format": "png"}]}, "unsupported_parameter", "tools[0].type"),
    ({"tools": [EXEC, {"type": "tool_search", "execution": "client", "description": "",
                       "parameters": {"type": "object"}}]}, "unsupported_parameter", "tools[1].type"),
    ({"tools": [dict(EXEC, defer_loading=True)]}, "unsupported_parameter", "tools[0].defer_loading"),
    ({"access_programs": {"cyber": "standard"}}, "unknown_parameter", "access_programs"),
    # Items NInfer never produces: another model's hidden reasoning, custom/hosted tool history, compaction.
    (_with_input({"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}], "content": None,
                  "encrypted_content": "gAAAA"}, {"type": "message", "role": "assistant",
                                                   "content": [{"type": "output_text", "text": "Hi."}]}),
     "unsupported_parameter", "input[3]"),
    (_with_input({"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
                 {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"}),
     "unsupported_parameter", "input[3].type"),
    (_with_input({"type": "local_shell_call", "call_id": "c3", "status": "completed",
                  "action": {"type": "exec", "command": ["ls"]}}), "unsupported_parameter", "input[3].type"),
    (_with_input({"type": "web_search_call", "status": "completed", "action": {"type": "search", "query": "x"}}),
     "unsupported_parameter", "input[3].type"),
    ({"input": [{"type": "compaction", "encrypted_content": "gAAAA"}, USER]}, "unsupported_parameter", "input[0].type"),
    (_with_input({"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": "high"}]}),
     "unsupported_parameter", "input[3].content[0].detail"),
    (_with_input(FC, dict(FCO, output=[{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}])),
     "vision_disabled", "input[4].output[0]"),
])
async def test_codex_shapes_the_spec_rejects(start_server, fields, code, param):
    srv = await start_server("--max-context", "4096")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/responses", json=codex_body(**fields), headers=HEADERS)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param)
    assert r.headers["x-request-id"]
