"""OpenAI Responses request normalization: create fields, input Items, tools, output assembly (pure)."""

from __future__ import annotations

import json

import pytest

from ninfer.text.events import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from protocols.errors import ProtocolError
from server.expect import protocol_error
from protocols.openai_responses import CREATE_FIELDS, build_conversation, parse_request
from protocols.responses_output import OutputAssembler, response_object, status_of

MODEL = "m"
FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}
NS = {"type": "namespace", "name": "mcp__weather", "description": "Weather service",
      "tools": [{"type": "function", "name": "get_weather"}, {"type": "function", "name": "alerts"}]}


def parse(**body):
    body.setdefault("model", MODEL)
    body.setdefault("input", "hi")
    return parse_request(body, MODEL)


def fails(code: str, param: str | None = None, **body) -> ProtocolError:
    return protocol_error(lambda: conv(**body), code, param)


def conv(history=(), **body):
    return build_conversation(tuple(history), parse(**body))


def msgs(c) -> list[tuple]:
    return [(m.role, m.text, m.reasoning, tuple((t.id, t.name) for t in m.tool_calls), m.tool_call_id)
            for m in c.messages]


def test_model_and_unknown_fields():
    assert parse().model == MODEL
    fails("model_not_found", "model", model="gpt-5")
    fails("missing_required_parameter", "model", model=None)
    fails("unknown_parameter", "frobnicate", frobnicate=1)
    fails("unknown_parameter", "messages", messages=[])  # a Chat Completions field is unknown here


def test_every_accepted_create_field_at_its_neutral_value():
    body = {"instructions": "Be brief.", "previous_response_id": None, "max_output_tokens": 0, "stream": False,
            "store": False, "temperature": 0.7, "top_p": 0.5, "metadata": {"k": "v"}, "client_metadata": {"x": 1},
            "reasoning": {"effort": "low", "summary": "auto"}, "chat_template_kwargs": {"foo": 1},
            "preserve_thinking": True, "text": {"format": {"type": "text"}, "verbosity": "medium"}, "tools": [FN],
            "tool_choice": "auto", "parallel_tool_calls": True, "max_tool_calls": 3, "truncation": "disabled",
            "top_logprobs": 0, "service_tier": "auto", "background": False, "include": [],
            "stream_options": {"include_obfuscation": False}, "prompt_cache_key": "k",
            "prompt_cache_options": {"mode": "explicit"}, "prompt_cache_retention": "24h",
            "safety_identifier": "s", "user": "u"}
    assert set(body) | {"model", "input", "conversation", "prompt", "context_management", "moderation"} \
        == CREATE_FIELDS
    req = parse(**body)
    g = req.generation
    assert (g.max_tokens, g.temperature, g.top_p) == (0, 0.7, 0.5)
    assert req.store is False and req.metadata == {"k": "v"} and req.implicit_cache is False
    o = req.options
    assert (o.reasoning_effort, o.preserve_thinking, o.kwargs) == ("low", True, {"foo": 1})
    assert parse().store is True and parse().generation.max_tokens is None


