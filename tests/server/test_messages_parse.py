"""Anthropic Messages request normalization: pure parsing, every rule and rejection by field."""

from __future__ import annotations

import pytest

from ninfer.text.events import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from protocols.anthropic_messages import STOP_SEQUENCES_LIMIT, TOOL_ERROR_MARK, parse_request, stop_reason, usage
from protocols.anthropic_output import BlockAssembler
from protocols.errors import ProtocolError
from server.expect import protocol_error

HI = [{"role": "user", "content": "hi"}]
TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def parse(**body):
    body.setdefault("model", "any-label")
    body.setdefault("messages", HI)
    return parse_request(body)


def fails(code: str, param: str | None = None, **body) -> ProtocolError:
    return protocol_error(lambda: parse(**body), code, param)


def roles(req) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in req.conversation.messages]


def test_model_is_any_label_and_required():
    assert parse(model="claude-opus-4").model == "claude-opus-4"
    fails("missing_required_parameter", "model", model=None)
    fails("invalid_type", "model", model="")
    protocol_error(lambda: parse_request([]), "invalid_json")


def test_system_string_array_and_billing_header_rule():
    assert roles(parse(system="Be brief.")) == [("system", "Be brief."), ("user", "hi")]
    arr = [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]
    assert roles(parse(system=arr))[0] == ("system", "AB")  # blocks join without separators
    header = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0",
              "cache_control": {"type": "ephemeral"}}
    req = parse(system=[header, {"type": "text", "text": "Rules."}])
    assert roles(req)[0] == ("system", "Rules.")
    assert not any(p.cache_breakpoint for m in req.conversation.messages for p in m.parts)  # consumed with it
    # Positional: a string form, a later block or an inline system message keeps the text.
    assert roles(parse(system=header["text"]))[0] == ("system", header["text"])
    assert roles(parse(system=[{"type": "text", "text": "R"}, header]))[0] == ("system", "R" + header["text"])
    inline = parse(messages=HI + [{"role": "system", "content": header["text"]}])
    assert roles(inline)[-1] == ("system", header["text"])
    fails("invalid_value", "system[0].type", system=[{"type": "image"}])
    fails("invalid_type", "system", system=3)


def test_history_joins_same_role_turns_and_keeps_system_positions():
    req = parse(messages=[{"role": "user", "content": "a"},
                          {"role": "user", "content": [{"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "c"}, {"role": "system", "content": "s"},
                          {"role": "user", "content": "d"}])
    assert roles(req) == [("user", "ab"), ("assistant", "c"), ("system", "s"), ("user", "d")]
    fails("invalid_value", "messages", messages=[])
    fails("missing_required_parameter", "messages", messages=None)
    # An empty user turn stays a turn in every wire form (it ends the history, no prefill follows it).
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    for empty in ("", [], [{"type": "text", "text": ""}]):
        req = parse(messages=history + [{"role": "user", "content": empty}])
        assert roles(req) == [("user", "a"), ("assistant", "b"), ("user", "")] and req.conversation.prefill is None
    fails("invalid_value", "messages[0].role", messages=[{"role": "tool", "content": "x"}])


def test_images_documents_and_server_blocks():
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    fails("vision_disabled", "messages[0].content[0]", messages=[{"role": "user", "content": [img]}])
    fails("unsupported_parameter", "messages[0].content[0]",
          messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}])
    fails("unsupported_parameter", messages=[{"role": "assistant", "content": [{"type": "redacted_thinking"}]},
                                             *HI])
    fails("invalid_value", "messages[0].content[0].type", messages=[{"role": "user", "content": [{"type": "nope"}]}])
    # a type that is not a string (would not even hash) is a field error, not an internal one
    fails("invalid_type", "messages[0].content[0].type", messages=[{"role": "user", "content": [{"type": ["text"]}]}])
    result = {"type": "tool_result", "tool_use_id": "c1", "content": [{"type": {"t": 1}}]}
    fails("invalid_type", "messages[2].content[0].content[0].type",
          messages=[*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}]},
                    {"role": "user", "content": [result]}], tools=[TOOL])


def test_thinking_history_and_assistant_order():
    history = [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                                      {"type": "text", "text": "ok"}]}, *HI]
    asst = parse(messages=history).conversation.messages[1]
    assert asst.reasoning == "hmm" and asst.text == "ok"
    bad = [*HI, {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                                  {"type": "thinking", "thinking": "late", "signature": ""}]}, *HI]
    fails("invalid_assistant_history", "messages[1].content[1]", messages=bad)
    after_call = [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}},
                                                         {"type": "text", "text": "x"}]}]
    fails("invalid_assistant_history", messages=after_call)
    marked = [*HI, {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x",
                                                      "cache_control": {"type": "ephemeral", "ttl": "9h"}}]}, *HI]
    fails("invalid_value", "messages[1].content[0].cache_control.ttl", messages=marked)


