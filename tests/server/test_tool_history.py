"""Tool-result history rules shared by Responses and Anthropic Messages (``protocols.tools``).

Every declared call needs exactly one result, matched by its ID and put in call order. A call ID
that one assistant turn declares twice cannot be answered that way: a single result would be
rendered once for each of the two calls.
"""

from __future__ import annotations

from protocols.anthropic_messages import parse_request as parse_messages
from protocols.openai_responses import build_conversation, parse_request as parse_responses
from server.expect import protocol_error

MODEL = "m"


def _messages(*results: str) -> list[dict]:
    calls = [{"type": "tool_use", "id": "t1", "name": "f", "input": {}},
             {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]
    answers = [{"type": "tool_result", "tool_use_id": cid, "content": "r"} for cid in results]
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": calls},
            {"role": "user", "content": answers}]


def test_messages_reject_a_tool_use_id_declared_twice():
    for results in (("t1",), ("t1", "t1")):
        err = protocol_error(lambda: parse_messages({"model": "x", "messages": _messages(*results)}),
                             "invalid_tool_history", "messages[2].content[0].tool_use_id")
        assert "'t1'" in err.message and "twice" in err.message


def _responses(*results: str) -> list[dict]:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    return [{"role": "user", "content": "hi"}, call, dict(call, arguments='{"x": 1}'),
            *({"type": "function_call_output", "call_id": cid, "output": "r"} for cid in results)]


def test_responses_reject_a_call_id_declared_twice():
    def lower(items):
        return build_conversation((), parse_responses({"model": MODEL, "input": items}, MODEL))

    err = protocol_error(lambda: lower(_responses("c1")), "invalid_tool_history", "input[3].call_id")
    assert "'c1'" in err.message
    protocol_error(lambda: lower(_responses("c1", "c1")), "invalid_tool_history")


def test_distinct_ids_are_still_answered_in_call_order():
    msgs = _messages("t2", "t1")
    msgs[1]["content"][1]["id"] = "t2"
    conv = parse_messages({"model": "x", "messages": msgs}).conversation
    assert [(m.role, m.tool_call_id) for m in conv.messages[2:]] == [("tool", "t1"), ("tool", "t2")]
