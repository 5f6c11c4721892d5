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
        # Only suffixes longer than the best so far can improve it.
        for length in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-length:]):
                best = length
                break
    return best
