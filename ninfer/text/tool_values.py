"""Schema-typed conversion of Qwen tool-call parameter text to JSON values.

Qwen's XML tool-call format carries every parameter as untyped text. The declared tool schema
guides the conversion, without deciding whether the markup is a call (serving spec, Chat
Completions):

* a direct ``type`` (a name or a list of names) or an ``anyOf``/``oneOf`` whose members all carry
  an explicit ``type`` gives the admitted types; anything else means untyped inference;
* string-admitting parameters keep the text as a string, the empty string included;
* an empty (whitespace-only) block for a non-string parameter is omitted;
* text that parses as JSON keeps its JSON type; case-insensitive true/false becomes a boolean when
  boolean is admitted;
* a non-empty mismatch stays in the call so the tool consumer can report it: valid JSON keeps its
  type, other text becomes a JSON string;
* untyped inference: valid JSON keeps its type, other text (the empty block included) is a string.

No defaults, required-property checks or recursive validation happen here.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})


class Outcome(enum.Enum):
    KEPT = "kept"  # the value is admitted by the schema (or the schema is untyped)
    OMITTED = "omitted"  # empty block for a declared non-string parameter
    MISMATCH = "mismatch"  # non-empty value the schema does not admit, preserved for the consumer


def admitted_types(schema: Any) -> frozenset[str] | None:
    """The JSON types a parameter schema admits, or None when it gives no supported explicit type."""
    if not isinstance(schema, Mapping):
        return None
    if "type" in schema:
        return _type_names(schema["type"])
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list) and members:
            names: set[str] = set()
            for member in members:
                member_types = _type_names(member.get("type")) if isinstance(member, Mapping) else None
                if member_types is None:
                    return None
                names |= member_types
            return frozenset(names)
    return None


def _type_names(value: Any) -> frozenset[str] | None:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names:
        return None
    if not all(isinstance(n, str) and n in JSON_TYPES for n in names):
        return None
    return frozenset(names)


def convert_parameter(text: str, types: frozenset[str] | None) -> tuple[Outcome, Any]:
    """Convert one parameter's text; returns the outcome and the JSON value (None when omitted)."""
    if types is None:
        ok, value = _parse_json(text)
        return Outcome.KEPT, value if ok else text
    if "string" in types:
        return Outcome.KEPT, text
    if not text.strip():
        return Outcome.OMITTED, None
    ok, value = _parse_json(text)
    if ok:
        return (Outcome.KEPT if _json_type_admitted(value, types) else Outcome.MISMATCH), value
    if "boolean" in types and text.strip().lower() in ("true", "false"):
        return Outcome.KEPT, text.strip().lower() == "true"
    return Outcome.MISMATCH, text


def _parse_json(text: str) -> tuple[bool, Any]:
    """Strict JSON (no NaN/Infinity, no overflowing numbers); (False, None) when it is not JSON.

    JSON nested deeper than Python's recursion limit cannot be built or written back either: it is
    text too, so the call stays structured instead of failing the request.
    """
    try:
        value = json.loads(text, parse_constant=_reject_constant)
        json.dumps(value, allow_nan=False)  # 1e999 parses to inf, which is not representable
    except (ValueError, RecursionError):
        return False, None
    return True, value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_type_admitted(value: Any, types: frozenset[str]) -> bool:
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return "integer" in types or "number" in types
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    if value is None:
        return "null" in types
    if isinstance(value, dict):
        return "object" in types
    if isinstance(value, list):
        return "array" in types
    return "string" in types  # a JSON string literal
