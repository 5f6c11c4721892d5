"""Claude Code's request shapes against the live server, and what NInfer does with each.

Claude Code is closed source; these bodies and headers follow what proxies and issue threads
captured from it: ``POST /v1/messages?beta=true`` with ``anthropic-version``, ``anthropic-beta``
(claude-code, interleaved thinking, fine-grained tool streaming, context management) and
``x-api-key`` or ``Authorization: Bearer``; a ``system`` array whose first block is the
``x-anthropic-billing-header:`` attribution and whose later blocks carry ``cache_control``;
``metadata.user_id`` (the older ``user_…_account__session_…`` string or the newer JSON string);
custom tools whose ``input_schema`` has ``$schema``/``additionalProperties`` and that may carry
``eager_input_streaming``; ``thinking`` enabled with a budget (or adaptive with
``output_config.effort``); ``temperature: 1``; ``stream: true``; and, on current versions,
``context_management: {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}``. Later
turns replay the assistant blocks (thinking with its signature, text, tool_use) and answer with
tool_result blocks (``is_error``, content arrays, ``cache_control``) followed by
``<system-reminder>`` text. count_tokens takes the same body.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from server.scripted import script, sse_events, thinking_answer

KEY = "local-secret"
EPH = {"type": "ephemeral"}
KEEP_ALL = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14,"
                      "context-management-2025-06-27",
    "authorization": f"Bearer {KEY}",  # ANTHROPIC_AUTH_TOKEN; ANTHROPIC_API_KEY sends x-api-key instead
    "x-app": "cli",
    "user-agent": "claude-cli/2.1.37 (external, cli)",
    "anthropic-dangerous-direct-browser-access": "true",
}
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;"},
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.", "cache_control": EPH},
    {"type": "text", "text": "Answer concisely.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
]
DRAFT7 = "http://json-schema.org/draft-07/schema#"
TOOLS = [
    {"name": "Bash", "description": "Run a shell command", "eager_input_streaming": True,
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                      "required": ["command"], "additionalProperties": False, "$schema": DRAFT7}},
    {"name": "get_weather", "description": "Weather by city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                      "required": ["city"], "additionalProperties": False, "$schema": DRAFT7}},
]
FIRST_USER = {"role": "user", "content": [{"type": "text", "text": "<system-reminder>cwd: /repo</system-reminder>"},
                                          {"type": "text", "text": "What is the weather in Paris?",
                                           "cache_control": EPH}]}
META_LEGACY = {"user_id": "user_5f2c_account__session_57a121ec-f78c-48c3-a745-e3036a3ecc33"}
META_JSON = {"user_id": json.dumps({"device_id": "d1", "account_uuid": "", "session_id": "54c1eb09"})}
CLOSED_TURN = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "a long chain of reasoning",
                                                  "signature": "EqQBCkgIARAB"}, {"type": "text", "text": "done"}]},
               {"role": "user", "content": "b"}]


def claude_code_body(messages, **kw) -> dict:
    body = {"model": "claude-sonnet-4-5-20250929", "system": SYSTEM, "tools": TOOLS, "metadata": META_LEGACY,
            "max_tokens": 32000, "temperature": 1, "stream": True, "messages": messages,
            "thinking": {"type": "enabled", "budget_tokens": 4000}, "context_management": KEEP_ALL}
    body.update(kw)
    return body


def think_then_call(tok):
    return script(tok, "I should call the tool.", ("</think>",), "\n\nChecking.\n", ("<tool_call>",),
                  "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                  "</parameter>\n</function>\n", ("</tool_call>",), ("<|im_end|>",))


def blocks_of(events: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks an SSE body builds, checking the lifecycle and the indices on the way."""
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
    assert all(n == d["type"] for n, d in events)
    blocks: list[dict] = []
    open_index = None
    for n, d in events:
        if n == "content_block_start":
            assert open_index is None and d["index"] == len(blocks)
            blocks.append(dict(d["content_block"], _json=""))
            open_index = d["index"]
        elif n == "content_block_delta":
            assert d["index"] == open_index
            b, delta = blocks[open_index], d["delta"]
            if delta["type"] == "text_delta":
                b["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                b["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                b["signature"] = delta["signature"]
            else:
                assert delta["type"] == "input_json_delta"
                b["_json"] += delta["partial_json"]
        elif n == "content_block_stop":
            assert d["index"] == open_index
            open_index = None
    assert open_index is None
    for b in blocks:
        raw = b.pop("_json")
        if b["type"] == "tool_use":
            b["input"] = json.loads(raw)
    return blocks


async def test_claude_code_agent_loop_with_context_management(start_server):
    """The loop Claude Code runs: every request carries the keep-all clear_thinking edit (was a 400)."""
    srv = await start_server("--max-context", "4096", "--api-key", KEY, scripted=True)
    tok = srv.state.prompts.tokenizer
    runner = start_server.runner
    async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS) as c:
        runner.scripts.append(think_then_call(tok))
        r1 = await c.post("/v1/messages?beta=true", json=claude_code_body([FIRST_USER]))
        assert r1.status_code == 200 and r1.headers["content-type"].startswith("text/event-stream"), r1.text
        events = sse_events(r1.text)
        content = blocks_of(events)
        assert [b["type"] for b in content] == ["thinking", "text", "tool_use"]
        assert content[0]["thinking"].strip() == "I should call the tool." and content[0]["signature"]
        assert content[2]["name"] == "get_weather" and content[2]["input"] == {"city": "Paris", "days": 3}
        end = events[-2][1]
        assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
        assert end["usage"]["output_tokens"] == len(think_then_call(tok))

        # Turn two: the replayed blocks, an is_error result with array content and a marker, then
        # the reminder text; metadata in the newer JSON form.
        history = [FIRST_USER, {"role": "assistant", "content": content},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": content[2]["id"], "is_error": True,
                        "content": [{"type": "text", "text": "Error: the weather service timed out"}],
                        "cache_control": EPH},
                       {"type": "text", "text": "<system-reminder>todo list is empty</system-reminder>"}]}]
        runner.scripts.append(thinking_answer(tok))
        r2 = await c.post("/v1/messages?beta=true", json=claude_code_body(history, metadata=META_JSON))
        assert r2.status_code == 200, r2.text
        events = sse_events(r2.text)
        assert [b["type"] for b in blocks_of(events)] == ["thinking", "text"]
        use = events[-2][1]["usage"]
        assert use["cache_read_input_tokens"] > 0  # turn one's prompt was reused
        assert events[0][1]["message"]["usage"]["cache_read_input_tokens"] == use["cache_read_input_tokens"]

        # count_tokens takes the same body (context_management included) and counts the same prompt.
        body = claude_code_body(history)
        for key in ("max_tokens", "stream", "temperature", "metadata"):
            del body[key]
        n = await c.post("/v1/messages/count_tokens?beta=true", json=body)
        assert n.status_code == 200, n.text
        assert n.json()["input_tokens"] == use["input_tokens"] + use["cache_read_input_tokens"]


