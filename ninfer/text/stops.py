"""Stop strings over a streamed text channel.

The matcher releases text as soon as it cannot be part of a stop: it holds back only the longest
suffix that is a proper prefix of some stop. The first stop to complete in the stream wins (among
stops completing at the same character, the one starting earliest), so the result does not depend
on how the text was split into pieces. On a match only the text before the stop is released.
"""

from __future__ import annotations

from collections.abc import Sequence

from ninfer.text.holdback import partial_marker_suffix

# The most stop strings one request may carry: Chat's `stop` takes four (the spec), Anthropic's
# stop_sequences more; the bound keeps the per-piece scan over them small.
MAX_STOPS = 64


def validate_stops(stops: Sequence[str] | None) -> tuple[str, ...]:
    """The request's stop strings as a tuple; at most MAX_STOPS non-empty strings."""
    if stops is None:
        return ()
    if isinstance(stops, str):
        raise TypeError("stops must be a sequence of strings, not a single string")
    stops = tuple(stops)
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings are supported, got {len(stops)}")
    for i, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise TypeError(f"stop string {i} must be a string, got {type(stop).__name__}")
        if not stop:
            raise ValueError(f"stop string {i} is empty; stop strings must be non-empty")
    return stops


class StopMatcher:
    """Streaming matcher for one channel; ``feed(text) -> (released_text, matched_stop | None)``."""

    def __init__(self, stops: Sequence[str] | None) -> None:
        self.stops = validate_stops(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        buf = self._held + text
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self._held = ""
            return buf[:start], stop
        keep = partial_marker_suffix(buf, self.stops)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """End of the channel: held text cannot become a stop any more."""
        out, self._held = self._held, ""
        return out

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            start = buf.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else (best[1], best[2])