def _call(cid: str, name: str = "f") -> dict:
    return {"type": "tool_use", "id": cid, "name": name, "input": {"a": 1}}


def _result(cid: str, content="r", **kw) -> dict:
    return {"type": "tool_result", "tool_use_id": cid, "content": content, **kw}


def test_tool_results_matched_reordered_and_marked():
    msgs = [*HI, {"role": "assistant", "content": [_call("t1"), _call("t2")]},
            {"role": "user", "content": [_result("t2", "two", is_error=True),
                                         _result("t1", [{"type": "text", "text": "one"}]),
                                         {"type": "text", "text": "next"}]}]
    conv = parse(messages=msgs).conversation
    assert [(m.role, m.tool_call_id, m.text) for m in conv.messages[2:]] == [
        ("tool", "t1", "one"), ("tool", "t2", TOOL_ERROR_MARK + "two"), ("user", None, "next")]
    assert conv.messages[1].tool_calls[0].arguments == {"a": 1}


@pytest.mark.parametrize("results, why", [
    ([_result("t1")], "missing t2"),
    ([_result("t1"), _result("t1"), _result("t2")], "twice"),
    ([_result("t1"), _result("t2"), _result("zz")], "answers no call"),
])
def test_tool_result_rejections(results, why):
    msgs = [*HI, {"role": "assistant", "content": [_call("t1"), _call("t2")]}, {"role": "user", "content": results}]
    err = fails("invalid_tool_history", messages=msgs)
    assert why.split()[-1] in err.message


def test_results_must_lead_and_truncated_history_is_valid():
    late = [*HI, {"role": "assistant", "content": [_call("t1")]},
            {"role": "user", "content": [{"type": "text", "text": "x"}, _result("t1")]}]
    fails("invalid_tool_history", "messages[2].content[1]", messages=late)
    unanswered = [*HI, {"role": "assistant", "content": "plain"}, {"role": "user", "content": [_result("t9")]}]
    fails("invalid_tool_history", messages=unanswered)
    truncated = parse(messages=[{"role": "user", "content": [_result("t0", "old"), {"type": "text", "text": "go"}]}])
    assert [(m.role, m.tool_call_id) for m in truncated.conversation.messages] == [("tool", "t0"), ("user", None)]
    fails("vision_disabled", messages=[{"role": "user", "content": [_result("t0", [{"type": "image", "source": {}}])]}])


def test_assistant_prefill():
    req = parse(messages=[*HI, {"role": "assistant", "content": "The answer is"}])
    conv = req.conversation
    assert conv.prefill == "The answer is" and [m.role for m in conv.messages] == ["user"]
    assert conv.options.enable_thinking is False
    fails("invalid_value", "thinking", messages=[*HI, {"role": "assistant", "content": "x"}],
          thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048)
    fails("invalid_value", "messages[1]", messages=[*HI, {"role": "assistant", "content": [_call("t")]}])
    fails("invalid_value", "messages[1]", messages=[*HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "x", "signature": ""}]}])
    assert parse().conversation.prefill is None
    prefill = [*HI, {"role": "assistant", "content": "x"}]
    fails("invalid_value", "chat_template_kwargs.enable_thinking", messages=prefill,
          chat_template_kwargs={"enable_thinking": True})
    fails("invalid_value", "output_config.effort", messages=prefill, output_config={"effort": "high"})
    assert parse(messages=prefill, thinking={"type": "disabled"}).conversation.prefill == "x"


def test_max_tokens_and_sampling():
    assert parse().generation.max_tokens is None  # optional: the server default applies
    assert parse(max_tokens=7).generation.max_tokens == 7
    fails("invalid_value", "max_tokens", max_tokens=0)
    # Counting reads no output-only field: out-of-range sampling, a zero or negative max_tokens, a
    # budget past max_tokens and a malformed stream do not fail it.
    ignored = {"max_tokens": -3, "temperature": 5, "top_k": 99, "stop_sequences": "x", "stream": "yes",
               "thinking": {"type": "enabled", "budget_tokens": 2048}}
    counted = parse_request({"model": "m", "messages": HI, **ignored}, count_only=True)
    assert counted.conversation.options.enable_thinking and counted.thinking_mode == "enabled"
    g = parse(temperature=0.5, top_p=0.9, top_k=5, stop_sequences=["END", "\n\n"]).generation
    assert (g.temperature, g.top_p, g.top_k, g.stops) == (0.5, 0.9, 5, ("END", "\n\n"))
    fails("invalid_value", "temperature", temperature=1.5)
    fails("invalid_type", "top_k", top_k="3")
    fails("invalid_value", "stop_sequences", stop_sequences=[""])
    fails("invalid_type", "stop_sequences", stop_sequences="END")  # an array, never a bare string
    assert "must be a string." in fails("invalid_type", "stop_sequences[1]", stop_sequences=["END", 1]).message
    # Anthropic sets no cap of four (that is Chat's `stop`); a bound still refuses a flood.
    many = [f"END{i}" for i in range(STOP_SEQUENCES_LIMIT)]
    assert parse(stop_sequences=many[:5]).generation.stops == tuple(many[:5])
    assert parse(stop_sequences=many).generation.stops == tuple(many)
    fails("invalid_value", "stop_sequences", stop_sequences=many + ["END"])


