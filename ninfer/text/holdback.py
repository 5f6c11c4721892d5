"""The one hold-back rule shared by the streaming text scanners."""

from __future__ import annotations

from collections.abc import Iterable


def partial_marker_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``.

    A streaming scanner must hold exactly that suffix back: the next text may complete a marker,
    while everything before it can be released now.
    """
    best = 0
    for marker in markers:
        # Candidate suffixes start at an occurrence of the marker's first character; scanning
        # from the left finds the longest one first.
        at = text.find(marker[0], max(0, len(text) - len(marker) + 1))
        while at >= 0 and len(text) - at > best:
            if marker.startswith(text[at:]):
                best = len(text) - at
                break
            at = text.find(marker[0], at + 1)
    return best
