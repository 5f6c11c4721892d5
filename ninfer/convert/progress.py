"""Conversion progress on stderr: a redrawn bar on a terminal, plain lines anywhere else.

Logs and CI capture stderr, where carriage-return redraws become one unreadable line, so off a TTY
we print a line at every tenth of the work instead. The closing line reports throughput.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Pass as ``progress=`` to write_artifact / converters; call ``finish()`` at the end."""

    def __init__(self, label: str, stream: TextIO | None = None, clock=time.monotonic):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._clock = clock
        self._start = clock()
        self._done = 0
        self._next_tenth = 1

    def __call__(self, done: int, total: int, name: str) -> None:
        self._done = done
        fraction = done / total if total else 1.0
        if self.tty:
            width = 30
            bar = "#" * int(fraction * width)
            self.stream.write(f"\r{self.label} [{bar:<{width}}] {fraction:6.1%} {done / 1e6:9.1f} MB  {name[:40]:<40}")
            self.stream.flush()
        elif fraction * 10 >= self._next_tenth:
            self._next_tenth = int(fraction * 10) + 1
            self.stream.write(f"{self.label}: {fraction:.0%} ({done / 1e6:.1f} of {total / 1e6:.1f} MB)\n")
            self.stream.flush()

    def finish(self) -> float:
        """Print the summary line and return the throughput in MB/s (10^6 bytes per second)."""
        elapsed = max(self._clock() - self._start, 1e-9)
        rate = self._done / 1e6 / elapsed
        prefix = "\n" if self.tty else ""
        self.stream.write(f"{prefix}{self.label}: wrote {self._done / 1e6:.1f} MB in {elapsed:.2f} s "
                          f"({rate:.1f} MB/s)\n")
        self.stream.flush()
        return rate