def test_thinking_modes_budget_and_effort():
    off = parse(thinking={"type": "disabled"})
    assert off.conversation.options.enable_thinking is False and off.generation.thinking_budget is None
    adaptive = parse(thinking={"type": "adaptive"})
    assert adaptive.conversation.options.enable_thinking is True
    on = parse(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=1025)
    assert on.conversation.options.enable_thinking is True and on.generation.thinking_budget == 1024
    assert parse().conversation.options.enable_thinking is None  # unspecified: server/template default
    fails("invalid_value", "thinking.budget_tokens", thinking={"type": "enabled", "budget_tokens": 1023})
    fails("invalid_value", "thinking.budget_tokens", thinking={"type": "enabled", "budget_tokens": 2000},
          max_tokens=2000)
    fails("missing_required_parameter", "thinking.budget_tokens", thinking={"type": "enabled"})
    fails("unsupported_parameter", "thinking.display", thinking={"type": "adaptive", "display": "omitted"})
    fails("invalid_value", "thinking.type", thinking={"type": "auto"})
    for effort in ("low", "medium", "high", "xhigh", "max"):  # the protocol's values reach the template
        assert parse(output_config={"effort": effort}).conversation.options.reasoning_effort == effort
    fails("invalid_value", "output_config.effort", output_config={"effort": "extreme"})
    fails("unsupported_parameter", "output_config.format", output_config={"format": {"type": "json_schema"}})
    fails("conflicting_template_option", "thinking", thinking={"type": "disabled"},
          chat_template_kwargs={"enable_thinking": True})


def test_tools_and_tool_choice():
    req = parse(tools=[TOOL, {"name": "g", "description": "G", "input_schema": {"type": "object"},
                              "input_examples": [{"a": 1}]}])
    conv = req.conversation
    assert [t.name for t in conv.tools] == ["f", "g"] and conv.callable_tools == ("f", "g")
    assert conv.tools[1].description == "G"
    # Examples reach the prompt inside the function declaration; a tool without them has no key.
    assert conv.tools[1].to_template()["function"]["input_examples"] == [{"a": 1}]
    assert "input_examples" not in conv.tools[0].to_template()["function"]
    assert parse(tools=[TOOL], tool_choice={"type": "none"}).conversation.callable_tools == ()
    assert parse(tools=[TOOL], tool_choice={"type": "auto"}).conversation.callable_tools == ("f",)
    fails("unsupported_parameter", "tool_choice", tools=[TOOL], tool_choice={"type": "any"})
    fails("unsupported_parameter", "tool_choice", tools=[TOOL], tool_choice={"type": "tool", "name": "f"})
    fails("unsupported_parameter", "tool_choice.disable_parallel_tool_use", tools=[TOOL],
          tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    fails("unsupported_parameter", "tools[0].strict", tools=[dict(TOOL, strict=True)])
    fails("unsupported_parameter", "tools[0].defer_loading", tools=[dict(TOOL, defer_loading=True)])
    fails("unsupported_parameter", "tools[0].allowed_callers", tools=[dict(TOOL, allowed_callers=["code"])])
    fails("unsupported_parameter", "tools[0].type", tools=[{"type": "web_search_20250305", "name": "web_search"}])
    fails("missing_required_parameter", "tools[0].input_schema", tools=[{"name": "f"}])
    fails("invalid_value", "tools", tools=[TOOL, TOOL])
    for key in ("mcp_servers", "container", "output_format", "context_management"):
        fails("unsupported_parameter", key, **{key: {"x": 1} if key != "mcp_servers" else [{"url": "x"}]})
    # Advisory fields do not block an executable request.
    parse(metadata={"user_id": "u"}, service_tier="auto", inference_geo="us", some_future_hint=True)


def _marks(req):
    return [(m.role, p.text) for m in req.conversation.messages for p in m.parts if p.cache_breakpoint]


EPH = {"type": "ephemeral"}


def test_cache_control_block_level_and_limits():
    blocks = [{"type": "text", "text": f"b{i}", "cache_control": EPH} for i in range(4)]
    req = parse(messages=[{"role": "user", "content": blocks}])
    assert _marks(req) == [("user", "b0"), ("user", "b1"), ("user", "b2"), ("user", "b3")]
    assert req.conversation.implicit_cache is False  # Anthropic caches only where asked
    fails("invalid_value", "messages[0].content[4].cache_control",
          messages=[{"role": "user", "content": blocks + [{"type": "text", "text": "b4", "cache_control": EPH}]}])
    # Tools and tool results count toward the four.
    fails("invalid_value", tools=[dict(TOOL, cache_control=EPH)],
          messages=[{"role": "user", "content": blocks}])
    fails("invalid_value", "messages[0].content[0].cache_control.ttl",
          messages=[{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral",
                                                                                                 "ttl": "2h"}}]}])
    one_hour = {"type": "ephemeral", "ttl": "1h"}
    assert _marks(parse(system=[{"type": "text", "text": "S", "cache_control": one_hour}])) == [("system", "S")]


