"""Splits generated text into the reasoning channel and the answer (content) channel.

Qwen-style models reason between ``<think>`` and ``</think>``. A request either starts inside the
reasoning block (the prompt already ends with ``<think>\\n``) or in content, where the model may
open one reasoning block as the very first thing it writes. After ``</think>`` everything is
content: markers there are ordinary text, as they are after any content has been written.

The markers themselves are never emitted. Newlines right after a marker are dropped, matching how
the chat template re-renders history (``<think>\\n`` + reasoning + ``\\n</think>\\n\\n`` + content),
so the reasoning and content a client sends back render to the same prompt. Text is held back only
while its tail could still be the start of a marker.
"""

from __future__ import annotations

import enum

from ninfer.text.holdback import partial_marker_suffix

OPEN_MARKER = "<think>"
CLOSE_MARKER = "</think>"


class Channel(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningSplitter:
    """Streaming splitter; ``feed(text)`` returns ``[(Channel, text), ...]`` in stream order."""

    def __init__(self, starts_in_thinking: bool) -> None:
        self.channel = Channel.REASONING if starts_in_thinking else Channel.CONTENT
        # Content may still open a reasoning block only before it has produced any text.
        self._may_open = not starts_in_thinking
        self._strip_newlines = starts_in_thinking
        self._held = ""
        self.touched_reasoning = False  # whether the last feed saw the reasoning channel

    @property
    def in_reasoning(self) -> bool:
        return self.channel is Channel.REASONING

    def feed(self, text: str) -> list[tuple[Channel, str]]:
        self.touched_reasoning = self.in_reasoning
        out: list[tuple[Channel, str]] = []
        buf = self._held + text
        self._held = ""
        while buf:
            buf = self._step(buf, out)
        return out

    def flush(self) -> list[tuple[Channel, str]]:
        """End of output: a held partial marker is ordinary text of the current channel."""
        out: list[tuple[Channel, str]] = []
        self._emit(self._held, out)
        self._held = ""
        return out

    def _step(self, buf: str, out: list[tuple[Channel, str]]) -> str:
        """Consume a prefix of ``buf``; return the rest (empty once everything is emitted or held)."""
        if self.in_reasoning:
            at = buf.find(CLOSE_MARKER)
            if at < 0:
                keep = partial_marker_suffix(buf, (CLOSE_MARKER,))
                self._emit(buf[:len(buf) - keep], out)
                self._held = buf[len(buf) - keep:]
                return ""
            self._emit(buf[:at], out)
            self._switch(Channel.CONTENT)
            return buf[at + len(CLOSE_MARKER):]
        if self._may_open:
            if buf.startswith(OPEN_MARKER):
                self._may_open = False
                self._switch(Channel.REASONING)
                return buf[len(OPEN_MARKER):]
            if OPEN_MARKER.startswith(buf):
                self._held = buf
                return ""
            self._may_open = False
        self._emit(buf, out)
        return ""

    def _switch(self, channel: Channel) -> None:
        self.channel = channel
        self._strip_newlines = True
        if channel is Channel.REASONING:
            self.touched_reasoning = True

    def _emit(self, text: str, out: list[tuple[Channel, str]]) -> None:
        if self._strip_newlines:
            text = text.lstrip("\n")
            if not text:
                return
            self._strip_newlines = False
        if not text:
            return
        if self.channel is Channel.CONTENT:
            self._may_open = False
        if out and out[-1][0] is self.channel:
            out[-1] = (self.channel, out[-1][1] + text)
        else:
            out.append((self.channel, text))
