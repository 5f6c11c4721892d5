"""Typed field readers shared by the protocol parsers: each failure names the field."""

from __future__ import annotations

import math
import re
from typing import Any

from protocols.errors import invalid_type, invalid_value

_INT64 = 2**63
# A JSON escape of a UTF-16 surrogate. A pair decodes into one character; an unpaired one decodes into
# a str that no tokenizer or encoder accepts, so only JSON text holding such an escape needs a walk.
_SURROGATE_ESCAPE = r"\\u[dD][89a-fA-F]"
_ESCAPE_IN = {str: re.compile(_SURROGATE_ESCAPE), bytes: re.compile(_SURROGATE_ESCAPE.encode())}


def loads_unpaired_surrogate(text: str | bytes, value: Any) -> bool:
    """Whether ``value``, decoded from the JSON ``text`` (a request body as bytes, or a string field
    holding JSON), holds a string with an unpaired surrogate."""
    return bool(_ESCAPE_IN[type(text)].search(text)) and _has_unpaired_surrogate(value)


def _has_unpaired_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_unpaired_surrogate(k) or _has_unpaired_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_unpaired_surrogate(v) for v in value)
    return False


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    # JSON integers are unbounded and always finite; math.isfinite would overflow converting a huge one.
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))


def opt_bool(body: dict, key: str, param: str | None = None) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise invalid_type(param or key, "a boolean")
    return v


def opt_str(body: dict, key: str, param: str | None = None) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise invalid_type(param or key, "a string")
    return v


def opt_object(body: dict, key: str, param: str | None = None) -> dict | None:
    v = body.get(key)
    if v is not None and not isinstance(v, dict):
        raise invalid_type(param or key, "an object")
    return v


def opt_number(body: dict, key: str, lo: float, hi: float, param: str | None = None) -> float | None:
    v = body.get(key)
    name = param or key
    if v is None:
        return None
    if not is_number(v):
        raise invalid_type(name, "a finite number")
    if not lo <= v <= hi:
        raise invalid_value(name, f"{v} is outside [{lo}, {hi}].")
    return float(v)


def opt_int(body: dict, key: str, lo: int | None = None, hi: int | None = None, param: str | None = None) -> int | None:
    v = body.get(key)
    name = param or key
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # JSON clients sometimes send 1.0 for an integer
    if not is_int(v):
        raise invalid_type(name, "an integer")
    if lo is not None and v < lo:
        raise invalid_value(name, f"{v} is below the minimum {lo}.")
    if hi is not None and v > hi:
        raise invalid_value(name, f"{v} is above the maximum {hi}.")
    return v


def opt_seed(body: dict, key: str = "seed") -> int | None:
    """A signed 64-bit integer seed."""
    return opt_int(body, key, -_INT64, _INT64 - 1)


def stop_strings(body: dict, key: str = "stop", limit: int = 4) -> tuple[str, ...]:
    v = body.get(key)
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise invalid_type(key, "a string or an array of strings")
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise invalid_type(f"{key}[{i}]", "a string")
    if len(items) > limit:
        raise invalid_value(key, f"at most {limit} stop strings are supported, got {len(items)}.")
    if any(s == "" for s in items):
        raise invalid_value(key, "stop strings must be non-empty.")
    return tuple(items)
