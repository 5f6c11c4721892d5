"""The exception converters raise for bad or unsupported sources."""

from __future__ import annotations


class ConversionError(Exception):
    """The source cannot be converted; the message names the file or field and the reason."""