async def test_keep_all_thinking_keeps_closed_turn_reasoning(start_server):
    """keep 'all' is the template's preserve_thinking: earlier thinking stays in the prompt."""
    srv = await start_server("--max-context", "1024")
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x")

    async def count(**kw) -> int:
        return (await client.messages.count_tokens(model="m", messages=CLOSED_TURN, thinking={"type": "adaptive"},
                                                   **kw)).input_tokens

    dropped, kept = await count(), await count(extra_body={"preserve_thinking": True})
    assert kept > dropped  # the tiny template drops closed-turn reasoning by default
    assert await count(extra_body={"context_management": KEEP_ALL}) == kept
    assert await count(extra_body={"context_management": {"edits": [
        {"type": "clear_thinking_20251015", "keep": {"type": "all"}}]}}) == kept
    assert await count(extra_body={"context_management": {"edits": []}}) == dropped  # no edit: no change
    # Create renders the same prompt as the count.
    m = await client.messages.create(model="m", max_tokens=2, messages=CLOSED_TURN, thinking={"type": "adaptive"},
                                     extra_body={"context_management": KEEP_ALL})
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == kept
    await client.close()


@pytest.mark.parametrize("cm, field", [
    ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100000}}]},
     "context_management.edits[0]"),
    ({"edits": [{"type": "compact_20260112"}]}, "context_management.edits[0]"),
    ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]},
     "context_management.edits[0].keep"),
    ({"edits": [{"type": "clear_thinking_20251015"}]}, "context_management.edits[0].keep"),  # default: last turn
    ({"edits": [KEEP_ALL["edits"][0], {"type": "clear_tool_uses_20250919"}]}, "context_management.edits[1]"),
    ({"enabled": True, "edits": []}, "context_management"),
])
async def test_context_edits_that_remove_context_are_refused(start_server, cm, field):
    srv = await start_server("--max-context", "1024")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        for path, extra in (("/v1/messages", {"max_tokens": 2}), ("/v1/messages/count_tokens", {})):
            r = await c.post(path, json={"model": "m", "messages": CLOSED_TURN, "context_management": cm, **extra})
            err = r.json()
            assert r.status_code == 400 and err["error"]["type"] == "invalid_request_error", r.text
            assert f"'{field}' is not supported" in err["error"]["message"]
            assert err["request_id"] == r.headers["request-id"]


async def test_keep_all_conflicts_with_preserve_thinking_false(start_server):
    srv = await start_server("--max-context", "1024")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        for extra, named in (({"preserve_thinking": False}, "'preserve_thinking'"),
                             ({"chat_template_kwargs": {"preserve_thinking": False}},
                              "'chat_template_kwargs.preserve_thinking'")):
            r = await c.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": CLOSED_TURN,
                                                   "context_management": KEEP_ALL, **extra})
            msg = r.json()["error"]["message"]
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            assert "'context_management.edits[0].keep'" in msg and named in msg


