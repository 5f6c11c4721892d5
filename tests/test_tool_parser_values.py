"""Schema-typed conversion of tool-call parameter text, alone and through the parser."""

from __future__ import annotations

import json

import pytest

from ninfer.text.events import ToolCallEnd
from ninfer.text.tool_parser import ToolCallParser
from ninfer.text.tool_values import Outcome, admitted_types, convert_parameter

KEPT, OMITTED, MISMATCH = Outcome.KEPT, Outcome.OMITTED, Outcome.MISMATCH


@pytest.mark.parametrize("schema, types", [
    ({"type": "string"}, {"string"}),
    ({"type": ["integer", "null"]}, {"integer", "null"}),
    ({"anyOf": [{"type": "number"}, {"type": "boolean"}]}, {"number", "boolean"}),
    ({"oneOf": [{"type": "array"}, {"type": ["object", "null"]}]}, {"array", "object", "null"}),
    ({"anyOf": [{"type": "number"}, {"enum": ["a"]}]}, None),  # a member without explicit type
    ({"type": "date"}, None),
    ({"type": []}, None),
    ({"enum": ["a", "b"]}, None),
    ({"$ref": "#/defs/x"}, None),
    ("string", None),
    (None, None),
])
def test_admitted_types(schema, types):
    assert admitted_types(schema) == (None if types is None else frozenset(types))


@pytest.mark.parametrize("text, types, outcome, value", [
    # string-admitting parameters keep the text, the empty string included
    ("42", {"string"}, KEPT, "42"),
    ("", {"string"}, KEPT, ""),
    ("null", {"string", "null"}, KEPT, "null"),
    # JSON values keep their type when admitted
    ("42", {"integer"}, KEPT, 42),
    ("4.5", {"number"}, KEPT, 4.5),
    ("7", {"number"}, KEPT, 7),
    ("2.0", {"integer"}, KEPT, 2.0),
    ('{"b": 1, "a": [true]}', {"object"}, KEPT, {"b": 1, "a": [True]}),
    (" [1, 2] ", {"array"}, KEPT, [1, 2]),
    ("null", {"integer", "null"}, KEPT, None),
    # case-insensitive booleans
    ("True", {"boolean"}, KEPT, True),
    (" FALSE ", {"boolean"}, KEPT, False),
    ("false", {"boolean", "integer"}, KEPT, False),
    # empty block for a non-string parameter is omitted
    ("", {"integer"}, OMITTED, None),
    ("  \n ", {"boolean"}, OMITTED, None),
    # non-empty mismatch: valid JSON keeps its type, other text becomes a string
    ("3.5", {"integer"}, MISMATCH, 3.5),
    ('"5"', {"integer"}, MISMATCH, "5"),
    ("[1]", {"object"}, MISMATCH, [1]),
    ("True", {"integer"}, MISMATCH, "True"),
    ("five", {"integer"}, MISMATCH, "five"),
    ("NaN", {"number"}, MISMATCH, "NaN"),
    ("1e999", {"number"}, MISMATCH, "1e999"),
    # no supported type: untyped inference
    ("42", None, KEPT, 42),
    ('{"x": null}', None, KEPT, {"x": None}),
    ("hello world", None, KEPT, "hello world"),
    ("True", None, KEPT, "True"),
    ("", None, KEPT, ""),
])
def test_convert_parameter(text, types, outcome, value):
    got_outcome, got_value = convert_parameter(text, None if types is None else frozenset(types))
    assert (got_outcome, got_value) == (outcome, value)
    assert type(got_value) is type(value)


SCHEMA_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "integer"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "u": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
}}}}


def _arguments(params: list[tuple[str, str]]) -> tuple[str, dict]:
    body = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in params)
    parser = ToolCallParser([SCHEMA_TOOL])
    events = parser.feed(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>") + parser.finish()
    end = [e for e in events if isinstance(e, ToolCallEnd)]
    assert len(end) == 1
    return end[0].arguments, parser.diagnostics


def test_parser_applies_the_schema_and_counts_omitted_and_mismatched_arguments():
    arguments, diag = _arguments([("s", ""), ("n", ""), ("b", "yes"), ("o", '{"k": [1, "é"]}'),
                                  ("u", "null"), ("extra", "12")])
    assert arguments == '{"s": "", "b": "yes", "o": {"k": [1, "é"]}, "u": null, "extra": 12}'
    assert list(json.loads(arguments)) == ["s", "b", "o", "u", "extra"]
    assert diag["empty_non_string_omitted"] == 1
    assert diag["schema_mismatch_preserved"] == 1
    assert diag["structured_calls"] == 1 and diag["fallback_reason"] == "none"


def test_all_parameters_omitted_gives_an_empty_object():
    arguments, diag = _arguments([("n", ""), ("b", "\n")])
    assert arguments == "{}" and diag["empty_non_string_omitted"] == 2


DEEP = "[" * 5000 + "]" * 5000  # valid JSON nested past what Python's json module can build or write


@pytest.mark.parametrize("types, outcome", [(None, KEPT), ({"array"}, MISMATCH), ({"object"}, MISMATCH)])
def test_json_too_deep_to_represent_stays_text(types, outcome):
    assert convert_parameter(DEEP, None if types is None else frozenset(types)) == (outcome, DEEP)


def test_a_too_deep_value_still_gives_a_structured_call():
    arguments, diag = _arguments([("o", DEEP), ("n", "1")])
    assert json.loads(arguments) == {"o": DEEP, "n": 1}
    assert diag["schema_mismatch_preserved"] == 1 and diag["fallback_reason"] == "none"
