"""The pretty stderr log: ``YYYY-MM-DD HH:MM:SS.mmm LEVEL message`` records.

Records never carry prompts, generated text, request bodies or credentials; callers log counts,
ids and classifications only. The format has no terminal control sequences, so redirected stderr
stays plain text.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import TextIO

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

LEVELS = {
    "trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
    "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL + 10,
}


# C0 controls but tab and newline, DEL and C1 controls: ESC and CSI (U+009B) start terminal control
# sequences, CR and backspace redraw the line. A message may carry text a client chose (a request
# path), so the format itself guarantees that none of them reaches stderr raw.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escape(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class PrettyFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", t) + f".{int(record.msecs):03d}"
        # A record is one line: a newline inside the message cannot start a line that looks like a record.
        message = _escape(record.getMessage()).replace("\n", "\\n")
        text = f"{stamp} {record.levelname} {message}"
        if record.exc_info:
            text += "\n" + _escape(self.formatException(record.exc_info))
        return text


def setup(level: str = "info", stream: TextIO | None = None) -> logging.Handler:
    """Route the ``ninfer`` and ``hypercorn`` loggers to ``stream`` (stderr) in the pretty format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(PrettyFormatter())
    for name in ("ninfer", "hypercorn.error"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            if isinstance(old.formatter, PrettyFormatter):
                logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(LEVELS[level])
        logger.propagate = False
    return handler
