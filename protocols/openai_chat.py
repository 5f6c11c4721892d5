"""OpenAI Chat Completions: wire JSON → ``ChatRequest`` (pure validation) and response shapes.

Parsing is strict about what changes execution and lenient about what does not: every field whose
behavior NInfer cannot provide is rejected naming the field and the missing guarantee; neutral
values (all-zero logit_bias, logprobs:false, verbosity "medium", ...) are accepted; unknown
top-level fields are ignored.
"""

from __future__ import annotations

import secrets
from typing import Any

import attrs

from protocols import fields as f
from protocols.conversation import (
    Conversation,
    GenerationOptions,
    Message,
    Part,
    Tool,
    ToolCall,
    resolve_thinking_options,
)
from protocols.errors import (
    NO_CONSTRAINED_OUTPUT,
    NO_LOGPROBS,
    NO_MODERATION,
    NO_SINGLE_CALL,
    NO_STRICT_TOOLS,
    ProtocolError,
    invalid_type,
    invalid_value,
    missing,
    unsupported,
    vision_disabled,
)
from protocols.openai_shared import (
    allowed_tools,
    cache_breakpoint,
    check_advisory,
    check_model,
    check_text_format,
    check_verbosity,
    implicit_cache,
    string_tool_choice,
)
from protocols.tools import arguments

CONSTRAINED_ALIASES = ("grammar", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                       "guided_grammar")


@attrs.frozen
class ChatRequest:
    model: str
    conversation: Conversation
    generation: GenerationOptions
    stream: bool = False
    include_usage: bool = False
    timings_per_token: bool = False
    return_progress: bool = False


def parse_request(body: Any, public_model_id: str) -> ChatRequest:
    if not isinstance(body, dict):
        raise ProtocolError("invalid_json", "The request body must be a JSON object.")
    model = check_model(body, public_model_id)
    _reject_unsupported(body)
    check_advisory(body)
    tools, callable_names = _parse_tools(body)
    messages = _parse_messages(body)
    kwargs = f.opt_object(body, "chat_template_kwargs") or {}
    options = resolve_thinking_options(
        f.opt_bool(body, "enable_thinking"), f.opt_bool(body, "preserve_thinking"),
        f.opt_str(body, "reasoning_effort"), kwargs,
    )
    conversation = Conversation(messages, tools, callable_names, options, implicit_cache(body))
    stream = bool(f.opt_bool(body, "stream"))
    stream_options = f.opt_object(body, "stream_options") or {}
    include_usage = bool(f.opt_bool(stream_options, "include_usage", "stream_options.include_usage"))
    return_progress = bool(f.opt_bool(body, "return_progress"))
    timings_per_token = bool(f.opt_bool(body, "timings_per_token"))
    return ChatRequest(model, conversation, _parse_generation(body), stream, include_usage and stream,
                       timings_per_token and stream, return_progress and stream)


def _parse_generation(body: dict) -> GenerationOptions:
    legacy = f.opt_int(body, "max_tokens", 0)
    current = f.opt_int(body, "max_completion_tokens", 0)
    if legacy is not None and current is not None and legacy != current:
        raise invalid_value("max_completion_tokens", f"it is {current} but max_tokens is {legacy}; send one.")
    return GenerationOptions(
        max_tokens=current if current is not None else legacy,
        temperature=f.opt_number(body, "temperature", 0.0, 2.0),
        top_p=f.opt_number(body, "top_p", 0.0, 1.0),
        top_k=f.opt_int(body, "top_k", 0, 20),
        min_p=f.opt_number(body, "min_p", 0.0, 1.0),
        presence_penalty=f.opt_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=f.opt_number(body, "frequency_penalty", -2.0, 2.0),
        seed=f.opt_seed(body),
        stops=f.stop_strings(body),
    )


