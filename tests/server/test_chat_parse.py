"""Chat Completions request parsing: every rejection names its field and code; neutral values pass."""

from __future__ import annotations

import pytest

from protocols.conversation import CacheMark
from protocols.errors import CODES, ProtocolError
from protocols.openai_chat import parse_request
from server.expect import protocol_error

MODEL = "tiny-test"


def body(**kw):
    b = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    b.update(kw)
    return b


def reject(b) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_request(b, MODEL)
    assert info.value.code in CODES
    return info.value


def test_minimal_request():
    r = parse_request(body(), MODEL)
    assert r.conversation.template_messages() == [{"role": "user", "content": "hi"}]
    assert r.generation.max_tokens is None and not r.stream


@pytest.mark.parametrize(
    "extra, code, param",
    [
        ({"model": "other"}, "model_not_found", "model"),
        ({"model": 3}, "invalid_type", "model"),
        ({"messages": []}, "invalid_value", "messages"),
        ({"messages": "hi"}, "invalid_type", "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "invalid_value", "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "missing_required_parameter", "messages[0].role"),
        ({"max_tokens": -1}, "invalid_value", "max_tokens"),
        ({"max_completion_tokens": "5"}, "invalid_type", "max_completion_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "invalid_value", "max_completion_tokens"),
        ({"temperature": 2.5}, "invalid_value", "temperature"),
        ({"temperature": True}, "invalid_type", "temperature"),
        ({"top_p": -0.1}, "invalid_value", "top_p"),
        ({"top_k": 21}, "invalid_value", "top_k"),
        ({"top_k": 1.5}, "invalid_type", "top_k"),
        ({"min_p": 1.5}, "invalid_value", "min_p"),
        ({"presence_penalty": 3}, "invalid_value", "presence_penalty"),
        ({"frequency_penalty": "x"}, "invalid_type", "frequency_penalty"),
        ({"seed": 2**63}, "invalid_value", "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_value", "stop"),
        ({"stop": [""]}, "invalid_value", "stop"),
        ({"stop": [1]}, "invalid_type", "stop[0]"),
        ({"n": 2}, "unsupported_parameter", "n"),
        ({"n": 0}, "invalid_value", "n"),
        ({"modalities": ["text", "audio"]}, "unsupported_parameter", "modalities"),
        ({"response_format": {"type": "json_object"}}, "unsupported_parameter", "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "unsupported_parameter", "response_format"),
        ({"logit_bias": {"42": 5}}, "unsupported_parameter", "logit_bias"),
        ({"logprobs": True}, "unsupported_parameter", "logprobs"),
        ({"top_logprobs": 2}, "unsupported_parameter", "top_logprobs"),
        ({"verbosity": "low"}, "unsupported_parameter", "verbosity"),
        ({"verbosity": "loud"}, "invalid_value", "verbosity"),
        ({"web_search_options": {}}, "unsupported_parameter", "web_search_options"),
        ({"store": True}, "unsupported_parameter", "store"),
        ({"functions": [{"name": "f"}]}, "unsupported_parameter", "functions"),
        ({"function_call": {"name": "f"}}, "unsupported_parameter", "function_call"),
        ({"function_call": "bogus"}, "invalid_value", "function_call"),
        ({"function_call": 3}, "invalid_type", "function_call"),
        ({"repetition_penalty": 1.1}, "unsupported_parameter", "repetition_penalty"),
        ({"mm_processor_kwargs": {"a": 1}}, "unsupported_parameter", "mm_processor_kwargs"),
        ({"grammar": "root ::= x"}, "unsupported_parameter", "grammar"),
        ({"guided_json": {}}, "unsupported_parameter", "guided_json"),
        ({"guided_choice": ["a"]}, "unsupported_parameter", "guided_choice"),
        ({"structured_outputs": {"json": {}}}, "unsupported_parameter", "structured_outputs"),
        ({"guided_regex": "a+"}, "unsupported_parameter", "guided_regex"),
        ({"guided_grammar": "x"}, "unsupported_parameter", "guided_grammar"),
        ({"tool_choice": "required"}, "unsupported_parameter", "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "unsupported_parameter", "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
         "unsupported_parameter", "tools[0].function.strict"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "unsupported_parameter", "tools[0].type"),
        ({"tools": [{"function": {"name": "f"}}]}, "invalid_type", "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
         "invalid_type", "tools[0].function.strict"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": False},
         "unsupported_parameter", "parallel_tool_calls"),
        ({"reasoning_effort": "extreme"}, "invalid_value", "reasoning_effort"),
        ({"enable_thinking": True, "reasoning_effort": "none"}, "conflicting_template_option", "reasoning_effort"),
        ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}},
         "conflicting_template_option", "enable_thinking"),
        ({"chat_template_kwargs": {"messages": []}}, "invalid_value", "chat_template_kwargs.messages"),
        ({"enable_thinking": "yes"}, "invalid_type", "enable_thinking"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "unsupported_parameter", "messages[0].name"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c", "name": 5}]},
         "invalid_type", "messages[0].name"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "missing_required_parameter", "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
         "vision_disabled", "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                      "image_url": {"url": "http://x", "detail": "high"}}]}]},
         "unsupported_parameter", "messages[0].content[0].image_url.detail"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
         "unsupported_parameter", "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
         "invalid_value", "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
         "invalid_value", "messages[0].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "function", "name": "f", "content": "r"}]}, "invalid_prompt", "messages[0]"),
        ({"prompt_cache_options": {"mode": "sometimes"}}, "invalid_value", "prompt_cache_options.mode"),
    ],
)
def test_rejections_name_field_and_code(extra, code, param):
    err = reject(body(**extra))
    assert (err.code, err.param) == (code, param)
    assert err.message and (param in err.message or err.code in ("model_not_found", "invalid_prompt", "vision_disabled"))
    env = err.openai_body()["error"]
    assert env["code"] == code and env["param"] == param and env["type"]


