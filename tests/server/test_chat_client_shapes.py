"""Chat Completions request shapes of the coding agents and SDKs that use "OpenAI-compatible" providers.

The bodies follow what each client's request builder sends to ``POST {base_url}/chat/completions``:

- opencode and the Vercel AI SDK (``@ai-sdk/openai-compatible``: ``getArgs`` in
  openai-compatible-chat-language-model.ts, ``convertToOpenAICompatibleChatMessages``): ``max_tokens``
  (opencode: 32000), ``temperature`` 0.55 / ``top_p`` 1 for Qwen ids (opencode's ProviderTransform),
  ``stream_options.include_usage``, provider options spread into the body (``reasoning_effort``,
  ``chat_template_kwargs``, unknown ones such as ``chat_template_args`` or zai's ``thinking``),
  ``tool_choice: "auto"``; assistant history as ``content: ""`` (older) or ``null`` (newer) with
  ``reasoning_content`` and re-serialized (compact) JSON arguments; tool results as strings;
  ``cache_control`` spread onto messages and parts.
- Cline (providers/openai.ts, transform/openai-format.ts, tool-call-processor.ts): system string,
  ``stream_options.include_usage``, tools with ``strict: false``, ``tool_choice: "auto"`` and
  ``parallel_tool_calls: false``; assistant turns without a ``content`` key when they only call tools,
  ``reasoning_details`` arrays, tool results as strings that may be empty.
- Roo Code / Kilo Code (api/providers/openai.ts): ``temperature`` 0, ``parallel_tool_calls: false``
  (their parallel-calls flag is hard-wired off), ``cache_control`` on the last user text parts.
- Continue (openaiTypeConverters.ts, openai-adapters OpenAI.ts): ``stream_options.include_usage``,
  empty text replaced by ``" "``, tools with ``strict`` copied through, every ``stop`` word passed on.
- OpenHands (agent-sdk llm/message.py and options/chat_options.py, through litellm): list content
  everywhere once function calling is on (``content: []`` beside ``tool_calls``), text parts with
  ``cache_control``, tool results with ``name`` and a message-level ``cache_control``,
  ``max_completion_tokens``, ``temperature`` 0, ``top_p`` 1.
- litellm Message dumps replayed verbatim (tool calls with ``index: -1``, null ``function_call``,
  ``audio``, ``annotations``, ``thinking_blocks``, ``provider_specific_fields``).
- Zed (crates/open_ai: ``Request``, ``RequestMessage``): ``temperature`` 1.0, ``max_completion_tokens``,
  ``prompt_cache_key``, ``parallel_tool_calls`` (true, or none for custom models), assistant
  ``content`` null or ``[]`` with ``reasoning_content``, tool results as strings or part arrays.
- LangChain ``ChatOpenAI`` (``_convert_message_to_dict``): ``content: None`` beside tool calls, tool
  messages reduced to content/role/tool_call_id, ``name`` copied from named messages, ``n`` 1.
- The openai Python SDK: ``extra_body`` (``top_k``, ``min_p``, ``chat_template_kwargs``,
  ``enable_thinking``) and ``model_dump()`` of its own message objects (``refusal``, ``annotations``,
  ``audio``, ``function_call``, ``parsed``, tool-call ``index`` and ``parsed_arguments``).

Every shape the spec supports runs, our own earlier assistant messages replay in each client's
serialization, and the streamed wire is what these clients parse. The shapes the spec refuses fail
with its field-specific 400 before any generation, even where a client sends them by default
(Cline's and Roo Code's ``parallel_tool_calls: false``).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.scripted import script, sse_json

MODEL = "random-tiny-qwen3"
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
    "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
    "required": ["command"], "additionalProperties": False}}}
READ = {"type": "function", "function": {"name": "read", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"filePath": {"type": "string"}}, "required": ["filePath"]}}}
TODOS = {"type": "function", "function": {"name": "list_todos", "description": "List the todos.",
                                          "parameters": {"type": "object", "properties": {}}}}
TOOLS = [BASH, READ, TODOS]
SYSTEM = {"role": "system", "content": "You are a coding agent."}
USER = {"role": "user", "content": "List the files."}
CALL = {"id": "call_abc", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}}
RESULT = {"role": "tool", "tool_call_id": "call_abc", "content": "a.py\nb.py"}


def bash_turn(tok):
    return script(tok, "Run ls.", ("</think>",), "\n\nRunning.\n", ("<tool_call>",),
                  "\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n<parameter=timeout>\n30\n"
                  "</parameter>\n</function>\n", ("</tool_call>",), ("<|im_end|>",))


def todos_turn(tok):
    return script(tok, "Todos too.", ("</think>",), "\n\n", ("<tool_call>",), "\n<function=list_todos>\n</function>\n",
                  ("</tool_call>",), ("<|im_end|>",))


def answer(tok, text="Two files."):
    return script(tok, "Done.", ("</think>",), "\n\n" + text, ("<|im_end|>",))


def read_stream(text: str) -> tuple[dict, list[dict], dict | None]:
    """The stream as the clients read it: the assistant message the deltas build (Vercel's tracker,
    openai-node's accumulator and Zed's chunk loop all key tool calls by ``index`` and take ``id``,
    ``type`` and ``name`` from the opening delta), the tool-call delta pieces, and the usage chunk."""
    frames = sse_json(text)
    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    chunks = frames[:-1]
    assert all(f["object"] == "chat.completion.chunk" and len({f["id"], chunks[0]["id"]}) == 1 for f in chunks)
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    usage = chunks[-1] if chunks[-1]["choices"] == [] else None
    body = chunks[1:-1] if usage else chunks[1:]
    *deltas, finish = body
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] is not None
    assert all(d["choices"][0]["finish_reason"] is None and len(d["choices"]) == 1 for d in deltas)
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    pieces = []
    for d in deltas:
        delta = d["choices"][0]["delta"]
        msg["content"] += delta.get("content", "")
        msg["reasoning_content"] += delta.get("reasoning_content", "")
        for p in delta.get("tool_calls", []):
            pieces.append(p)
            if "id" in p:  # the opening delta of a call
                assert p["index"] not in msg["tool_calls"] and p["type"] == "function"
                assert p["function"]["arguments"] == "" and p["function"]["name"]
                msg["tool_calls"][p["index"]] = {"id": p["id"], "type": "function",
                                                 "function": {"name": p["function"]["name"], "arguments": ""}}
            else:  # then only the index and argument text
                assert set(p) == {"index", "function"} and set(p["function"]) == {"arguments"}
                msg["tool_calls"][p["index"]]["function"]["arguments"] += p["function"]["arguments"]
    msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    msg["finish_reason"] = finish["choices"][0]["finish_reason"]
    return msg, pieces, usage


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "aggregate"])
async def test_ai_sdk_agent_loop(start_server, stream):
    """opencode's loop through @ai-sdk/openai-compatible: call, result, call without arguments, answer."""
    srv = await start_server("--max-context", "8192", scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    base = {"model": MODEL, "max_tokens": 32000, "temperature": 0.55, "top_p": 1,
            "chat_template_kwargs": {"preserve_thinking": True}, "reasoning_effort": "high",
            "promptCacheKey": "ses_01", "tools": TOOLS, "tool_choice": "auto"}
    if stream:
        base |= {"stream": True, "stream_options": {"include_usage": True}}
    history = [SYSTEM, USER]
    usages = []
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        for turn in (bash_turn, todos_turn, answer):
            runner.scripts.append(turn(tok))
            r = await c.post("/v1/chat/completions", json={**base, "messages": history})
            assert r.status_code == 200, r.text
            if stream:
                msg, _, usage = read_stream(r.text)
                usages.append(usage["usage"])
            else:
                body = r.json()
                msg = dict(body["choices"][0]["message"], finish_reason=body["choices"][0]["finish_reason"])
                usages.append(body["usage"])
            calls = msg.get("tool_calls") or []
            assert msg["finish_reason"] == ("tool_calls" if calls else "stop")
            # The AI SDK keeps text, reasoning and parsed call inputs, and sends them back re-serialized.
            replay = {"role": "assistant", "content": msg["content"] or None,
                      "reasoning_content": msg["reasoning_content"]}
            if calls:
                replay["tool_calls"] = [dict(t, function={"name": t["function"]["name"], "arguments": json.dumps(
                    json.loads(t["function"]["arguments"]), separators=(",", ":"))}) for t in calls]
            history = history + [replay] + [
                {"role": "tool", "tool_call_id": t["id"], "content": json.dumps({"output": "ok"})} for t in calls]
    assert [h.get("tool_calls", [{}])[0].get("function", {}).get("arguments") for h in history[2::2]] == [
        "{\"command\":\"ls -la\",\"timeout\":30}", "{}", None]
    assert msg["content"] == "Two files." and msg["reasoning_content"] == "Done."
    # Each turn replays the last one's prompt: the Engine reuses it.
    assert all(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usages[1:])
    assert all(u["completion_tokens_details"]["reasoning_tokens"] > 0 for u in usages)


async def test_streamed_calls_are_what_the_clients_accumulate(start_server):
    """Two calls in one turn (one without arguments) after reasoning and text, usage last."""
    srv = await start_server("--max-context", "8192", scripted=True)
    tok = srv.state.prompts.tokenizer
    start_server.runner.scripts.append(script(
        tok, "Both.", ("</think>",), "\n\nChecking.\n", ("<tool_call>",),
        "\n<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>\n", ("</tool_call>",), "\n",
        ("<tool_call>",), "\n<function=list_todos>\n</function>\n", ("</tool_call>",), ("<|im_end|>",)))
    body = {"model": MODEL, "messages": [SYSTEM, USER], "tools": TOOLS, "tool_choice": "auto", "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 300, "temperature": 0}
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    msg, pieces, usage = read_stream(r.text)
    assert (msg["finish_reason"], msg["content"], msg["reasoning_content"]) == ("tool_calls", "Checking.\n", "Both.")
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg["tool_calls"]] == [
        ("bash", {"command": "ls"}), ("list_todos", {})]
    assert [p["index"] for p in pieces if "id" in p] == [0, 1] and len({t["id"] for t in msg["tool_calls"]}) == 2
    u = usage["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and "timings" in usage


# --- our own messages, replayed as each client serializes them ---------------------------------------

def _vercel(msg):
    out = {"role": "assistant", "content": msg["content"] or "", "reasoning_content": msg["reasoning_content"]}
    out["tool_calls"] = [dict(t, function={"name": t["function"]["name"], "arguments": json.dumps(
        json.loads(t["function"]["arguments"]), separators=(",", ":"))}) for t in msg["tool_calls"]]
    return out


def _cline(msg):  # no content key when the turn only called tools; OpenRouter-style reasoning details
    out = {"role": "assistant", "tool_calls": msg["tool_calls"],
           "reasoning_details": [{"type": "reasoning.text", "text": msg["reasoning_content"], "format": "unknown",
                                  "index": 0}]}
    if msg["content"]:
        out["content"] = msg["content"]
    return out


def _openhands(msg):  # list serializer: text parts (none for an empty text), names on tool results
    parts = [{"type": "text", "text": msg["content"]}] if msg["content"] else []
    return {"content": parts, "role": "assistant", "tool_calls": [
        {"id": t["id"], "type": "function", "function": t["function"]} for t in msg["tool_calls"]]}


def _litellm(msg):  # a litellm Message dumped with its null members
    return {"content": msg["content"], "refusal": None, "role": "assistant", "annotations": None, "audio": None,
            "function_call": None, "tool_calls": [dict(t, index=-1) for t in msg["tool_calls"]],
            "reasoning_content": msg["reasoning_content"], "thinking_blocks": None, "provider_specific_fields": None}


def _zed(msg):
    return {"role": "assistant", "content": None if not msg["content"] else [{"type": "text", "text": msg["content"]}],
            "tool_calls": msg["tool_calls"], "reasoning_content": msg["reasoning_content"]}


def _langchain(msg):
    return {"content": msg["content"] or None, "role": "assistant", "tool_calls": msg["tool_calls"]}


def _continue(msg):  # empty text becomes " " for LM Studio; no reasoning
    return {"role": "assistant", "content": msg["content"] or " ", "tool_calls": msg["tool_calls"]}


def _openai_python(msg):  # ChatCompletionMessage.model_dump() after the SDK's stream helper
    return {"content": msg["content"] or None, "refusal": None, "role": "assistant", "annotations": None,
            "audio": None, "function_call": None, "parsed": None, "reasoning_content": msg["reasoning_content"],
            "tool_calls": [{"id": t["id"], "function": dict(t["function"], parsed_arguments=None), "type": "function",
                            "index": i} for i, t in enumerate(msg["tool_calls"])]}


RESULTS = {  # each client's tool-result message for one call
    "vercel": lambda cid: {"role": "tool", "tool_call_id": cid, "content": "{\"output\":\"a.py b.py\"}"},
    "cline": lambda cid: {"role": "tool", "tool_call_id": cid, "content": ""},
    "openhands": lambda cid: {"content": [{"type": "text", "text": "a.py b.py"}], "role": "tool", "tool_call_id": cid,
                              "name": "bash", "cache_control": {"type": "ephemeral"}},
    "litellm": lambda cid: {"role": "tool", "tool_call_id": cid, "name": "bash", "content": "a.py b.py"},
    "zed": lambda cid: {"role": "tool", "tool_call_id": cid, "content": [{"type": "text", "text": "a.py"},
                                                                        {"type": "text", "text": " b.py"}]},
    "langchain": lambda cid: {"content": "a.py b.py", "role": "tool", "tool_call_id": cid},
    "continue": lambda cid: {"role": "tool", "content": "a.py b.py", "tool_call_id": cid},
    "openai-python": lambda cid: {"role": "tool", "tool_call_id": cid, "content": [{"type": "text", "text": "ok"}]},
}
SERIALIZERS = {"vercel": _vercel, "cline": _cline, "openhands": _openhands, "litellm": _litellm, "zed": _zed,
               "langchain": _langchain, "continue": _continue, "openai-python": _openai_python}


@pytest.mark.parametrize("client", list(SERIALIZERS))
@pytest.mark.parametrize("turn", [bash_turn, todos_turn], ids=["text-and-call", "call-only"])
async def test_our_messages_replay_in_each_clients_serialization(start_server, client, turn):
    srv = await start_server("--max-context", "8192", scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    body = {"model": MODEL, "messages": [SYSTEM, USER], "tools": TOOLS, "max_tokens": 300}
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        runner.scripts.append(turn(tok))
        msg = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        assert msg["tool_calls"] and msg["refusal"] is None
        assert msg["content"] == ("Running.\n" if turn is bash_turn else None)
        replay = SERIALIZERS[client](msg)
        history = [SYSTEM, USER, replay] + [RESULTS[client](t["id"]) for t in msg["tool_calls"]]
        runner.scripts.append(answer(tok))
        r = await c.post("/v1/chat/completions", json={**body, "messages": history})
        assert r.status_code == 200, r.text
        out = r.json()
    assert out["choices"][0]["message"]["content"] == "Two files." and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_openai_python_stream_helper_round_trip(start_server):
    """The SDK's own stream accumulator, its message dumped back as history."""
    srv = await start_server("--max-context", "8192", scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused")
    runner.scripts.append(bash_turn(tok))
    async with client.chat.completions.stream(model=MODEL, messages=[SYSTEM, USER], tools=TOOLS, max_tokens=300,
                                              stream_options={"include_usage": True}) as s:
        async for _ in s:
            pass
        final = await s.get_final_completion()
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and final.usage.completion_tokens > 0
    assert msg.model_extra["reasoning_content"] == "Run ls."
    (call,) = msg.tool_calls
    assert json.loads(call.function.arguments) == {"command": "ls -la", "timeout": 30}
    runner.scripts.append(answer(tok))
    r = await client.chat.completions.create(
        model=MODEL, tools=TOOLS, max_completion_tokens=50, messages=[
            SYSTEM, USER, msg.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "ok"}],
        extra_body={"top_k": 20, "min_p": 0, "chat_template_kwargs": {"enable_thinking": True}})
    assert r.choices[0].message.content == "Two files."
    await client.close()


# --- request fields the clients send ---------------------------------------------------------------

CACHED_SYSTEM = {"role": "system", "content": [{"type": "text", "text": "You are a coding agent.",
                                                "cache_control": {"type": "ephemeral"}}]}
CACHED_USER = {"role": "user", "content": [{"type": "text", "text": "List the files.",
                                            "cache_control": {"type": "ephemeral"}}]}


@pytest.mark.parametrize("fields", [
    # opencode / AI SDK provider options spread into the body, including ones NInfer does not know.
    {"chat_template_args": {"enable_thinking": True}, "promptCacheKey": "ses_1"},
    {"thinking": {"type": "enabled", "clear_thinking": False}},  # opencode's zai options
    {"reasoning_effort": "low", "verbosity": "medium", "user": "u-1"},
    {"messages": [dict(SYSTEM, cache_control={"type": "ephemeral"}), dict(USER, cache_control={"type": "ephemeral"})]},
    {"messages": [CACHED_SYSTEM, CACHED_USER], "tools": [dict(BASH, cache_control={"type": "ephemeral"})]},
    # Cline / Roo Code / Kilo Code without tools, and their tool definitions.
    {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
    {"tools": [{"type": "function", "function": dict(BASH["function"], strict=False)}], "tool_choice": "auto"},
    # Continue: one stop word, prediction, " " for empty text.
    {"stop": ["<|im_end|>"], "prediction": {"type": "content", "content": "x"},
     "messages": [SYSTEM, {"role": "user", "content": " "}]},
    # OpenHands through litellm.
    {"max_completion_tokens": 64, "temperature": 0.0, "top_p": 1.0, "messages": [CACHED_SYSTEM, CACHED_USER]},
    # Zed.
    {"temperature": 1.0, "max_completion_tokens": 64, "prompt_cache_key": "thread-1", "parallel_tool_calls": True,
     "tools": TOOLS, "stream": True, "stream_options": {"include_usage": True}},
    {"parallel_tool_calls": True, "tools": TOOLS, "tool_choice": "none"},
    # LangChain ChatOpenAI.
    {"n": 1, "stream": False, "temperature": 0.7, "stream_options": {"include_usage": True}},
    # The openai SDKs' neutral members and OpenAI-era defaults.
    {"metadata": {"session": "s"}, "store": False, "seed": 42, "response_format": {"type": "text"},
     "service_tier": "auto", "safety_identifier": "s", "logprobs": False, "top_logprobs": 0, "logit_bias": {},
     "frequency_penalty": 0, "presence_penalty": 0, "functions": [], "function_call": "auto",
     "modalities": ["text"], "prompt_cache_retention": "24h"},
    # extra_body for Qwen: the model card's sampler, thinking switches.
    {"top_k": 20, "min_p": 0, "presence_penalty": 1.5, "chat_template_kwargs": {"enable_thinking": False}},
    {"enable_thinking": False}, {"reasoning_effort": "none"}, {"reasoning_effort": "xhigh"},
    # OpenRouter-style members some clients keep when pointed elsewhere.
    {"reasoning": {"effort": "high"}, "include_reasoning": True, "usage": {"include": True}},
    # Roles and positions: developer, a trailing system reminder (Aider), an empty user turn.
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, USER]},
    {"messages": [SYSTEM, USER, {"role": "assistant", "content": "ok"}, USER, {"role": "system", "content": "Reply."}]},
    {"messages": [SYSTEM, {"role": "user", "content": ""}]},
    # A budget past the context (opencode's 32000 on a smaller server) runs until the context is full.
    {"max_tokens": 32000},
], ids=lambda f: ",".join(f"{k}={json.dumps(v)}"[:32] for k, v in f.items()))
async def test_client_request_fields_run(start_server, fields):
    srv = await start_server("--max-context", "4096", scripted=True)
    tok = srv.state.prompts.tokenizer
    kwargs = fields.get("chat_template_kwargs", {})
    thinking = fields.get("enable_thinking", kwargs.get("enable_thinking")) is not False \
        and fields.get("reasoning_effort") != "none"
    start_server.runner.scripts.append(answer(tok) if thinking else script(tok, "Two files.", ("<|im_end|>",)))
    body = {"model": MODEL, "messages": [SYSTEM, USER], "max_tokens": 64, **fields}
    if "max_completion_tokens" in fields:
        body.pop("max_tokens")
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        msg, _, usage = read_stream(r.text)
        assert (usage is not None) == bool(body.get("stream_options", {}).get("include_usage"))
    else:
        choice = r.json()["choices"][0]
        msg = dict(choice["message"], finish_reason=choice["finish_reason"])
    assert msg["finish_reason"] == "stop" and msg["content"] == "Two files."


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize("fields, code, param", [
    # Cline (getOpenAIToolParams) and Roo/Kilo Code send this with every native-tool request.
    ({"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False}, "unsupported_parameter",
     "parallel_tool_calls"),
    # openai-agents / pydantic_function_tool default to strict tools.
    ({"tools": [{"type": "function", "function": dict(BASH["function"], strict=True)}]}, "unsupported_parameter",
     "tools[0].function.strict"),
    # AI SDK toolChoice 'required' / LangChain tool_choice="any"; a named choice.
    ({"tools": TOOLS, "tool_choice": "required"}, "unsupported_parameter", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "bash"}}}, "unsupported_parameter",
     "tool_choice"),
    # LangChain with_structured_output (json_schema since 0.3); the AI SDK's JSON mode.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"},
                                                                 "strict": True}}}, "unsupported_parameter",
     "response_format"),
    ({"response_format": {"type": "json_object"}}, "unsupported_parameter", "response_format"),
    # Participant names: LangGraph's named agents (assistant), AutoGen's sources (user).
    ({"messages": [SYSTEM, USER, {"role": "assistant", "content": "x", "name": "researcher"}, USER]},
     "unsupported_parameter", "messages[2].name"),
    ({"messages": [SYSTEM, dict(USER, name="user")]}, "unsupported_parameter", "messages[1].name"),
    # Continue passes every stop word to hosts it does not know; four is Chat's bound.
    ({"stop": ["\n\n", "```", "<|im_end|>", "<|endoftext|>", "/src/"]}, "invalid_value", "stop"),
    # vLLM's 'disabled' top_k and Gemini-era values are outside the extension's 0..20.
    ({"top_k": -1}, "invalid_value", "top_k"),
    ({"top_k": 40}, "invalid_value", "top_k"),
    ({"repetition_penalty": 1.05}, "unsupported_parameter", "repetition_penalty"),
    # Media without --vision; older Continue's explicit low detail; the AI SDK's audio and file parts.
    ({"messages": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}]},
     "vision_disabled", "messages[1].content[1]"),
    ({"messages": [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   dict(RESULT, content=[IMAGE])]}, "vision_disabled", "messages[3].content[0]"),
    ({"messages": [SYSTEM, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}]}]},
     "unsupported_parameter", "messages[1].content[0].image_url.detail"),
    ({"messages": [SYSTEM, {"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]},
     "unsupported_parameter", "messages[1].content[0]"),
    ({"messages": [SYSTEM, {"role": "user", "content": [
        {"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}}]}]},
     "unsupported_parameter", "messages[1].content[0]"),
    ({"store": True}, "unsupported_parameter", "store"),
    ({"n": 2}, "unsupported_parameter", "n"),
    ({"logprobs": True, "top_logprobs": 3}, "unsupported_parameter", "logprobs"),
    ({"verbosity": "low"}, "unsupported_parameter", "verbosity"),
    ({"enable_thinking": False, "reasoning_effort": "low"}, "conflicting_template_option", "reasoning_effort"),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else str(v))
async def test_client_shapes_the_spec_refuses(start_server, fields, code, param):
    srv = await start_server("--max-context", "4096")
    body = {"model": MODEL, "messages": [SYSTEM, USER], "max_tokens": 16, **fields}
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        for stream in (False, True):  # refused before any stream starts: a plain JSON error
            r = await c.post("/v1/chat/completions",
                             json={**body, "stream": stream, "stream_options": {"include_usage": True}})
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
            err = r.json()["error"]
            assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", code, param), err
            assert err["message"]