async def test_history_rejections_name_their_block(start_server):
    """The Anthropic envelope has no param member: the message itself says where (it did not)."""
    srv = await start_server("--max-context", "1024")
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}
    cases = [
        # Interleaved-thinking order from another server: text before thinking in one assistant turn.
        ([{"role": "user", "content": "a"},
          {"role": "assistant", "content": [{"type": "text", "text": "t"},
                                            {"type": "thinking", "thinking": "x", "signature": "s"}, use]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}],
         "messages[1].content[1]: "),
        # A call left unanswered.
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [use]},
          {"role": "user", "content": "never mind"}], "messages[2]: "),
        # Text before the result.
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [use]},
          {"role": "user", "content": [{"type": "text", "text": "x"},
                                       {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}],
         "messages[2].content[1]: "),
        # A screenshot read by the Read tool, on a server without --vision.
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [use]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
              {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}],
         "messages[2].content[0].content[0]: "),
    ]
    async with httpx.AsyncClient(base_url=srv.url) as c:
        for messages, where in cases:
            for path, extra in (("/v1/messages", {"max_tokens": 2, "tools": TOOLS}), ("/v1/messages/count_tokens", {})):
                r = await c.post(path, json={"model": "m", "messages": messages, **extra})
                err = r.json()
                assert r.status_code == 400 and err["error"]["type"] == "invalid_request_error", r.text
                assert err["error"]["message"].startswith(where), err


async def test_claude_code_shapes_the_spec_refuses(start_server):
    """Side-call and feature shapes Claude Code can send that need an absent executor or constraint."""
    srv = await start_server("--max-context", "1024", "--api-key", KEY)
    hi = [{"role": "user", "content": "hi"}]
    refused = [
        # WebSearch side call: Anthropic's server tool.
        ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 8}]}, "'tools[0].type'"),
        # Session-title side call: Structured Outputs.
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
         "'output_config.format'"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "Bash"}}, "'tool_choice'"),
        ({"tools": TOOLS, "tool_choice": {"type": "any"}}, "'tool_choice'"),
        # Tool search (ENABLE_TOOL_SEARCH) deferring MCP tools.
        ({"tools": [dict(TOOLS[0], defer_loading=True)]}, "'tools[0].defer_loading'"),
        ({"thinking": {"type": "adaptive", "display": "omitted"}}, "'thinking.display'"),
        # History from an Anthropic-served session: encrypted reasoning, a PDF read by the Read tool.
        ({"messages": [{"role": "user", "content": "a"},
                       {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "EmwKAhgB"},
                                                         {"type": "text", "text": "ok"}]},
                       {"role": "user", "content": "b"}]}, "'messages[1].content[0]'"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
            "type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}]}, "'messages[0].content[0]'"),
    ]
    async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS) as c:
        for extra, field in refused:
            body = {"model": "claude-haiku-4-5-20251001", "max_tokens": 512, "messages": hi, **extra}
            r = await c.post("/v1/messages?beta=true", json=body)
            err = r.json()
            assert r.status_code == 400 and err["error"]["type"] == "invalid_request_error", r.text
            assert field in err["error"]["message"] and "not supported" in err["error"]["message"], err
        # The startup quota probe and plain side calls run: max_tokens 1, metadata, a haiku label.
        r = await c.post("/v1/messages?beta=true", json={"model": "claude-haiku-4-5-20251001", "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": "quota"}],
                                                         "metadata": META_LEGACY})
        assert r.status_code == 200 and r.json()["model"] == "claude-haiku-4-5-20251001"
        assert r.json()["usage"]["output_tokens"] == 1
        # Adaptive thinking with an effort (Opus/Sonnet 4.6+ and unknown model ids) runs too.
        r = await c.post("/v1/messages?beta=true", json=claude_code_body(
            [FIRST_USER], stream=False, max_tokens=2, thinking={"type": "adaptive"}, output_config={"effort": "high"}))
        assert r.status_code == 200, r.text


async def test_an_overlong_prompt_says_so_in_anthropic_words(start_server):
    """Claude Code compacts and retries on Anthropic's "prompt is too long: N tokens > M maximum";
    the OpenAI families keep their own message."""
    srv = await start_server("--max-context", "64")
    long = [{"role": "user", "content": "word " * 200}]
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/messages", json={"model": "claude-sonnet-4-5", "max_tokens": 8, "messages": long})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        message = r.json()["error"]["message"]
        n = int(message.split(": ")[1].split(" tokens")[0])
        assert message == f"prompt is too long: {n} tokens > 63 maximum" and n > 63
        r = await c.post("/v1/chat/completions", json={"model": "random-tiny-qwen3", "max_tokens": 8, "messages": long})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert r.json()["error"]["message"].startswith("The prompt has ")