def _reject_unsupported(body: dict) -> None:
    """Capability checks: each names the field and the guarantee NInfer cannot provide."""
    for alias in CONSTRAINED_ALIASES:
        if body.get(alias) is not None:
            raise unsupported(alias, NO_CONSTRAINED_OUTPUT)
    n = f.opt_int(body, "n", 1)  # n < 1 asks for no choice at all: invalid, not unsupported
    if n is not None and n != 1:
        raise unsupported("n", "only one choice (n: 1) is generated per request.")
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise invalid_type("modalities", "an array of strings")
        if any(m != "text" for m in modalities):
            raise unsupported("modalities", "NInfer generates text only; audio output is not available.")
    rf = f.opt_object(body, "response_format")
    if rf is not None:
        check_text_format(rf, "response_format")
    bias = f.opt_object(body, "logit_bias")
    if bias:
        if not all(f.is_number(v) for v in bias.values()):
            raise invalid_type("logit_bias", "an object mapping token ids to numbers")
        if any(v != 0 for v in bias.values()):
            raise unsupported("logit_bias", "token logit biasing is not implemented; only all-zero biases are accepted.")
    if f.opt_bool(body, "logprobs"):
        raise unsupported("logprobs", NO_LOGPROBS)
    if f.opt_int(body, "top_logprobs", 0, 20):
        raise unsupported("top_logprobs", NO_LOGPROBS)
    check_verbosity(f.opt_str(body, "verbosity"), "verbosity")
    if body.get("web_search_options") is not None:
        raise unsupported("web_search_options", "NInfer has no web search tool.")
    if body.get("moderation") not in (None, False):
        raise unsupported("moderation", NO_MODERATION)
    if f.opt_bool(body, "store"):
        raise unsupported("store", "stored Chat Completions are not kept by this server.")
    functions = body.get("functions")
    if functions is not None:
        if not isinstance(functions, list):
            raise invalid_type("functions", "an array")
        if functions:
            raise unsupported("functions", "legacy function definitions are not supported; use 'tools'.")
    function_call = body.get("function_call")
    if isinstance(function_call, str) and function_call not in ("none", "auto"):
        raise invalid_value("function_call", "must be 'none', 'auto' or an object naming a function.")
    if function_call is not None and not isinstance(function_call, (str, dict)):
        raise invalid_type("function_call", "a string or an object")
    if isinstance(function_call, dict):
        raise unsupported("function_call", "a forced legacy function call needs constrained decoding.")
    rp = body.get("repetition_penalty")
    if rp is not None and (not f.is_number(rp) or rp != 1):
        raise unsupported("repetition_penalty", "only the neutral value 1 is accepted; use presence/frequency penalties.")
    mm = body.get("mm_processor_kwargs")
    if mm is not None and (not isinstance(mm, dict) or any(v is not None for v in mm.values())):
        raise unsupported("mm_processor_kwargs", "media processor overrides are not supported.")
    for key in ("audio", "prediction", "metadata"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise invalid_type(key, "an object")


# --- messages ---------------------------------------------------------------------------------

def _parse_messages(body: dict) -> tuple[Message, ...]:
    raw = body.get("messages")
    if raw is None:
        raise missing("messages")
    if not isinstance(raw, list):
        raise invalid_type("messages", "an array")
    if not raw:
        raise invalid_value("messages", "at least one message is required.")
    out: list[Message] = []
    legacy_ids: dict[str, str] = {}  # legacy function name -> synthesized call id of its latest call
    for i, m in enumerate(raw):
        out.append(_parse_message(m, f"messages[{i}]", legacy_ids))
    return tuple(out)


def _parse_message(m: Any, where: str, legacy_ids: dict[str, str]) -> Message:
    if not isinstance(m, dict):
        raise invalid_type(where, "an object")
    role = m.get("role")
    if role is None:
        raise missing(f"{where}.role")
    if role not in ("system", "developer", "user", "assistant", "tool", "function"):
        raise invalid_value(f"{where}.role", f"unknown role {role!r}.")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid_type(f"{where}.name", "a string")
    if role == "function":
        return _legacy_function_result(m, where, legacy_ids)
    if name and role != "tool":
        # A tool message's name is an ignored compatibility echo; elsewhere it is participant identity.
        raise unsupported(f"{where}.name", "participant names cannot be represented by the chat template.")
    parts = _parse_content(m.get("content"), role, f"{where}.content")
    if role == "assistant":
        return _assistant(m, parts, where, legacy_ids)
    for key in ("tool_calls", "function_call", "reasoning_content", "reasoning"):
        if m.get(key) is not None:
            raise invalid_value(f"{where}.{key}", f"only assistant messages carry '{key}'.")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is None:
            raise missing(f"{where}.tool_call_id")
        if not isinstance(call_id, str):
            raise invalid_type(f"{where}.tool_call_id", "a string")
        return Message("tool", parts, tool_call_id=call_id)
    return Message(role, parts)


def _legacy_function_result(m: dict, where: str, legacy_ids: dict[str, str]) -> Message:
    name = m.get("name")
    if not name:
        raise missing(f"{where}.name")
    parts = _parse_content(m.get("content"), "tool", f"{where}.content")
    call_id = legacy_ids.get(name)
    if call_id is None:
        raise ProtocolError("invalid_prompt", f"function result '{name}' has no preceding function_call.", where)
    return Message("tool", parts, tool_call_id=call_id)


def _assistant(m: dict, parts: tuple[Part, ...], where: str, legacy_ids: dict[str, str]) -> Message:
    reasoning = None
    for key in ("reasoning_content", "reasoning"):
        v = m.get(key)
        if v is None:
            continue
        if not isinstance(v, str):
            raise invalid_type(f"{where}.{key}", "a string")
        if reasoning is not None and v != reasoning:
            raise invalid_value(f"{where}.reasoning", "differs from reasoning_content; send one of them.")
        reasoning = v
    calls: list[ToolCall] = []
    raw_calls = m.get("tool_calls")
    if raw_calls is not None:
        if not isinstance(raw_calls, list):
            raise invalid_type(f"{where}.tool_calls", "an array")
        for j, c in enumerate(raw_calls):
            calls.append(_history_call(c, f"{where}.tool_calls[{j}]"))
    fc = m.get("function_call")
    if fc is not None:
        if not isinstance(fc, dict):
            raise invalid_type(f"{where}.function_call", "an object")
        # One function_call a message, so its index makes the id unique (A, A, B must not share one).
        call_id = f"call_legacy_{where.removeprefix('messages[').removesuffix(']')}"
        name, args = _function_body(fc, f"{where}.function_call")
        legacy_ids[name] = call_id
        calls.append(ToolCall(call_id, name, args))
    return Message("assistant", parts, reasoning=reasoning, tool_calls=tuple(calls))


def _history_call(c: Any, where: str) -> ToolCall:
    if not isinstance(c, dict):
        raise invalid_type(where, "an object")
    if c.get("type", "function") != "function":
        raise unsupported(f"{where}.type", "only function tool calls can be represented.")
    call_id = c.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid_type(f"{where}.id", "a non-empty string")
    fn = c.get("function")
    if not isinstance(fn, dict):
        raise invalid_type(f"{where}.function", "an object")
    name, args = _function_body(fn, f"{where}.function")
    return ToolCall(call_id, name, args)


def _function_body(fn: dict, where: str) -> tuple[str, dict]:
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_type(f"{where}.name", "a non-empty string")
    raw = fn.get("arguments", "{}")
    if isinstance(raw, dict):
        return name, raw
    if not isinstance(raw, str):
        raise invalid_type(f"{where}.arguments", "a JSON object string")
    return name, arguments(raw, f"{where}.arguments")


def _parse_content(content: Any, role: str, where: str) -> tuple[Part, ...]:
    if content is None:
        if role in ("assistant",):
            return ()
        raise missing(where)
    if isinstance(content, str):
        return (Part(content),) if content else ()
    if not isinstance(content, list):
        raise invalid_type(where, "a string or an array of content parts")
    return tuple(_parse_part(p, role, f"{where}[{j}]") for j, p in enumerate(content))


def _parse_part(p: Any, role: str, where: str) -> Part:
    if not isinstance(p, dict):
        raise invalid_type(where, "an object")
    kind = p.get("type")
    if kind == "text":
        text = p.get("text")
        if not isinstance(text, str):
            raise invalid_type(f"{where}.text", "a string")
        return Part(text, cache_breakpoint(p, where))
    if kind == "refusal" and role == "assistant":
        text = p.get("refusal")
        if not isinstance(text, str):
            raise invalid_type(f"{where}.refusal", "a string")
        return Part(text, cache_breakpoint(p, where))
    if kind in ("image_url", "video_url") and role in ("user", "tool"):
        media = p.get(kind)
        detail = media.get("detail") if isinstance(media, dict) else None
        if detail not in (None, "auto"):
            raise unsupported(f"{where}.{kind}.detail", "only 'auto' detail is supported.")
        raise vision_disabled(where)
    if kind in ("input_audio", "file"):
        raise unsupported(where, f"'{kind}' content is not supported: NInfer accepts text (and images with --vision).")
    raise invalid_value(f"{where}.type", f"content part type {kind!r} is not valid for a {role} message.")


# --- tools ------------------------------------------------------------------------------------

def _parse_tools(body: dict) -> tuple[tuple[Tool, ...], tuple[str, ...]]:
    raw = body.get("tools")
    tools: list[Tool] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise invalid_type("tools", "an array")
        for i, t in enumerate(raw):
            tools.append(_parse_tool(t, f"tools[{i}]"))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid_value("tools", "function names must be unique.")
    callable_names = _tool_choice(body.get("tool_choice"), names)
    ptc = f.opt_bool(body, "parallel_tool_calls")
    if ptc is False and callable_names:
        raise unsupported("parallel_tool_calls", NO_SINGLE_CALL)
    return tuple(tools), callable_names


def _parse_tool(t: Any, where: str) -> Tool:
    if not isinstance(t, dict):
        raise invalid_type(where, "an object")
    if not isinstance(t.get("type"), str):
        raise invalid_type(f"{where}.type", "a string")
    if t.get("type") != "function":
        raise unsupported(f"{where}.type", f"tool type {t.get('type')!r} cannot be executed; only client "
                          "function tools are supported.")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise invalid_type(f"{where}.function", "an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_type(f"{where}.function.name", "a non-empty string")
    if f.opt_bool(fn, "strict", f"{where}.function.strict"):
        raise unsupported(f"{where}.function.strict", NO_STRICT_TOOLS)
    desc = f.opt_str(fn, "description", f"{where}.function.description")
    params = f.opt_object(fn, "parameters", f"{where}.function.parameters")
    return Tool(name, desc, params)


def _tool_choice(choice: Any, names: list[str]) -> tuple[str, ...]:
    callable_names = string_tool_choice(choice, names)
    if callable_names is not None:
        return callable_names
    if choice.get("type") == "function":
        raise unsupported("tool_choice", "a named tool choice needs constrained decoding to force the call.")
    if choice.get("type") != "allowed_tools":
        raise invalid_value("tool_choice.type", f"unknown tool choice type {choice.get('type')!r}.")
    allowed = choice.get("allowed_tools")
    if not isinstance(allowed, dict):
        raise invalid_type("tool_choice.allowed_tools", "an object")

    def declared(t: Any, where: str) -> str:
        fn = t.get("function") if isinstance(t, dict) else None
        if fn is not None and not isinstance(fn, dict):
            raise invalid_type(f"{where}.function", "an object")
        name = (fn or {}).get("name")
        if name is None and isinstance(t, dict):
            name = t.get("name")
        if name not in names:
            raise invalid_value(where, f"{name!r} is not a declared tool.")
        return name

    return allowed_tools(allowed, "tool_choice.allowed_tools", names, declared)


# --- responses --------------------------------------------------------------------------------

def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def usage(prompt: int, completion: int, cached: int, reasoning: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def message(content: str | None, reasoning: str | None, tool_calls: list[dict]) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def envelope(cid: str, created: int, model: str, obj: str) -> dict:
    return {"id": cid, "object": obj, "created": created, "model": model, "system_fingerprint": None}


def chunk_choice(delta: dict, finish_reason: str | None = None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
