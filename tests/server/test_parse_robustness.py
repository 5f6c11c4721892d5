"""Malformed bodies that once escaped the parsers as internal errors: each is now a field error.

Found by structural fuzzing (every value swapped for null, wrong types, huge numbers, odd strings):
a bad body must fail with ``ProtocolError`` naming its field, never with a TypeError, an overflow or
a recursion error that the server would report as a 500.
"""

from __future__ import annotations

import pytest

from protocols import anthropic_messages, openai_chat, openai_responses
from server.expect import protocol_error

MODEL = "m"
HUGE = 10**400  # a valid JSON integer that no float can hold
DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON nested past the decoder's stack
LONG_INT = '{"a": 1' + "0" * 5000 + "}"  # valid JSON past Python's integer digit limit
LONE_SURROGATE = '{"a": "\\ud800"}'  # the escape survives the body's check: it is one JSON level deeper
RESERVED_KWARG = {"boundary_messages": [0]}  # a keyword of the template render call itself


def chat_call(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}]


def allowed(entry: dict) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [entry]}}


CHAT_TOOLS = [{"type": "function", "function": {"name": "f"}}]
CHAT_ARGS = "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("extra, code, param", [
    ({"temperature": HUGE}, "invalid_value", "temperature"),
    ({"top_p": -HUGE}, "invalid_value", "top_p"),
    ({"logit_bias": {"1": HUGE}}, "unsupported_parameter", "logit_bias"),
    ({"repetition_penalty": HUGE}, "unsupported_parameter", "repetition_penalty"),
    ({"tools": CHAT_TOOLS, "tool_choice": allowed({"type": "function", "function": True})},
     "invalid_type", "tool_choice.allowed_tools.tools[0].function"),
    ({"tools": CHAT_TOOLS, "tool_choice": allowed({"type": "function", "function": "f"})},
     "invalid_type", "tool_choice.allowed_tools.tools[0].function"),
    ({"chat_template_kwargs": RESERVED_KWARG}, "invalid_value", "chat_template_kwargs.boundary_messages"),
    ({"messages": chat_call(DEEP)}, "invalid_value", CHAT_ARGS),
    ({"messages": chat_call(LONG_INT)}, "invalid_value", CHAT_ARGS),
    ({"messages": chat_call(LONE_SURROGATE)}, "invalid_value", CHAT_ARGS),
])
def test_chat(extra, code, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    protocol_error(lambda: openai_chat.parse_request(body, MODEL), code, param)


def responses_call(arguments: str) -> list[dict]:
    return [{"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "r"}]


@pytest.mark.parametrize("extra, code, param", [
    ({"temperature": HUGE}, "invalid_value", "temperature"),
    ({"input": [{"type": []}]}, "invalid_type", "input[0].type"),
    ({"input": [{"type": {"t": 1}, "role": "user", "content": "hi"}]}, "invalid_type", "input[0].type"),
    ({"chat_template_kwargs": RESERVED_KWARG}, "invalid_value", "chat_template_kwargs.boundary_messages"),
    ({"input": responses_call(DEEP)}, "invalid_value", "input[1].arguments"),
    ({"input": responses_call(LONG_INT)}, "invalid_value", "input[1].arguments"),
    ({"input": responses_call(LONE_SURROGATE)}, "invalid_value", "input[1].arguments"),
])
def test_responses(extra, code, param):
    body = {"model": MODEL, "input": "hi", **extra}

    def run():
        openai_responses.build_conversation((), openai_responses.parse_request(body, MODEL))

    protocol_error(run, code, param)


@pytest.mark.parametrize("extra, code, param", [
    ({"temperature": HUGE}, "invalid_value", "temperature"),
    ({"top_p": HUGE}, "invalid_value", "top_p"),
    ({"chat_template_kwargs": RESERVED_KWARG}, "invalid_value", "chat_template_kwargs.boundary_messages"),
])
def test_messages(extra, code, param):
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **extra}
    protocol_error(lambda: anthropic_messages.parse_request(body), code, param)
