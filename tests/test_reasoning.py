"""ReasoningSplitter: channel split, marker removal, hold-back, independence from text splits."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ninfer.text.reasoning import CLOSE_MARKER, OPEN_MARKER, Channel, ReasoningSplitter

R, C = Channel.REASONING, Channel.CONTENT


def _run(starts_in_thinking: bool, chunks: list[str]) -> list[tuple[Channel, str]]:
    splitter = ReasoningSplitter(starts_in_thinking)
    out: list[tuple[Channel, str]] = []
    for chunk in chunks:
        out += splitter.feed(chunk)
    out += splitter.flush()
    return _merge(out)


def _merge(pieces: list[tuple[Channel, str]]) -> list[tuple[Channel, str]]:
    merged: list[tuple[Channel, str]] = []
    for channel, text in pieces:
        if merged and merged[-1][0] is channel:
            merged[-1] = (channel, merged[-1][1] + text)
        elif text:
            merged.append((channel, text))
    return merged


def _reference(starts_in_thinking: bool, text: str) -> list[tuple[Channel, str]]:
    """The split of a complete text, written without streaming."""
    if not starts_in_thinking:
        if not text.startswith(OPEN_MARKER):
            return _merge([(C, text)])
        text = text[len(OPEN_MARKER):]
    reasoning, closed, content = text.partition(CLOSE_MARKER)
    out = [(R, reasoning.lstrip("\n"))]
    if closed:
        out.append((C, content.lstrip("\n")))
    return _merge(out)


def test_starts_in_thinking_and_closes():
    assert _run(True, ["Let me see.\n</think>\n\nParis."]) == [(R, "Let me see.\n"), (C, "Paris.")]


def test_content_may_open_reasoning_as_its_first_text():
    assert _run(False, ["<think>\nhmm</think>\n\nok"]) == [(R, "hmm"), (C, "ok")]


def test_markers_after_content_started_are_text():
    text = "Use <think> and </think> tags."
    assert _run(False, [text]) == [(C, text)]
    assert _run(True, ["a</think>b<think>c</think>d"]) == [(R, "a"), (C, "b<think>c</think>d")]


def test_only_a_possible_marker_prefix_is_held():
    splitter = ReasoningSplitter(True)
    assert splitter.feed("step one </th") == [(R, "step one ")]
    assert splitter.feed("ink") == []
    assert splitter.feed(">\n\nanswer") == [(C, "answer")]
    splitter = ReasoningSplitter(True)
    assert splitter.feed("a </th") == [(R, "a ")]
    assert splitter.feed("eory") == [(R, "</theory")]


def test_flush_releases_a_held_partial_marker_in_its_channel():
    assert _run(True, ["abc</thi"]) == [(R, "abc</thi")]
    assert _run(False, ["<thi"]) == [(C, "<thi")]


def test_content_start_waits_for_a_possible_open_marker():
    splitter = ReasoningSplitter(False)
    assert splitter.feed("<th") == []
    assert splitter.feed("e answer") == [(C, "<the answer")]
    assert splitter.feed("<think>") == [(C, "<think>")]


def test_newlines_after_markers_are_dropped_even_across_feeds():
    assert _run(True, ["\n", "\n", "x</think>", "\n", "\n\n", "y\n"]) == [(R, "x"), (C, "y\n")]


def test_empty_reasoning_and_empty_content():
    assert _run(True, ["</think>"]) == []
    assert _run(False, ["<think></think>"]) == []


def test_touched_reasoning_marks_the_feed_that_holds_the_close_marker():
    splitter = ReasoningSplitter(True)
    splitter.feed("a")
    assert splitter.touched_reasoning
    splitter.feed("</think>")
    assert splitter.touched_reasoning and not splitter.in_reasoning
    splitter.feed("b")
    assert not splitter.touched_reasoning
    splitter = ReasoningSplitter(False)
    splitter.feed("<think>")
    assert splitter.touched_reasoning and splitter.in_reasoning


TEXT = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "</thi", "think", ">", "\n",
                                 "a", " b", "é", "🙂"]), max_size=25).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.booleans(), TEXT, st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_any_split_gives_the_reference_split(starts_in_thinking, text, cuts):
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _run(starts_in_thinking, chunks) == _reference(starts_in_thinking, text)