def test_neutral_values_and_unknown_fields_accepted():
    r = parse_request(body(
        logit_bias={"42": 0}, logprobs=False, top_logprobs=0, verbosity="medium", functions=[],
        function_call="none", prediction={"type": "content", "content": "x"}, audio={"voice": "alloy"},
        modalities=["text"], response_format={"type": "text"}, n=1, repetition_penalty=1,
        mm_processor_kwargs={"a": None}, metadata={"k": "v"}, user="u", safety_identifier="s",
        service_tier="auto", prompt_cache_key="k", prompt_cache_retention="24h", store=False,
        some_future_field={"x": 1}, stream_options={"include_usage": True}, grammar=None,
    ), MODEL)
    assert r.generation.max_tokens is None
    assert not r.include_usage  # stream options only matter on a stream


@pytest.mark.parametrize("field, value, code", [
    ("user", 7, "invalid_type"), ("safety_identifier", ["s"], "invalid_type"), ("prompt_cache_key", {}, "invalid_type"),
    ("prompt_cache_retention", "forever", "invalid_value"),
])
def test_advisory_fields_are_still_typed(field, value, code):
    protocol_error(lambda: parse_request(body(**{field: value}), MODEL), code, field)


def test_generation_fields():
    r = parse_request(body(max_tokens=0, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1, seed=-7,
                           presence_penalty=1, frequency_penalty=-1, stop="END"), MODEL)
    g = r.generation
    assert (g.max_tokens, g.temperature, g.top_p, g.top_k, g.min_p, g.seed, g.stops) == (
        0, 0.5, 0.9, 0, 0.1, -7, ("END",))
    assert parse_request(body(max_completion_tokens=9), MODEL).generation.max_tokens == 9


def test_parts_join_without_separator_and_roles_kept_in_order():
    r = parse_request(body(messages=[
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "refusal", "refusal": "y"}],
         "reasoning": "r"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": ""},
    ]), MODEL)
    assert r.conversation.template_messages() == [
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "xy", "reasoning_content": "r"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": ""},
    ]