@pytest.mark.parametrize("field, value, code, param", [
    ("temperature", 2.5, "invalid_value", "temperature"),
    ("top_p", -0.1, "invalid_value", "top_p"),
    ("max_output_tokens", -1, "invalid_value", "max_output_tokens"),
    ("metadata", {f"k{i}": "v" for i in range(17)}, "invalid_value", "metadata"),
    ("metadata", {"k" * 65: "v"}, "invalid_value", "metadata"),
    ("metadata", {"k": "v" * 513}, "invalid_value", "metadata.k"),
    ("metadata", {"k": 1}, "invalid_type", "metadata.k"),
    ("reasoning", {"effort": "huge"}, "invalid_value", "reasoning.effort"),
    ("reasoning", {"summary": 5}, "invalid_value", "reasoning.summary"),
    ("tools", [{"type": "function", "name": "f", "strict": "yes"}], "invalid_type", "tools[0].strict"),
    ("text", {"format": {"type": "json_schema", "schema": {}}}, "unsupported_parameter", "text.format"),
    ("text", {"format": {"type": "json_object"}}, "unsupported_parameter", "text.format"),
    ("text", {"verbosity": "low"}, "unsupported_parameter", "text.verbosity"),
    ("truncation", "auto", "unsupported_parameter", "truncation"),
    ("top_logprobs", 2, "unsupported_parameter", "top_logprobs"),
    ("service_tier", "priority", "unsupported_parameter", "service_tier"),
    ("background", True, "unsupported_parameter", "background"),
    ("include", ["reasoning.encrypted_content"], "unsupported_parameter", "include"),
    ("conversation", "conv_1", "unsupported_parameter", "conversation"),
    ("prompt", {"id": "pmpt_1"}, "unsupported_parameter", "prompt"),
    ("context_management", [{"type": "compaction"}], "unsupported_parameter", "context_management"),
    ("stream_options", {"include_obfuscation": "yes"}, "invalid_type", "stream_options.include_obfuscation"),
    ("preserve_thinking", "yes", "invalid_type", "preserve_thinking"),
    ("client_metadata", "x", "invalid_type", "client_metadata"),
    ("prompt_cache_options", {"mode": "sometimes"}, "invalid_value", "prompt_cache_options.mode"),
])
def test_field_rejections(field, value, code, param):
    fails(code, param, **{field: value})


def test_template_options_merge_and_conflict():
    c = conv(reasoning={"effort": "none"})
    assert c.thinking(None) is False
    fails("conflicting_template_option", "preserve_thinking", preserve_thinking=True,
          chat_template_kwargs={"preserve_thinking": False})
    fails("invalid_value", "chat_template_kwargs.messages", chat_template_kwargs={"messages": []})
    # Errors name the field the value came from: Responses spells the effort reasoning.effort.
    fails("conflicting_template_option", "reasoning.effort", reasoning={"effort": "low"},
          chat_template_kwargs={"reasoning_effort": "high"})
    fails("invalid_type", "chat_template_kwargs.enable_thinking", chat_template_kwargs={"enable_thinking": "yes"})


def test_string_input_and_instructions():
    req = parse(input="Hello", instructions="Be brief.")
    (item,) = req.items
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "Hello"}]
    assert msgs(build_conversation((), req))[:2] == [("developer", "Be brief.", None, (), None),
                                                     ("user", "Hello", None, (), None)]
    fails("invalid_value", "input", input=[])
    fails("invalid_value", "input", input=None)
    assert parse(input=None, previous_response_id="resp_1").items == ()


def test_message_items_roles_parts_and_replay():
    items = [{"type": "message", "role": "system", "content": "S"},
             {"role": "developer", "content": [{"type": "input_text", "text": "D"}]},
             {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
             {"type": "message", "role": "assistant", "status": "completed", "phase": "final_answer",
              "content": [{"type": "output_text", "text": "x", "annotations": []},
                          {"type": "refusal", "refusal": "r"}]},
             {"role": "user", "content": "next"}]
    c = conv(input=items)
    assert [(m.role, m.text) for m in c.messages] == [("system", "S"), ("developer", "D"), ("user", "ab"),
                                                      ("assistant", "xr"), ("user", "next")]
    fails("invalid_value", "input[0].role", input=[{"role": "tool", "content": "x"}])
    fails("invalid_value", "input[0].content[0].type",
          input=[{"role": "user", "content": [{"type": "output_text", "text": "x"}]}])
    fails("vision_disabled", "input[0].content[0]",
          input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}])
    fails("vision_disabled", input=[{"role": "user", "content": [{"type": "input_video", "video_url": "x"}]}])
    fails("unsupported_parameter", "input[0].content[0].file_id",
          input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}])
    fails("unsupported_parameter", "input[0].content[0].detail",
          input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x", "detail": "high"}]}])
    fails("unsupported_parameter", "input[0].content[0]",
          input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}])
    fails("unsupported_parameter", "input[0].type", input=[{"type": "web_search_call", "id": "ws_1"}])
    fails("unsupported_parameter", "input[0]", input=[{"type": "item_reference", "id": "msg_1"}])


