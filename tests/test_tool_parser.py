"""ToolCallParser: structured calls, streaming hold-back, byte-exact fallback with each reason."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from ninfer.text.events import ContentDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from ninfer.text.tool_parser import MAX_TAG_NAME, ToolCallParser, declared_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}},
    },
}
WRITE = {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}}}
TOOLS = [WEATHER, WRITE]


def call(name: str, *params: tuple[str, str]) -> str:
    """A call block as the chat template renders one."""
    body = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def run(text_chunks: list[str] | str, tools=TOOLS) -> tuple[list, ToolCallParser]:
    parser = ToolCallParser(tools)
    chunks = [text_chunks] if isinstance(text_chunks, str) else text_chunks
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return merge(events), parser


def merge(events: list) -> list:
    out: list = []
    for event in events:
        if out and isinstance(event, ContentDelta) and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def calls(events: list) -> list[tuple[str, str]]:
    """(name, arguments) per call, checking that the argument deltas add up to the final JSON."""
    names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
    deltas: dict[int, str] = {}
    out = []
    for e in events:
        if isinstance(e, ToolCallArgumentsDelta):
            deltas[e.index] = deltas.get(e.index, "") + e.text
        if isinstance(e, ToolCallEnd):
            assert deltas.get(e.index) == e.arguments
            out.append((names[e.index], e.arguments))
    return out


def content(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


def test_single_call_with_typed_parameters():
    events, parser = run("Checking.\n" + call("get_weather", ("city", "Paris"), ("days", "3"),
                                              ("metric", "True")))
    assert content(events) == "Checking.\n"
    assert calls(events) == [("get_weather", '{"city": "Paris", "days": 3, "metric": true}')]
    assert parser.diagnostics == {"marker_seen": True, "structured_calls": 1,
                                  "empty_non_string_omitted": 0, "schema_mismatch_preserved": 0,
                                  "fallback_reason": "none"}


def test_parallel_calls_keep_order_and_indices():
    text = call("get_weather", ("city", "Oslo")) + "\n" + call("write_file", ("path", "a.txt"),
                                                              ("content", "hi"))
    events, parser = run(text)
    assert [e.index for e in events if isinstance(e, ToolCallStart)] == [0, 1]
    assert calls(events) == [("get_weather", '{"city": "Oslo"}'),
                             ("write_file", '{"path": "a.txt", "content": "hi"}')]
    assert content(events) == "" and parser.structured_calls == 2


def test_arguments_keep_parameter_order_of_the_output():
    events, _ = run(call("write_file", ("content", "x"), ("path", "p")))
    assert list(json.loads(calls(events)[0][1])) == ["content", "path"]


def test_function_without_parameters_has_empty_arguments():
    events, _ = run(call("get_weather"))
    assert calls(events) == [("get_weather", "{}")]


def test_ordinary_text_streams_at_once_and_only_an_ambiguous_suffix_is_held():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Let me look <b>that</b> up. <tool") == [ContentDelta("Let me look <b>that</b> up. ")]
    assert parser.feed("_cal") == []
    assert parser.feed("x>") == [ContentDelta("<tool_calx>")]


def test_tool_events_wait_for_the_end_of_output():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("ok " + call("get_weather", ("city", "Rome"))) == [ContentDelta("ok ")]
    assert parser.feed("\n  \n") == []
    events = parser.finish()
    assert calls(events) == [("get_weather", '{"city": "Rome"}')]


def test_string_values_keep_markup_and_balanced_nested_parameters():
    value = ("<tool_call>\n<function=x>\n<parameter=a>\ninner\n</parameter>\n</function>\n</tool_call>"
             "\n< not a tag <parameter= also text")
    events, _ = run(call("write_file", ("path", "t.xml"), ("content", value)))
    assert json.loads(calls(events)[0][1]) == {"path": "t.xml", "content": value}


def test_value_keeps_inner_newlines_and_drops_one_at_each_edge():
    events, _ = run("<tool_call><function=write_file><parameter=content>\n\nline\n\n</parameter>"
                    "</function></tool_call>")
    assert json.loads(calls(events)[0][1]) == {"content": "\nline\n"}


FALLBACKS = [
    ("malformed_structure", call("get_weather", ("city", "Paris"))[:-3]),  # output ends inside
    ("malformed_structure", "<tool_call>\n<function=get_weather>\ntext\n</function>\n</tool_call>"),
    ("malformed_structure", "<tool_call>\n<function=get_weather>\n</parameter>\n</function>\n</tool_call>"),
    ("malformed_structure", call("write_file", ("content", "a <parameter=x> b"))),  # unmatched opener
    ("malformed_structure", "<tool_call>\n<function=get\nweather>\n</function>\n</tool_call>"),
    ("malformed_structure", "<tool_call>\n<function=get_weather>\n<parameter=>\n1\n</parameter>\n"
                            "</function>\n</tool_call>"),
    ("malformed_structure", "<tool_call>\nhello</tool_call>"),
    ("malformed_structure", "<tool_call>\n<function=get_weather>\n</function>\nx</tool_call>"),
    ("duplicate_parameter", call("get_weather", ("city", "A"), ("city", "B"))),
    ("invalid_tool_name", call("get weather", ("city", "A"))),
    ("invalid_tool_name", call("", ("city", "A"))),
    ("undeclared_tool", call("delete_everything", ("city", "A"))),
    ("trailing_content", call("get_weather", ("city", "A")) + "\nDone!"),
    ("trailing_content", call("get_weather", ("city", "A")) + "\n" + call("get_weather") + " thanks"),
    # The output ends on text that could still have started another call: it is text all the same.
    ("trailing_content", call("get_weather", ("city", "A")) + "\n<"),
    ("trailing_content", call("get_weather", ("city", "A")) + "\n<tool_call"),
]


@pytest.mark.parametrize("reason, text", FALLBACKS)
def test_fallback_returns_the_region_byte_exactly_with_its_reason(reason, text):
    prefix = "Answer first.\n"
    events, parser = run(prefix + text)
    assert content(events) == prefix + text
    assert not calls(events)
    diag = parser.diagnostics
    assert diag["fallback_reason"] == reason and diag["structured_calls"] == 0
    assert diag["marker_seen"] is True


@pytest.mark.parametrize("reason, text", FALLBACKS)
def test_fallback_is_the_same_when_streamed_one_character_at_a_time(reason, text):
    events, parser = run(list(text))
    assert content(events) == text and parser.diagnostics["fallback_reason"] == reason


@pytest.mark.parametrize("split", [False, True])
def test_overlong_tag_names_are_not_tags_however_the_text_arrives(split):
    long_name = "p" * (MAX_TAG_NAME + 1)
    text = call("get_weather", (long_name, "1"))
    events, parser = run(list(text) if split else text)
    assert content(events) == text
    assert parser.diagnostics["fallback_reason"] == "malformed_structure"
    nested = f"a <parameter={long_name}> b"  # not an opener, so it needs no closing tag
    events, _ = run(list(call("write_file", ("content", nested))) if split
                    else call("write_file", ("content", nested)))
    assert json.loads(calls(events)[0][1]) == {"content": nested}


def test_a_later_region_still_becomes_calls_after_a_fallback():
    bad = call("nope", ("city", "x"))
    good = call("get_weather", ("city", "Lima"))
    events, parser = run(bad + "\nretrying\n" + good)
    assert content(events) == bad + "\nretrying\n"
    assert calls(events) == [("get_weather", '{"city": "Lima"}')]
    assert parser.diagnostics["fallback_reason"] == "undeclared_tool"
    assert parser.diagnostics["structured_calls"] == 1


def test_one_bad_call_turns_the_whole_region_into_text():
    text = call("get_weather", ("city", "A")) + "\n" + call("unknown_tool")
    events, parser = run(text)
    assert content(events) == text and not calls(events)
    assert parser.diagnostics["fallback_reason"] == "undeclared_tool"


def test_without_tools_nothing_is_held_and_the_marker_is_noted():
    parser = ToolCallParser(None)
    assert parser.feed("see <tool") == [ContentDelta("see <tool")]
    assert parser.feed("_call>\n<function=f>") == [ContentDelta("_call>\n<function=f>")]
    assert parser.finish() == []
    assert parser.diagnostics["marker_seen"] is True
    assert parser.diagnostics["fallback_reason"] == "none"


def test_no_marker_no_diagnostics():
    events, parser = run("plain <function=get_weather> text")
    assert content(events) == "plain <function=get_weather> text"
    assert parser.diagnostics["marker_seen"] is False


def test_declared_tool_shapes():
    class Tool:
        name = "t4"
        parameters = {"properties": {"x": {"type": "integer"}}}

    tools = declared_tools([
        WEATHER,
        {"type": "function", "name": "t2", "parameters": {"properties": {"y": {"type": "string"}}}},
        {"name": "t3", "input_schema": {"type": "object"}},
        Tool(),
    ])
    assert list(tools) == ["get_weather", "t2", "t3", "t4"]
    assert tools["t2"] == {"y": {"type": "string"}} and tools["t3"] == {}
    assert tools["t4"] == {"x": {"type": "integer"}}
    with pytest.raises(ValueError, match="tool 0 has no name"):
        declared_tools([{"type": "function", "function": {"parameters": {}}}])


def test_finish_is_final():
    parser = ToolCallParser(TOOLS)
    parser.finish()
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("x")


# -- property tests -----------------------------------------------------------------------------

PIECES = [
    "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=write_file>", "<function=x y>",
    "<parameter=city>", "<parameter=days>", "<parameter=content>", "</parameter>", "</function>",
    "\n", " ", "Paris", "3", "true", "{\"a\": [1, 2]}", "<", ">", "<tool_", "</para", "é🙂", "text",
]
MARKUP = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
WELL_FORMED = st.lists(
    st.tuples(st.sampled_from(["get_weather", "write_file"]),
              st.lists(st.tuples(st.sampled_from(["city", "days", "content", "path"]),
                                 st.sampled_from(["Paris", "", "3", "x\n<b>", "[1]", "True"])),
                       max_size=3, unique_by=lambda p: p[0])),
    min_size=1, max_size=3,
).map(lambda cs: "\n".join(call(name, *params) for name, params in cs))


def _chunks(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(st.one_of(MARKUP, WELL_FORMED, st.tuples(st.text(max_size=5), WELL_FORMED, MARKUP).map("".join)),
       st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_any_split_gives_the_same_events_as_one_piece(text, cuts):
    whole, whole_parser = run([text])
    split, split_parser = run(_chunks(text, cuts))
    assert split == whole
    assert split_parser.diagnostics == whole_parser.diagnostics


@settings(max_examples=300, deadline=None)
@given(st.one_of(MARKUP, st.tuples(WELL_FORMED, MARKUP).map("".join)),
       st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_content_is_the_input_byte_for_byte_up_to_the_calls(text, cuts):
    events, _ = run(_chunks(text, cuts))
    if calls(events):
        assert text.startswith(content(events))  # the calls are the end of the output
        region = text[len(content(events)):].rstrip()
        assert region.startswith("<tool_call>") and region.endswith("</tool_call>")  # no byte is lost
    else:
        assert content(events) == text


@settings(max_examples=200, deadline=None)
@given(WELL_FORMED, st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_well_formed_regions_always_become_calls(text, cuts):
    events, parser = run(_chunks(text, cuts))
    assert content(events) == ""
    assert parser.diagnostics["fallback_reason"] == "none"
    assert parser.structured_calls == text.count("<tool_call>")
    for _, arguments in calls(events):
        json.loads(arguments)