def test_cache_control_request_level_merge_conflict_fifth_slot():
    last = {"type": "text", "text": "last", "cache_control": EPH}
    req = parse(cache_control=EPH, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, last]}])
    assert _marks(req) == [("user", "last")]  # merged with the same target and TTL
    fails("invalid_value", "cache_control", cache_control={"type": "ephemeral", "ttl": "1h"},
          messages=[{"role": "user", "content": [last]}])
    req = parse(cache_control=EPH)
    assert _marks(req) == [("user", "hi")]  # targets the last cacheable block
    four = [{"type": "text", "text": f"b{i}", "cache_control": EPH} for i in range(4)]
    fails("invalid_value", "cache_control", cache_control=EPH,
          messages=[{"role": "user", "content": four + [{"type": "text", "text": "tail"}]}])
    # Four targets including the last one: the request-level marker merges, no fifth slot needed.
    assert len(_marks(parse(cache_control=EPH, messages=[{"role": "user", "content": four}]))) == 4


def test_stop_reasons_and_usage():
    assert stop_reason("eos", "stop", False, None) == "end_turn"
    assert stop_reason("eos", "stop", True, None) == "tool_use"
    assert stop_reason("stop_string", "stop", False, "END") == "stop_sequence"
    assert stop_reason("max_tokens", "length", False, None) == "max_tokens"
    assert stop_reason("context", "length", False, None) == "model_context_window_exceeded"
    assert usage(10, 4, 3) == {"input_tokens": 6, "cache_creation_input_tokens": None,
                               "cache_read_input_tokens": 4, "output_tokens": 3}


def test_block_assembler_lifecycle():
    asm = BlockAssembler()
    events = []
    for ev in [ReasoningDelta("th"), ReasoningDelta("ink"), ContentDelta("Hi"), ToolCallStart(0, "f"),
               ToolCallArgumentsDelta(0, '{"a": '), ToolCallEnd(0, '{"a": 1}'), ContentDelta("tail")]:
        events += asm.feed(ev)
    events += asm.close()
    kinds = [(e["type"], e.get("delta", {}).get("type")) for e in events]
    assert kinds == [("content_block_start", None), ("content_block_delta", "thinking_delta"),
                     ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
                     ("content_block_stop", None), ("content_block_start", None), ("content_block_delta", "text_delta"),
                     ("content_block_stop", None), ("content_block_start", None),
                     ("content_block_delta", "input_json_delta"), ("content_block_delta", "input_json_delta"),
                     ("content_block_stop", None), ("content_block_start", None), ("content_block_delta", "text_delta"),
                     ("content_block_stop", None)]
    assert [b["type"] for b in asm.blocks] == ["thinking", "text", "tool_use", "text"]
    assert asm.blocks[0]["thinking"] == "think" and asm.blocks[0]["signature"]
    assert asm.blocks[2]["input"] == {"a": 1} and asm.has_calls
    parts = "".join(e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta")
    assert parts == '{"a": 1}'


def test_request_level_merges_with_a_tool_result_block_marker():
    msgs = [*HI, {"role": "assistant", "content": [_call("t1")]},
            {"role": "user", "content": [_result("t1", [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                                                 cache_control=EPH)]}]
    req = parse(messages=msgs, cache_control=EPH)
    assert _marks(req) == [("tool", "b")]
    fails("invalid_value", "cache_control", messages=msgs, cache_control={"type": "ephemeral", "ttl": "1h"})