def test_item_ids_preserved_generated_and_unique():
    req = parse(input=[{"id": "msg_mine", "role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert req.items[0]["id"] == "msg_mine" and req.items[1]["id"].startswith("msg_")
    fails("invalid_value", "input[1].id", input=[{"id": "x", "role": "user", "content": "a"},
                                                 {"id": "x", "role": "user", "content": "b"}])


def _fc(call_id: str, name: str = "get_weather", namespace: str | None = None, args: str = '{"city": "Paris"}'):
    item = {"type": "function_call", "call_id": call_id, "name": name, "arguments": args}
    if namespace:
        item["namespace"] = namespace
    return item


def _out(call_id: str, output="sunny"):
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def _rs(text: str):
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def test_assistant_grouping_and_result_reordering():
    items = [{"role": "user", "content": "q"}, _rs("think"),
             {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
             _fc("c1"), _fc("c2", "alerts", "mcp__weather"), _out("c2", "none"),
             _out("c1", [{"type": "input_text", "text": "sunny"}])]
    c = conv(input=items, tools=[FN, NS])
    assert msgs(c) == [("user", "q", None, (), None),
                       ("assistant", "Checking.", "think",
                        (("c1", "get_weather"), ("c2", "mcp__weather__alerts")), None),
                       ("tool", "sunny", None, (), "c1"), ("tool", "none", None, (), "c2")]
    assert c.messages[1].tool_calls[0].arguments == {"city": "Paris"}
    # A reasoning-only turn is retained; multiple message Items append their parts.
    c = conv(input=[{"role": "user", "content": "q"}, _rs("only"), {"role": "user", "content": "q2"}])
    assert msgs(c)[1] == ("assistant", "", "only", (), None)
    c = conv(input=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                    {"role": "assistant", "content": "b"}])
    assert msgs(c)[1][:2] == ("assistant", "ab")


@pytest.mark.parametrize("items, code, param", [
    ([{"role": "assistant", "content": "a"}, _rs("late")], "invalid_assistant_history", "input[2]"),
    ([_fc("c1"), {"role": "assistant", "content": "after"}], "invalid_assistant_history", "input[2]"),
    ([_fc("c1"), _fc("c2"), _out("c1")], "invalid_tool_history", None),
    ([_fc("c1"), _out("c1"), _out("c1")], "invalid_tool_history", "input[3].call_id"),
    ([_fc("c1"), _out("zz")], "invalid_tool_history", "input[2].call_id"),
    ([{"role": "assistant", "content": "x"}, _out("c1")], "invalid_tool_history", "input[2].call_id"),
    ([_fc("c1"), dict(_out("c1"), name="other")], "invalid_tool_history", "input[2].name"),
    ([_fc("c1", namespace="mcp__weather"), dict(_out("c1"), name="get_weather")], "invalid_tool_history",
     "input[2].name"),
    # the pair as the call sent it: not the joined identity, not another split, not another namespace
    ([_fc("c1", namespace="mcp__weather"), dict(_out("c1"), name="mcp__weather__get_weather")],
     "invalid_tool_history", "input[2].name"),
    ([_fc("c1", namespace="mcp__weather"), dict(_out("c1"), namespace="mcp", name="weather__get_weather")],
     "invalid_tool_history", "input[2].name"),
    ([_fc("c1", namespace="mcp__weather"), dict(_out("c1"), namespace="other")], "invalid_tool_history",
     "input[2].namespace"),
    ([_fc("c1"), _out("c1", [])], "invalid_value", "input[2].output"),
    # Calls that another Item follows with no result at all: an empty, so partial, result set.
    ([_fc("c1"), {"role": "user", "content": "never mind"}], "invalid_tool_history", "input[2]"),
])
def test_history_rejections(items, code, param):
    fails(code, param, input=[{"role": "user", "content": "q"}, *items])


def test_item_field_rejections():
    fails("unsupported_parameter", "input[0]", input=[{"type": "reasoning", "summary": [{"type": "summary_text",
                                                                                          "text": "s"}]}])
    fails("invalid_value", "input[1].arguments", input=[{"role": "user", "content": "q"}, _fc("c", args="{nope")])
    fails("invalid_value", "input[1].arguments", input=[{"role": "user", "content": "q"}, _fc("c", args="[1]")])
    fails("unsupported_parameter", "input[1].status",
          input=[{"role": "user", "content": "q"}, dict(_fc("c"), status="in_progress")])
    fails("invalid_type", "input[0].call_id", input=[{"type": "function_call_output", "output": "x"}])
    # A result may assert the identity of the call it answers; a matching assertion is kept.
    ok = [{"role": "user", "content": "q"}, _fc("c1", namespace="mcp__weather"),
          dict(_out("c1"), name="get_weather", namespace="mcp__weather")]
    assert msgs(conv(input=ok))[2][4] == "c1"
    assert parse(input=ok).items[2]["name"] == "get_weather"
    assert conv(input=[*ok[:2], dict(_out("c1"), namespace="mcp__weather")])  # the namespace alone
    # A history that begins with results is a truncated import.
    c = conv(input=[_out("c0", "old"), {"role": "user", "content": "go"}])
    assert msgs(c)[0] == ("tool", "old", None, (), "c0")


def test_prompt_cache_breakpoints_on_parts():
    bp = {"mode": "explicit"}
    c = conv(input=[{"role": "user", "content": [{"type": "input_text", "text": "a", "prompt_cache_breakpoint": bp},
                                                 {"type": "input_text", "text": "b"}]}])
    assert [p.cache_breakpoint for p in c.messages[0].parts] == [True, False]
    assert [(m.message, m.part, m.explicit) for m in c.cache_marks()] == [(0, 0, True), (0, 1, False)]
    fails("invalid_value", "input[0].content[0].prompt_cache_breakpoint",
          input=[{"role": "user", "content": [{"type": "input_text", "text": "a",
                                               "prompt_cache_breakpoint": {"mode": "auto"}}]}])


def test_tools_direct_namespaces_and_choice():
    c = conv(tools=[FN, NS])
    assert [t.name for t in c.tools] == ["get_weather", "mcp__weather__get_weather", "mcp__weather__alerts"]
    assert c.callable_tools == tuple(t.name for t in c.tools)
    req = parse(tools=[FN, NS])
    assert req.tools.split("mcp__weather__alerts") == ("mcp__weather", "alerts")
    assert req.tools.split("get_weather") == (None, "get_weather")
    assert conv(tools=[FN, NS], tool_choice="none").callable_tools == ()
    allowed = {"type": "allowed_tools", "mode": "auto",
               "tools": [{"type": "function", "name": "alerts", "namespace": "mcp__weather"},
                         {"type": "function", "name": "get_weather"}]}
    assert conv(tools=[FN, NS], tool_choice=allowed).callable_tools == ("get_weather", "mcp__weather__alerts")
    assert conv(tools=[FN], tool_choice="none", parallel_tool_calls=False).callable_tools == ()


@pytest.mark.parametrize("body, param", [
    ({"tools": [dict(FN, strict=True)]}, "tools[0].strict"),
    ({"tools": [FN], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}}, "tool_choice.mode"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
    ({"tools": [{"type": "custom", "name": "x"}]}, "tools[0].type"),
    ({"tools": [dict(FN, defer_loading=True)]}, "tools[0].defer_loading"),
    ({"tools": [dict(FN, output_schema={"type": "object"})]}, "tools[0].output_schema"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [dict(FN, strict=True)]}]}, "tools[0].tools[0].strict"),
    ({"tools": [FN], "parallel_tool_calls": False}, "parallel_tool_calls"),
])
def test_tool_rejections(body, param):
    fails("unsupported_parameter", param, **body)


