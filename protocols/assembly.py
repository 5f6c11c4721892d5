"""Decoder events → growing output units and the wire events each change makes: the shared machine.

Anthropic content blocks and Responses output Items grow the same way. Reasoning or content text
opens a unit of its kind (closing the one before) unless that kind is already open; a tool call
opens its own unit and streams its argument JSON; the call's end sends whatever the argument deltas
had not carried yet, so concatenated deltas always equal the final unit. The open unit's text is
kept as pieces and joined when it closes: appending to one growing string would copy the whole
output on every token. A family subclass says what its units and wire events look like.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ninfer.text.events import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart


class Assembler(ABC):
    REASONING: str  # the unit "type" of reasoning text
    CONTENT: str  # the unit "type" of answer text

    def __init__(self) -> None:
        self.units: list[dict] = []
        self._open: dict | None = None  # the unit receiving deltas: always the latest
        self._buf: list[str] = []  # the open unit's text (or argument JSON) so far
        self._calls: dict[int, int] = {}  # decoder call index -> unit index

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, ev: Any) -> list[dict]:
        """The wire events (in order) that one decoder event produces."""
        if isinstance(ev, ReasoningDelta):
            return self._text(self.REASONING, ev.text) if ev.text else []
        if isinstance(ev, ContentDelta):
            return self._text(self.CONTENT, ev.text) if ev.text else []
        if isinstance(ev, ToolCallStart):
            events = self._close()
            self._calls[ev.index] = len(self.units)
            return events + self._start(self._call_unit(ev.name))
        if isinstance(ev, ToolCallArgumentsDelta):
            return self._append(self._calls[ev.index], ev.text) if ev.text else []
        if isinstance(ev, ToolCallEnd):
            return self._end_call(self._calls[ev.index], ev.arguments)
        return []

    def _text(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            events = self._close() + self._start(self._text_unit(kind))
        return events + self._append(len(self.units) - 1, text)

    def _start(self, unit: dict) -> list[dict]:
        self.units.append(unit)
        self._open, self._buf = unit, []
        return self._started(len(self.units) - 1, unit)

    def _append(self, idx: int, text: str) -> list[dict]:
        assert self._open is self.units[idx], "deltas for a unit that is not open"
        self._buf.append(text)
        return [self._delta(idx, self._open, text)]

    def _end_call(self, idx: int, arguments: str) -> list[dict]:
        # The decoder guarantees deltas concatenate to the final text; send any remainder so the
        # stream still adds up even if they did not.
        seen = self._joined()
        assert arguments.startswith(seen), "tool-call deltas diverged from the final arguments"
        rest = arguments[len(seen):]
        return (self._append(idx, rest) if rest else []) + self._close()

    def _joined(self) -> str:
        """The open unit's text so far (its pieces joined once, then kept joined)."""
        text = "".join(self._buf)
        self._buf = [text]
        return text

    def _close(self, status: str = "completed") -> list[dict]:
        unit = self._open
        if unit is None:
            return []
        text = "".join(self._buf)
        self._open, self._buf = None, []
        return self._sealed(len(self.units) - 1, unit, text, status)

    # -- what a family defines -------------------------------------------------------------------

    @abstractmethod
    def _text_unit(self, kind: str) -> dict:
        """A new empty unit of text kind ``kind``."""

    @abstractmethod
    def _call_unit(self, name: str) -> dict:
        """A new tool-call unit for the decoder's tool ``name``."""

    @abstractmethod
    def _started(self, idx: int, unit: dict) -> list[dict]:
        """The events that open ``unit`` at index ``idx``."""

    @abstractmethod
    def _delta(self, idx: int, unit: dict, text: str) -> dict:
        """The event carrying one piece of the open unit's text or argument JSON."""

    @abstractmethod
    def _sealed(self, idx: int, unit: dict, text: str, status: str) -> list[dict]:
        """Store the unit's final ``text`` and return the events that close it."""
