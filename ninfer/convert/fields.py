"""Typed reads of the fields of a source file (a ``config.json`` object, GGUF metadata).

A bare ``int(cfg["num_attention_heads"])`` turns a malformed file into a TypeError, a
ZeroDivisionError or "invalid literal for int()" that names neither the file nor the field. Every
read here checks the type and range first and raises the converter's error with one line naming
both: ``config.json: text_config.hidden_size must be a positive integer, got null``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ninfer.convert.errors import ConversionError

REQUIRED: Any = ...  # the default of a field the file must give


def json_kind(value: Any) -> str:
    """The JSON (or GGUF) type of ``value``, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, (list, tuple)) else "an object"


def show(value: Any, limit: int = 60) -> str:
    """``value`` for a one-line message: null and booleans spelled as in JSON, long values cut."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def whole(value: Any) -> int | None:
    """``value`` as an int when it is a whole number (4096 or 4096.0); None for anything else,
    booleans and numeric strings included."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _integer_words(minimum: int) -> str:
    return {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")


class Fields:
    """One object of a source file: ``where`` names the file, ``prefix`` the path to the object
    inside it (``"text_config."``), ``error`` the exception to raise.

    A field that is absent or null takes ``default``; a field without a default must be present.
    """

    def __init__(self, data: Any, where: str, prefix: str = "",
                 error: type[ConversionError] = ConversionError) -> None:
        if not isinstance(data, Mapping):
            label = f"{prefix[:-1]} " if prefix else ""
            raise error(f"{where}: {label}must be an object, got {json_kind(data)}")
        self.data, self.where, self.prefix, self.error = data, where, prefix, error

    def fail(self, key: str, problem: str) -> ConversionError:
        return self.error(f"{self.where}: {self.prefix}{key} {problem}")

    def _value(self, key: str, default: Any) -> tuple[Any, bool]:
        """(value, whether it came from the file and needs checking)."""
        value = self.data.get(key)
        if value is not None:
            return value, True
        if default is not REQUIRED:
            return default, False
        if key not in self.data:
            raise self.error(f"{self.where}: lacks {self.prefix + key!r}")
        return None, True  # null where a value is needed: the caller's check refuses it

    def _wrong(self, key: str, wanted: str, value: Any) -> ConversionError:
        return self.fail(key, f"must be {wanted}, got {show(value)}")

    def integer(self, key: str, default: Any = REQUIRED, *, minimum: int = 1) -> Any:
        value, given = self._value(key, default)
        if not given:
            return value
        number = whole(value)
        if number is None or number < minimum:
            raise self._wrong(key, _integer_words(minimum), value)
        return number

    def number(self, key: str, default: Any = REQUIRED, *, positive: bool = False) -> Any:
        """A finite number as a float; > 0 when ``positive``."""
        value, given = self._value(key, default)
        if not given:
            return value
        low = 0 if positive else -math.inf
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < math.inf:
            raise self._wrong(key, "a positive number" if positive else "a finite number", value)
        return float(value)

    def positive(self, key: str, default: Any = REQUIRED) -> Any:
        """A finite number > 0 as a float (epsilons, RoPE bases and factors)."""
        return self.number(key, default, positive=True)

    def string(self, key: str, default: Any = REQUIRED) -> Any:
        value, given = self._value(key, default)
        if given and not isinstance(value, str):
            raise self._wrong(key, "a string", value)
        return value

    def boolean(self, key: str, default: Any = REQUIRED) -> Any:
        value, given = self._value(key, default)
        if given and not isinstance(value, bool):
            raise self._wrong(key, "true or false", value)
        return value

    def strings(self, key: str, default: Any = REQUIRED) -> Any:
        value, given = self._value(key, default)
        if given and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise self._wrong(key, "an array of strings", value)
        return value

    def integers(self, key: str, default: Any = REQUIRED) -> Any:
        value, given = self._value(key, default)
        if not given:
            return value
        numbers = [whole(v) for v in value] if isinstance(value, list) else [None]
        if any(n is None or n < 0 for n in numbers):
            raise self._wrong(key, "an array of non-negative integers", value)
        return numbers

    def section(self, key: str) -> Fields:
        """The nested object ``key`` (empty when absent or null)."""
        value = self.data.get(key)
        return Fields({} if value is None else value, self.where, f"{self.prefix}{key}.", self.error)
