"""StopMatcher: validation, hold-back, first-completed match, independence from text splits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from ninfer.text.holdback import partial_marker_suffix
from ninfer.text.stops import StopMatcher, validate_stops


def _run(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        text, stop = matcher.feed(chunk)
        out.append(text)
        if stop is not None:
            return "".join(out), stop
    out.append(matcher.flush())
    return "".join(out), None


def _reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """Scan the finished text for the first position where some stop has completed."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)  # same end: the one that starts earliest
            return text[:end - len(stop)], stop
    return text, None


@pytest.mark.parametrize("stops, error", [
    ([f"s{i}" for i in range(65)], "at most 64"),
    (["ok", ""], "stop string 1 is empty"),
    (["ok", 3], "stop string 1 must be a string"),
    ("END", "not a single string"),
])
def test_bad_stops_are_rejected_with_the_reason(stops, error):
    with pytest.raises((ValueError, TypeError), match=error):
        validate_stops(stops)


def test_no_stops_pass_text_through():
    matcher = StopMatcher(None)
    assert matcher.feed("abc") == ("abc", None)
    assert matcher.flush() == ""


def test_text_before_a_possible_stop_is_released_at_once():
    matcher = StopMatcher(["\nUser:"])
    assert matcher.feed("Hello\nUs") == ("Hello", None)
    assert matcher.feed("e") == ("", None)
    assert matcher.feed("d it") == ("\nUsed it", None)
    assert matcher.feed("!\nUser: hi") == ("!", "\nUser:")


def test_stop_split_across_many_feeds():
    assert _run(["STOP"], ["xS", "T", "O", "Py"]) == ("x", "STOP")


def test_first_completed_stop_wins():
    assert _run(["abcd", "bc"], ["abcd"]) == ("a", "bc")
    assert _run(["bc", "abc"], ["xabc"]) == ("x", "abc")


def test_flush_releases_held_prefix():
    assert _run(["END"], ["the EN"]) == ("the EN", None)


TEXT = st.lists(st.sampled_from(["a", "b", "ab", "ba", "x", "é", "\n"]), max_size=20).map("".join)
STOPS = st.lists(st.lists(st.sampled_from(["a", "b", "é", "\n"]), min_size=1, max_size=4).map("".join),
                 min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(STOPS, TEXT, st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_any_split_gives_the_reference_result(stops, text, cuts):
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _run(stops, chunks) == _reference(stops, text)


@settings(max_examples=300, deadline=None)
@given(TEXT, STOPS)
def test_hold_back_is_the_longest_suffix_that_starts_a_stop(text, stops):
    expected = max([k for k in range(1, len(text) + 1) for s in stops
                    if k < len(s) and s.startswith(text[-k:])], default=0)
    assert partial_marker_suffix(text, stops) == expected
