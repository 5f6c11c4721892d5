"""Incremental, UTF-8-safe detokenization of committed token ids.

Decoding one token at a time is wrong in two ways: a byte-level token can hold part of a multi-byte
character (the tokenizer then decodes it to U+FFFD), and some decoders change a token's spelling by
its neighbours (SentencePiece strips the leading space of a whole decode). So we decode a short
window of recent ids and emit only the part of the window's text that is new and stable:

* text appended to a window never changes the text already decoded from it, except a trailing run
  of U+FFFD that a later byte may turn into a real character; that run is held back;
* the window keeps a few already-emitted ids as left context, so the decoder sees each new id in
  the same surroundings as a full decode would, and is cut back to that context once it grows, so
  each push costs O(window) rather than O(output).

A model that emits genuinely invalid UTF-8 gets U+FFFD in the text once a later character shows the
bytes cannot complete, or at ``flush()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"

# Ids of already-emitted text kept as left context when the window is cut back. A partial UTF-8
# character has at most three bytes, so four ids always reach past its start.
CONTEXT_IDS = 4
# How many ids one character may span: the cut search looks this far left of CONTEXT_IDS.
MAX_CHAR_IDS = 4
# The window is cut back to CONTEXT_IDS once it holds this many ids and its text ends cleanly.
TRIM_AT = 16
# A window whose text has ended in U+FFFD for this many ids is a stream of invalid bytes, not a
# character in progress: its text is emitted as decoded and the window restarts empty.
MAX_DIRTY_WINDOW = 64


def _held_suffix(text: str) -> int:
    """Length of the trailing U+FFFD run that later bytes could still turn into a character."""
    return len(text) - len(text.rstrip(REPLACEMENT))


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas; ``decode_fn(ids) -> str`` is the tokenizer's decode."""

    def __init__(self, decode_fn: Callable[[list[int]], str]) -> None:
        self._decode = decode_fn
        self._window: list[int] = []
        self._emitted = 0  # characters of decode(self._window) already returned

    def push(self, ids: Iterable[int]) -> str:
        """Add committed ids; return the text that became stable (possibly empty)."""
        self._window.extend(ids)
        text = self._decode(self._window)
        held = _held_suffix(text)
        if held and len(self._window) >= MAX_DIRTY_WINDOW:
            return self._restart(text)
        stable = len(text) - held
        out = text[self._emitted:stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if not held and len(self._window) >= TRIM_AT:
            self._trim(text)
        return out

    def _trim(self, text: str) -> None:
        """Cut the window back to a few ids of left context that decode to a suffix of ``text``.

        A cut inside a multi-byte character would make the context decode differently (a byte
        fallback decoder turns a whole run of byte tokens into U+FFFD once the run is invalid), so
        try cut points further left until the context reads as the tail of what was emitted; keep
        the window whole when none does.
        """
        last = len(self._window) - CONTEXT_IDS
        for cut in range(last, max(last - MAX_CHAR_IDS, 0) - 1, -1):
            context = self._decode(self._window[cut:])
            if text.endswith(context):
                self._window = self._window[cut:]
                self._emitted = len(context)
                return

    def flush(self) -> str:
        """End of output: return whatever is still held (an incomplete character decodes as U+FFFD)."""
        text = self._decode(self._window) if self._window else ""
        return self._restart(text)

    def _restart(self, text: str) -> str:
        out = text[self._emitted:]
        self._window = []
        self._emitted = 0
        return out
