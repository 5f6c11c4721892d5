"""From committed token ids to protocol-neutral output events.

``OutputDecoder`` runs on the request's own task and chains the output-side pieces of
``ninfer.text``, one token at a time::

    ids ─► IncrementalDetokenizer ─► ReasoningSplitter ─┬─ reasoning ─► StopMatcher ─► ReasoningDelta
                                                         └─ content ───► StopMatcher ─► ToolCallParser ─► ContentDelta
                                                                                                          ToolCall*
Stop strings apply to the visible text of each channel (markers excluded); a stop cannot span the
end of reasoning. Tool calls are parsed only in content. Each token's text goes through the
splitter on its own, so the reasoning-token count is exact: a token counts as reasoning when any of
its text lies in the reasoning channel, the token that holds ``</think>`` included.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs

from ninfer.text.detokenizer import IncrementalDetokenizer
from ninfer.text.events import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    StopMatched,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from ninfer.text.reasoning import Channel, ReasoningSplitter
from ninfer.text.stops import StopMatcher
from ninfer.text.tool_parser import ToolCallParser

__all__ = [
    "OutputDecoder", "OutputStats", "ReasoningDelta", "ContentDelta", "ToolCallStart",
    "ToolCallArgumentsDelta", "ToolCallEnd", "StopMatched", "OutputEvent",
]


class _Decoder(Protocol):
    """``ninfer.text.Tokenizer``: only its decode is used."""

    def decode(self, ids: list[int], skip_special: bool = False) -> str: ...


@attrs.frozen
class OutputStats:
    reasoning_tokens: int  # accepted tokens whose text lay (partly) in the reasoning channel
    completion_tokens: int  # every token id pushed, hidden or not
    tool_call_parse: dict[str, Any]  # the request log's tool_call_parse record


class OutputDecoder:
    """Streams one request's output; ``push(ids)`` and ``finish()`` return lists of events."""

    def __init__(self, tokenizer: _Decoder, *, starts_in_thinking: bool = False,
                 tools: Iterable[Any] | None = None, stops: Sequence[str] | None = None,
                 tool_parsing: bool = True) -> None:
        # Special ids (end of turn, a stray <|im_start|>) are not output text; the reasoning and
        # tool-call markers are ordinary added tokens and decode to their spellings.
        self._detok = IncrementalDetokenizer(lambda ids: tokenizer.decode(ids, skip_special=True))
        self._splitter = ReasoningSplitter(starts_in_thinking)
        self._stops = {Channel.REASONING: StopMatcher(stops), Channel.CONTENT: StopMatcher(stops)}
        self._tools = ToolCallParser(tools if tool_parsing else None)
        self._reasoning_tokens = 0
        self._completion_tokens = 0
        self._finished = False
        self.stopped: str | None = None  # the matched stop string, once one matched
        self.stop_tokens: int | None = None  # tokens pushed up to the one that completed the match

    @property
    def stats(self) -> OutputStats:
        return OutputStats(self._reasoning_tokens, self._completion_tokens, self._tools.diagnostics)

    def push(self, token_ids: Iterable[int]) -> list[OutputEvent]:
        """Accept committed tokens; return the events that became visible."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        out: list[OutputEvent] = []
        for token_id in token_ids:
            if self.stopped is not None:
                # Tokens committed before the Engine saw the stop are not output (nor counted): the
                # request's output ends with the token that completed the match (``stop_tokens``).
                break
            self._completion_tokens += 1
            pieces = self._splitter.feed(self._detok.push((token_id,)))
            self._reasoning_tokens += self._splitter.touched_reasoning
            self._route(pieces, out)
        return out

    def finish(self) -> list[OutputEvent]:
        """End of output: release everything held and complete pending tool calls."""
        if self._finished:
            return []
        self._finished = True
        out: list[OutputEvent] = []
        if self.stopped is None:
            pieces = self._splitter.feed(self._detok.flush()) + self._splitter.flush()
            self._route(pieces, out)
        if self.stopped is None:
            for channel in (Channel.REASONING, Channel.CONTENT):
                self._emit(channel, self._stops[channel].flush(), out)
            self._close_content(out)
        return out

    def _route(self, pieces: list[tuple[Channel, str]], out: list[OutputEvent]) -> None:
        for channel, text in pieces:
            if channel is Channel.CONTENT:
                # Reasoning is over: its held stop prefix can no longer match.
                self._emit(Channel.REASONING, self._stops[Channel.REASONING].flush(), out)
            released, stop = self._stops[channel].feed(text)
            self._emit(channel, released, out)
            if stop is not None:
                self.stopped = stop
                self.stop_tokens = self._completion_tokens
                self._close_content(out)
                out.append(StopMatched(stop))
                return
        if not self._splitter.in_reasoning:
            self._emit(Channel.REASONING, self._stops[Channel.REASONING].flush(), out)

    def _emit(self, channel: Channel, text: str, out: list[OutputEvent]) -> None:
        if not text:
            return
        if channel is Channel.REASONING:
            _append(out, [ReasoningDelta(text)])
        else:
            _append(out, self._tools.feed(text))

    def _close_content(self, out: list[OutputEvent]) -> None:
        _append(out, self._tools.finish())


def _append(out: list[OutputEvent], events: list[Any]) -> None:
    """Append events, merging a text delta into a preceding delta of the same channel."""
    for event in events:
        if out and isinstance(event, (ReasoningDelta, ContentDelta)) and type(out[-1]) is type(event):
            out[-1] = type(event)(out[-1].text + event.text)
        else:
            out.append(event)