def test_tool_identity_collisions_and_unknown_allowed():
    fails("invalid_value", "tools", tools=[FN, FN])
    fails("invalid_value", "tools", tools=[NS, dict(FN, name="mcp__weather__alerts")])
    fails("invalid_value", "tool_choice.tools[0]", tools=[FN],
          tool_choice={"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]})


def test_history_expansion_and_preserve_thinking_inheritance():
    history = ({"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
               {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
               {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "alerts",
                "namespace": "mcp__weather", "arguments": "{}", "status": "completed"})
    req = parse(input=[_out("call_1")], previous_response_id="resp_x", instructions="New rules.", tools=[NS])
    c = build_conversation(history, req, inherited_preserve=True)
    assert msgs(c) == [("developer", "New rules.", None, (), None), ("user", "q", None, (), None),
                       ("assistant", "", "t", (("call_1", "mcp__weather__alerts"),), None),
                       ("tool", "sunny", None, (), "call_1")]
    assert c.options.preserve_thinking is True
    explicit = build_conversation(history, parse(input=[_out("call_1")], preserve_thinking=False), True)
    assert explicit.options.preserve_thinking is False


def _assemble(events):
    asm = OutputAssembler(parse(tools=[FN, NS]).tools)
    out = []
    for ev in events:
        out += asm.feed(ev)
    return asm, out


def test_output_assembler_items_and_events():
    asm, events = _assemble([ReasoningDelta("th"), ReasoningDelta("ink"), ContentDelta("Hi "), ContentDelta("there"),
                             ToolCallStart(0, "mcp__weather__alerts"), ToolCallArgumentsDelta(0, '{"a":'),
                             ToolCallEnd(0, '{"a":1}'), ToolCallStart(1, "get_weather"), ToolCallEnd(1, "{}")])
    events += asm.finish("completed")
    rs, msg, fc1, fc2 = asm.items
    assert rs == {"type": "reasoning", "id": rs["id"], "summary": [],
                  "content": [{"type": "reasoning_text", "text": "think"}]}
    assert msg["content"][0]["text"] == "Hi there" and msg["status"] == "completed" and msg["id"].startswith("msg_")
    assert (fc1["name"], fc1["namespace"], fc1["arguments"]) == ("alerts", "mcp__weather", '{"a":1}')
    assert fc1["id"].startswith("fc_") and fc1["call_id"].startswith("call_") and fc1["id"] != fc1["call_id"]
    assert "namespace" not in fc2 and fc2["arguments"] == "{}"
    types = [e["type"] for e in events]
    assert types[:3] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 4
    # Deltas concatenate to the terminal Items; indices and ids stay stable.
    for idx, item in enumerate(asm.items):
        mine = [e for e in events if e.get("output_index") == idx]
        assert {e.get("item_id", e.get("item", {}).get("id")) for e in mine} == {item["id"]}
        deltas = "".join(e["delta"] for e in mine if e["type"].endswith(".delta"))
        final = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert deltas == final
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == ['{"a":1}', "{}"]


def test_incomplete_reasoning_only_has_no_invented_message():
    asm, _ = _assemble([ReasoningDelta("partial")])
    closing = asm.finish("incomplete")
    assert [i["type"] for i in asm.items] == ["reasoning"]
    assert closing[-1]["type"] == "response.output_item.done"
    req = parse(max_output_tokens=1)
    r = response_object("resp_1", req, 0, "incomplete", asm.items, None)
    assert r["incomplete_details"] == {"reason": "max_output_tokens"} and r["completed_at"] is None
    assert r["max_output_tokens"] == 1 and r["object"] == "response" and "output_text" not in r
    r = response_object("resp_1", parse(), 0, "completed", [], None)
    assert r["completed_at"] is not None and r["incomplete_details"] is None and r["max_output_tokens"] is None
    assert [status_of(x) for x in ("stop", "length", "cancelled")] == ["completed", "incomplete", "cancelled"]
    json.dumps(r)