def test_tool_history_and_legacy_functions():
    r = parse_request(body(messages=[
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"b": 1, "a": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get"},
        {"role": "assistant", "content": None, "function_call": {"name": "old", "arguments": "{}"}},
        {"role": "function", "name": "old", "content": "done"},
    ]), MODEL)
    msgs = r.conversation.template_messages()
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "get", "arguments": {"b": 1, "a": "x"}}
    assert list(msgs[1]["tool_calls"][0]["function"]["arguments"]) == ["b", "a"]  # member order kept
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert msgs[4] == {"role": "tool", "content": "done", "tool_call_id": msgs[3]["tool_calls"][0]["id"]}


def test_tools_and_choice():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "abc"]
    r = parse_request(body(tools=tools), MODEL)
    assert r.conversation.callable_tools == ("a", "b", "c")
    assert len(r.conversation.template_tools()) == 3
    r = parse_request(body(tools=tools, tool_choice="none"), MODEL)
    assert r.conversation.callable_tools == () and len(r.conversation.template_tools()) == 3
    r = parse_request(body(tools=tools, tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "c"}},
                                  {"type": "function", "function": {"name": "a"}}]}}), MODEL)
    assert r.conversation.callable_tools == ("a", "c")
    # parallel_tool_calls false is fine when nothing is callable
    parse_request(body(tools=tools, tool_choice="none", parallel_tool_calls=False), MODEL)


def test_thinking_options():
    c = parse_request(body(reasoning_effort="none"), MODEL).conversation
    assert c.thinking(server_default=True) is False
    assert c.template_kwargs(thinking_default=None, preserve_default=None) == {
        "enable_thinking": False, "reasoning_effort": "none"}
    c = parse_request(body(chat_template_kwargs={"enable_thinking": True, "preserve_thinking": True,
                                                 "custom": None}), MODEL).conversation
    assert c.template_kwargs(thinking_default=False, preserve_default=False) == {
        "custom": None, "enable_thinking": True, "preserve_thinking": True}
    c = parse_request(body(), MODEL).conversation
    assert c.template_kwargs(thinking_default=False, preserve_default=None) == {"enable_thinking": False}
    assert c.template_kwargs(thinking_default=None, preserve_default=None) == {}
    c = parse_request(body(enable_thinking=True, reasoning_effort="high"), MODEL).conversation
    assert c.thinking(server_default=False) is True


def _text(t, bp=False):
    p = {"type": "text", "text": t}
    if bp:
        p["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return p


def test_cache_marks_explicit_first_latest_four():
    msgs = [{"role": "user", "content": [_text(f"m{i}", bp=True) for i in range(3)]},
            {"role": "assistant", "content": [_text("a", bp=True), _text("b", bp=True)]},
            {"role": "user", "content": [_text("q")]}]
    c = parse_request(body(messages=msgs), MODEL).conversation
    assert c.cache_marks() == [CacheMark(0, 1, True), CacheMark(0, 2, True), CacheMark(1, 0, True),
                               CacheMark(1, 1, True)]
    msgs[0]["content"] = [_text("m0", bp=True)]
    c = parse_request(body(messages=msgs), MODEL).conversation
    assert c.cache_marks()[-1] == CacheMark(2, 0, False)
    c = parse_request(body(messages=msgs, prompt_cache_options={"mode": "explicit"}), MODEL).conversation
    assert all(m.explicit for m in c.cache_marks()) and len(c.cache_marks()) == 3


def test_legacy_function_calls_get_distinct_ids_and_their_results_follow_the_latest():
    def call(name):
        return {"role": "assistant", "content": None, "function_call": {"name": name, "arguments": "{}"}}

    def result(name):
        return {"role": "function", "name": name, "content": "ok"}

    messages = [{"role": "user", "content": "go"}, call("a"), result("a"), call("a"), result("a"), call("b"),
                result("b")]
    conv = parse_request(body(messages=messages), MODEL).conversation
    calls = [m.tool_calls[0].id for m in conv.messages if m.role == "assistant"]
    results = [m.tool_call_id for m in conv.messages if m.role == "tool"]
    assert len(set(calls)) == 3 and results == calls
