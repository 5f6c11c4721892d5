"""The pretty stderr log: ``YYYY-MM-DD HH:MM:SS.mmm LEVEL message`` records.

Records never carry prompts, generated text, request bodies or credentials; callers log counts,
ids and classifications only. The format has no terminal control sequences, so redirected stderr
stays plain text.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

TRACE = 5
logging.addLevelName(TRACE, "TRACE")

LEVELS = {
    "trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
    "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL + 10,
}


class PrettyFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", t) + f".{int(record.msecs):03d}"
        text = f"{stamp} {record.levelname} {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
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
