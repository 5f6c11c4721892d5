"""OutputDecoder end to end: token ids of the synthetic Qwen-style tokenizer in, events out."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings, strategies as st

from ninfer.text import Tokenizer, early_close_ids
from ninfer.text.output import (
    ContentDelta,
    OutputDecoder,
    ReasoningDelta,
    StopMatched,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from ninfer.text.synthetic import TEST_SPECIAL_TOKENS, build_test_tokenizer_json

TOK = Tokenizer.from_json(build_test_tokenizer_json(), TEST_SPECIAL_TOKENS)
CONTROL = re.compile("(" + "|".join(re.escape(s) for s in TOK.added_tokens) + ")")
THINK_CLOSE_ID = TOK.added_tokens["</think>"]
EOS = TOK.added_tokens["<|im_end|>"]

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def model_ids(text: str) -> list[int]:
    """Ids as the model would emit them: control spellings are their single added tokens."""
    ids: list[int] = []
    for piece in CONTROL.split(text):
        if piece in TOK.added_tokens:
            ids.append(TOK.added_tokens[piece])
        elif piece:
            ids += TOK.encode(piece)
    return ids


def decode_all(ids: list[int], groups: list[list[int]] | None = None, **options) -> tuple[list, OutputDecoder]:
    decoder = OutputDecoder(TOK, **options)
    events: list = []
    for group in groups if groups is not None else [[i] for i in ids]:
        events += decoder.push(group)
    events += decoder.finish()
    return merge(events), decoder


def merge(events: list) -> list:
    out: list = []
    for e in events:
        if out and isinstance(e, (ReasoningDelta, ContentDelta)) and type(out[-1]) is type(e):
            out[-1] = type(e)(out[-1].text + e.text)
        elif isinstance(e, ToolCallArgumentsDelta) and out and isinstance(out[-1], ToolCallArgumentsDelta):
            out[-1] = ToolCallArgumentsDelta(e.index, out[-1].text + e.text)
        else:
            out.append(e)
    return out


def text_of(events: list, kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_reasoning_then_answer_with_exact_reasoning_token_count():
    ids = model_ids("Paris is in France 🇫🇷.\n</think>\n\nIt is Paris.<|im_end|>")
    events, decoder = decode_all(ids, starts_in_thinking=True)
    assert events == [ReasoningDelta("Paris is in France 🇫🇷.\n"), ContentDelta("It is Paris.")]
    stats = decoder.stats
    assert stats.reasoning_tokens == ids.index(THINK_CLOSE_ID) + 1
    assert stats.completion_tokens == len(ids)


def test_model_opened_reasoning_counts_from_the_open_marker():
    ids = model_ids("<think>\nhm</think>\n\nyes")
    events, decoder = decode_all(ids)
    assert events == [ReasoningDelta("hm"), ContentDelta("yes")]
    assert decoder.stats.reasoning_tokens == ids.index(THINK_CLOSE_ID) + 1


def test_close_marker_spelled_in_pieces_still_closes_and_counts_as_reasoning():
    ids = TOK.encode("ab</think>cd")  # plain encoding: the marker spans several byte-level tokens
    assert THINK_CLOSE_ID not in ids
    events, decoder = decode_all(ids, starts_in_thinking=True)
    assert events == [ReasoningDelta("ab"), ContentDelta("cd")]
    texts = [TOK.decode(ids[:k]) for k in range(len(ids) + 1)]
    expected = next(k for k in range(len(ids) + 1) if "</think>" in texts[k])
    assert decoder.stats.reasoning_tokens == expected


def test_thinking_budget_guidance_streams_as_reasoning_and_closes():
    ids = model_ids("Long thought") + early_close_ids(TOK) + model_ids("Answer.")
    events, decoder = decode_all(ids, starts_in_thinking=True)
    assert events == [
        ReasoningDelta("Long thought\n\nConsidering the limited time, I have to give the solution "
                       "based on the thinking directly now.\n"),
        ContentDelta("Answer."),
    ]


def test_stop_in_reasoning_ends_the_output():
    ids = model_ids("plan A. STOP here</think>\n\nanswer")
    decoder = OutputDecoder(TOK, starts_in_thinking=True, stops=["STOP"])
    events = merge([e for i in ids for e in decoder.push([i])])
    assert events == [ReasoningDelta("plan A. "), StopMatched("STOP")]
    assert decoder.stopped == "STOP"
    assert decoder.finish() == []
    # The output ends with the token that completed the match: tokens after it are not counted.
    n = decoder.stop_tokens
    assert decoder.stats.completion_tokens == n < len(ids)
    assert "STOP" in TOK.decode(ids[:n]) and "STOP" not in TOK.decode(ids[:n - 1])


def test_stop_in_content_and_tokens_after_it_are_not_output():
    ids = model_ids("</think>\n\nOne. Two. Three.")
    decoder = OutputDecoder(TOK, starts_in_thinking=True, stops=[" Two", "Three"])
    events = merge(decoder.push(ids) + decoder.push(model_ids(" more")) + decoder.finish())
    assert events == [ContentDelta("One."), StopMatched(" Two")]
    upto = model_ids("</think>\n\nOne. Two")
    assert ids[:len(upto)] == upto and decoder.stop_tokens == decoder.stats.completion_tokens == len(upto)
    assert decoder.stats.reasoning_tokens == 1


def test_a_stop_does_not_span_the_end_of_reasoning():
    ids = model_ids("ab</think>cd")
    events, decoder = decode_all(ids, starts_in_thinking=True, stops=["bc"])
    assert events == [ReasoningDelta("ab"), ContentDelta("cd")]
    assert decoder.stopped is None


def test_reasoning_held_for_a_stop_prefix_is_released_when_reasoning_closes():
    decoder = OutputDecoder(TOK, starts_in_thinking=True, stops=["so\nEND"])
    events = decoder.push(model_ids("thinking so"))
    assert text_of(events, ReasoningDelta) == "thinking "
    assert decoder.push([THINK_CLOSE_ID]) == [ReasoningDelta("so")]


def test_tool_call_after_reasoning_and_text():
    text = "need weather</think>\n\nLet me check.\n" + call("get_weather", ("city", "Paris"), ("days", "2"))
    events, decoder = decode_all(model_ids(text + "<|im_end|>"), starts_in_thinking=True, tools=[WEATHER])
    assert events == [
        ReasoningDelta("need weather"), ContentDelta("Let me check.\n"),
        ToolCallStart(0, "get_weather"), ToolCallArgumentsDelta(0, '{"city": "Paris", "days": 2}'),
        ToolCallEnd(0, '{"city": "Paris", "days": 2}'),
    ]
    assert decoder.stats.tool_call_parse["structured_calls"] == 1


def test_tool_markup_in_reasoning_is_reasoning_text():
    markup = call("get_weather", ("city", "Oslo"))
    events, decoder = decode_all(model_ids(markup + "</think>ok"), starts_in_thinking=True, tools=[WEATHER])
    assert events == [ReasoningDelta(markup), ContentDelta("ok")]
    assert decoder.stats.tool_call_parse["marker_seen"] is False


def test_stop_inside_a_tool_region_returns_the_region_as_text():
    text = call("get_weather", ("city", "Oslo"), ("days", "3"))
    events, decoder = decode_all(model_ids(text), tools=[WEATHER], stops=["Oslo"])
    cut = text.index("Oslo")
    assert events == [ContentDelta(text[:cut]), StopMatched("Oslo")]
    assert decoder.stats.tool_call_parse["fallback_reason"] == "malformed_structure"


def test_tool_parsing_off_keeps_calls_as_text():
    text = call("get_weather", ("city", "Oslo"))
    events, decoder = decode_all(model_ids(text), tools=[WEATHER], tool_parsing=False)
    assert events == [ContentDelta(text)]
    assert decoder.stats.tool_call_parse["marker_seen"] is True
    assert decoder.stats.tool_call_parse["structured_calls"] == 0


def test_push_after_finish_is_an_error():
    decoder = OutputDecoder(TOK)
    decoder.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        decoder.push([1])


def test_invalid_stops_are_rejected_at_construction():
    with pytest.raises(ValueError, match="at most 64"):
        OutputDecoder(TOK, stops=[f"s{i}" for i in range(65)])


# -- property tests -----------------------------------------------------------------------------

PIECES = ["<think>", "</think>", "\n", "\n\n", "Paris", " is", " 🇫🇷", "東京", "é", " STOP", "ST", "<",
          "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=nope>", "<parameter=city>",
          "<parameter=days>", "</parameter>", "</function>", "3", "<|im_end|>"]
CALLS = st.sampled_from(["", call("get_weather", ("city", "Oslo")),
                          call("get_weather", ("days", "4")) + "\n" + call("get_weather")])
OUTPUT = st.tuples(st.lists(st.sampled_from(PIECES), max_size=30).map("".join), CALLS,
                   st.sampled_from(["", "<|im_end|>", "\n", " more"])).map("".join)


def _groups(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = [0, *sorted(c for c in cuts if c <= len(ids)), len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=200, deadline=None)
@given(OUTPUT, st.booleans(), st.sampled_from([None, ["STOP"], ["\n\n", "Paris is"]]),
       st.lists(st.integers(min_value=0, max_value=120), max_size=10))
def test_any_grouping_of_pushes_gives_the_same_events_and_stats(text, thinking, stops, cuts):
    ids = model_ids(text)
    options = dict(starts_in_thinking=thinking, tools=[WEATHER], stops=stops)
    one_by_one, first = decode_all(ids, **options)
    grouped, second = decode_all(ids, _groups(ids, cuts), **options)
    assert grouped == one_by_one
    assert second.stats == first.stats and second.stop_tokens == first.stop_tokens
    assert first.stats.completion_tokens == (len(ids) if first.stopped is None else first.stop_tokens)


def _reference_channels(full: str, thinking: bool) -> tuple[str, str]:
    if not thinking:
        if not full.startswith("<think>"):
            return "", full
        full = full[len("<think>"):]
    reasoning, closed, content = full.partition("</think>")
    return reasoning.lstrip("\n"), content.lstrip("\n") if closed else ""


@settings(max_examples=200, deadline=None)
@given(OUTPUT, st.booleans())
def test_text_is_byte_exact_when_no_call_is_made(text, thinking):
    ids = model_ids(text)
    events, decoder = decode_all(ids, starts_in_thinking=thinking, tools=[WEATHER])
    reasoning, content = _reference_channels(TOK.decode(ids, skip_special=True), thinking)
    assert text_of(events, ReasoningDelta) == reasoning
    if decoder.stats.tool_call_parse["structured_calls"] == 0:
        assert text_of(events, ContentDelta) == content
    else:
        assert content.startswith(text_of(events, ContentDelta))
        for e in events:
            if isinstance(e, ToolCallEnd):
                json.loads(e.arguments)
    if thinking and THINK_CLOSE_ID in ids:
        assert decoder.stats.reasoning_tokens == ids.index(THINK_CLOSE_ID) + 1
