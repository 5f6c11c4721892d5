"""OpenAI Responses Core: create-request validation and typed input Items → normalized Conversation.

``parse_request`` checks every create field (unknown top-level fields fail with
unknown_parameter; recognized but unsupported features fail naming the field) and normalizes the
input into canonical Items with ids. ``build_conversation`` lowers stored history plus those Items
into the shared ``Conversation``: assistant Items group as reasoning → message → function_call,
function_call_output Items are matched by call_id and reordered to call order. Function tools may
be direct or grouped in namespaces; each namespace/function pair gets a distinct engine identity
that ``ToolSet`` maps back to the separate ``namespace`` and ``name`` fields.
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
    REASONING_EFFORTS,
    Part,
    TemplateOptions,
    Tool,
    ToolCall,
    resolve_thinking_options,
)
from protocols.errors import (
    NO_LOGPROBS,
    NO_MODERATION,
    NO_SINGLE_CALL,
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
from protocols.tools import Result, answer_calls, arguments, check_executable

CREATE_FIELDS = frozenset({
    "model", "input", "instructions", "previous_response_id", "max_output_tokens", "stream", "store",
    "temperature", "top_p", "metadata", "client_metadata", "reasoning", "chat_template_kwargs",
    "preserve_thinking", "text", "tools", "tool_choice", "parallel_tool_calls", "max_tool_calls", "truncation",
    "top_logprobs", "service_tier", "background", "include", "stream_options", "prompt_cache_key",
    "prompt_cache_options", "prompt_cache_retention", "safety_identifier", "user",
    # Recognized so that they fail with their own reason rather than as unknown.
    "conversation", "prompt", "context_management", "moderation",
})
COUNT_FIELDS = frozenset({
    "model", "input", "instructions", "previous_response_id", "reasoning", "tools", "tool_choice", "text",
    "truncation", "preserve_thinking", "parallel_tool_calls", "chat_template_kwargs", "conversation",
})
_RECOGNIZED_UNSUPPORTED = {
    "conversation": "Conversations are not stored by this server; use previous_response_id or replay the input.",
    "prompt": "reusable prompt templates are not available on this server.",
    "context_management": "server-side context management (compaction) is not supported.",
    "moderation": NO_MODERATION,
}
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                "file_search", "computer_use_preview", "computer", "code_interpreter", "image_generation",
                "local_shell", "shell", "apply_patch", "tool_search")


@attrs.frozen
class ToolDef:
    identity: str  # the name the engine and the chat template see
    name: str
    namespace: str | None
    description: str | None
    parameters: dict | None


def qualified(namespace: str | None, name: str) -> str:
    """The engine identity of a namespace/function pair (a plain name outside namespaces)."""
    if namespace is None:
        return name
    return namespace + name if namespace.endswith("__") else f"{namespace}__{name}"


@attrs.frozen
class ToolSet:
    defs: tuple[ToolDef, ...] = ()
    callable: tuple[str, ...] = ()  # identities the parser may turn into structured calls

    def by_identity(self, identity: str) -> ToolDef | None:
        for d in self.defs:
            if d.identity == identity:
                return d
        return None

    def split(self, identity: str) -> tuple[str | None, str]:
        d = self.by_identity(identity)
        return (d.namespace, d.name) if d is not None else (None, identity)


@attrs.frozen
class ResponsesRequest:
    model: str
    items: tuple[dict, ...]  # canonical input Items of this request, client order, with ids
    instructions: str | None
    previous_response_id: str | None
    generation: GenerationOptions
    options: TemplateOptions
    tools: ToolSet
    implicit_cache: bool = True
    stream: bool = False
    store: bool = True
    metadata: dict = attrs.Factory(dict)
    echo: dict = attrs.Factory(dict)  # request fields the Response object reports back


def parse_request(body: Any, public_model_id: str, *, count_only: bool = False) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise ProtocolError("invalid_json", "The request body must be a JSON object.")
    allowed = COUNT_FIELDS if count_only else CREATE_FIELDS
    for key in body:
        if key not in allowed:
            raise ProtocolError("unknown_parameter", f"Unknown parameter: '{key}'.", key)
    if not (count_only and body.get("model") is None):  # counting takes the served model when none is named
        check_model(body, public_model_id)
    for key, why in _RECOGNIZED_UNSUPPORTED.items():
        if body.get(key) is not None:
            raise unsupported(key, why)
    _check_unsupported(body)
    tools = _parse_tools(body)
    items = normalize_input(body.get("input"))
    instructions = f.opt_str(body, "instructions")
    prev = f.opt_str(body, "previous_response_id")
    if prev is None and body.get("input") in (None, "", []):  # an empty string is empty input too
        raise invalid_value("input", "must not be empty unless previous_response_id supplies the conversation.")
    options = _options(body)
    metadata = _metadata(body)
    f.opt_object(body, "client_metadata")  # Codex tracing extension: opaque, no generation effect
    check_advisory(body)
    gen = GenerationOptions(
        max_tokens=f.opt_int(body, "max_output_tokens", 0),
        temperature=f.opt_number(body, "temperature", 0.0, 2.0),
        top_p=f.opt_number(body, "top_p", 0.0, 1.0),
    )
    f.opt_int(body, "max_tool_calls", 0)  # accepted: a hosted-tool limit, and NInfer runs no hosted tools
    stream = bool(f.opt_bool(body, "stream"))
    so = f.opt_object(body, "stream_options")
    if so is not None:
        f.opt_bool(so, "include_obfuscation", "stream_options.include_obfuscation")  # no padding is emitted
    store = f.opt_bool(body, "store")
    echo = {
        "instructions": instructions, "max_output_tokens": gen.max_tokens, "temperature": gen.temperature,
        "top_p": gen.top_p, "tool_choice": _echo_choice(body.get("tool_choice")), "tools": body.get("tools") or [],
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,  # null: unspecified, the default true
        "max_tool_calls": body.get("max_tool_calls"), "prompt_cache_key": body.get("prompt_cache_key"),
        "safety_identifier": body.get("safety_identifier"), "user": body.get("user"),
        "reasoning": {"effort": options.reasoning_effort, "summary": None},
    }
    return ResponsesRequest(public_model_id, items, instructions, prev, gen, options, tools,
                            implicit_cache(body), stream, True if store is None else store, metadata, echo)


def _check_unsupported(body: dict) -> None:
    text = f.opt_object(body, "text")
    if text is not None:
        fmt = text.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise invalid_type("text.format", "an object")
            check_text_format(fmt, "text.format")
        check_verbosity(text.get("verbosity"), "text.verbosity")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        if truncation != "auto":
            raise invalid_value("truncation", "must be 'auto' or 'disabled'.")
        raise unsupported("truncation", "automatic truncation would silently drop Items; overlong input fails "
                          "instead.")
    if f.opt_int(body, "top_logprobs", 0, 20):
        raise unsupported("top_logprobs", NO_LOGPROBS)
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        if tier not in ("flex", "scale", "priority"):
            raise invalid_value("service_tier", "must be 'auto', 'default', 'flex', 'scale' or 'priority'.")
        raise unsupported("service_tier", "this local server has one service tier ('default').")
    if f.opt_bool(body, "background"):
        raise unsupported("background", "background execution is not supported; requests run in the foreground.")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise invalid_type("include", "an array")
        if include:
            raise unsupported("include", f"no optional output data ({include[0]!r}) is available from this server.")


REASONING_SUMMARIES = ("auto", "concise", "detailed")


def _options(body: dict) -> TemplateOptions:
    reasoning = f.opt_object(body, "reasoning") or {}
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise invalid_value("reasoning.effort", f"must be one of {', '.join(REASONING_EFFORTS)}.")
    # reasoning.summary is an output preference; NInfer returns raw reasoning_text and an empty summary.
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None and reasoning[key] not in REASONING_SUMMARIES:
            raise invalid_value(f"reasoning.{key}", f"must be one of {', '.join(REASONING_SUMMARIES)}.")
    kwargs = f.opt_object(body, "chat_template_kwargs") or {}
    return resolve_thinking_options(None, f.opt_bool(body, "preserve_thinking"), effort, kwargs,
                                    fields={"reasoning_effort": "reasoning.effort"})


def _metadata(body: dict) -> dict:
    md = f.opt_object(body, "metadata")
    if md is None:
        return {}
    if len(md) > 16:
        raise invalid_value("metadata", f"at most 16 pairs are allowed, got {len(md)}.")
    for k, v in md.items():
        if len(k) > 64:
            raise invalid_value("metadata", f"key {k[:16]!r}... is longer than 64 characters.")
        if not isinstance(v, str):
            raise invalid_type(f"metadata.{k}", "a string")
        if len(v) > 512:
            raise invalid_value(f"metadata.{k}", "values are at most 512 characters.")
    return dict(md)


def _echo_choice(choice: Any) -> Any:
    return "auto" if choice is None else choice


# --- tools ------------------------------------------------------------------------------------

def _parse_tools(body: dict) -> ToolSet:
    raw = body.get("tools")
    defs: list[ToolDef] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise invalid_type("tools", "an array")
        for i, t in enumerate(raw):
            defs.extend(_parse_tool(t, f"tools[{i}]"))
    seen: set[str] = set()
    for d in defs:
        if d.identity in seen:
            where = f"{d.namespace}.{d.name}" if d.namespace else d.name
            raise invalid_value("tools", f"function {where!r} is declared twice (or collides with a namespaced "
                                f"function's identity {d.identity!r}).")
        seen.add(d.identity)
    callable_ids = _tool_choice(body.get("tool_choice"), defs)
    if f.opt_bool(body, "parallel_tool_calls") is False and callable_ids:
        raise unsupported("parallel_tool_calls", NO_SINGLE_CALL)
    return ToolSet(tuple(defs), callable_ids)


def _parse_tool(t: Any, where: str, namespace: str | None = None) -> list[ToolDef]:
    if not isinstance(t, dict):
        raise invalid_type(where, "an object")
    kind = t.get("type")
    if kind == "namespace" and namespace is None:
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_type(f"{where}.name", "a non-empty string")
        members = t.get("tools")
        if not isinstance(members, list):
            raise invalid_type(f"{where}.tools", "an array")
        f.opt_str(t, "description", f"{where}.description")
        out: list[ToolDef] = []
        for j, m in enumerate(members):
            out.extend(_parse_tool(m, f"{where}.tools[{j}]", name))
        return out
    if kind in HOSTED_TOOLS:
        raise unsupported(f"{where}.type", f"'{kind}' is an OpenAI-hosted tool; NInfer does not execute tools.")
    if kind == "mcp":
        raise unsupported(f"{where}.type", "remote MCP tools need an MCP executor, which NInfer does not have.")
    if kind == "custom":
        raise unsupported(f"{where}.type", "custom free-form tools need grammar-constrained output.")
    if kind != "function":
        raise invalid_value(f"{where}.type", f"unknown tool type {kind!r}.")
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_type(f"{where}.name", "a non-empty string")
    check_executable(t, where)
    if t.get("output_schema") is not None:
        raise unsupported(f"{where}.output_schema", "tool output schemas cannot be honored.")
    desc = f.opt_str(t, "description", f"{where}.description")
    params = f.opt_object(t, "parameters", f"{where}.parameters")
    return [ToolDef(qualified(namespace, name), name, namespace, desc, params)]


def _tool_choice(choice: Any, defs: list[ToolDef]) -> tuple[str, ...]:
    ids = [d.identity for d in defs]
    callable_ids = string_tool_choice(choice, ids)
    if callable_ids is not None:
        return callable_ids
    kind = choice.get("type")
    if kind in ("function", "custom", "mcp") or kind in HOSTED_TOOLS:
        raise unsupported("tool_choice", f"a forced {kind!r} choice needs constrained decoding or a hosted executor.")
    if kind != "allowed_tools":
        raise invalid_value("tool_choice.type", f"unknown tool choice type {kind!r}.")

    def declared(t: Any, where: str) -> str:
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise unsupported(where, "allowed_tools may list only function tools.")
        # Matched as a namespace/name pair, not by the joined identity: a namespaced function is selected
        # only by both fields, and a different split of the same joined string selects nothing.
        pair = (t.get("namespace"), t.get("name"))
        d = next((d for d in defs if (d.namespace, d.name) == pair), None)
        if d is None:
            raise invalid_value(where, f"{t.get('name')!r} is not a declared function"
                                + (f" in namespace {t.get('namespace')!r}." if t.get("namespace") else "."))
        return d.identity

    return allowed_tools(choice, "tool_choice", ids, declared)


# --- input Items ------------------------------------------------------------------------------

_ID_PREFIX = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_", "function_call_output": "fco_"}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def normalize_input(raw: Any) -> tuple[dict, ...]:
    """Canonical input Items in client order: validated, with ids preserved or generated."""
    if raw is None or raw == "":  # an empty string is empty input, as [] is: no Item
        return ()
    if isinstance(raw, str):
        return ({"type": "message", "id": new_id("msg_"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": raw}]},)
    if not isinstance(raw, list):
        raise invalid_type("input", "a string or an array of Items")
    out: list[dict] = []
    ids: set[str] = set()
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        canon = _item(item, where)
        if canon["id"] in ids:
            raise invalid_value(f"{where}.id", f"duplicate Item id {canon['id']!r}.")
        ids.add(canon["id"])
        out.append(canon)
    return tuple(out)


def _item(item: Any, where: str) -> dict:
    if not isinstance(item, dict):
        raise invalid_type(where, "an object")
    kind = item.get("type")
    if kind is None and "role" in item:
        kind = "message"  # EasyInputMessage: {"role", "content"} without a type
    if kind is not None and not isinstance(kind, str):  # a list or object type would not even hash
        raise invalid_type(f"{where}.type", "a string")
    if kind not in _ID_PREFIX:
        if kind == "item_reference":
            raise unsupported(where, "item references need server-side Item storage; replay the Item instead.")
        raise unsupported(f"{where}.type", f"Item type {kind!r} is not supported by Responses Core.")
    item_id = item.get("id")
    if item_id is not None and (not isinstance(item_id, str) or not item_id):
        raise invalid_type(f"{where}.id", "a non-empty string")
    item_id = item_id or new_id(_ID_PREFIX[kind])
    status = item.get("status")
    if status is not None and not isinstance(status, str):
        raise invalid_type(f"{where}.status", "a string")
    if kind == "message":
        return _message_item(item, item_id, where)
    if kind == "reasoning":
        return _reasoning_item(item, item_id, where)
    if kind == "function_call":
        return _call_item(item, item_id, where)
    return _output_item(item, item_id, where)


def _message_item(item: dict, item_id: str, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise invalid_value(f"{where}.role", "must be 'user', 'assistant', 'system' or 'developer'.")
    if item.get("phase") is not None and not isinstance(item.get("phase"), str):
        raise invalid_type(f"{where}.phase", "a string")  # accepted metadata with no prompt representation
    content = item.get("content")
    if content is None:
        raise missing(f"{where}.content")
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    elif isinstance(content, list):
        parts = [_content_part(p, role, f"{where}.content[{j}]") for j, p in enumerate(content)]
    else:
        raise invalid_type(f"{where}.content", "a string or an array of content parts")
    out = {"type": "message", "id": item_id, "role": role, "status": item.get("status") or "completed",
           "content": parts}
    return out


def _content_part(p: Any, role: str, where: str) -> dict:
    if not isinstance(p, dict):
        raise invalid_type(where, "an object")
    kind = p.get("type")
    if kind in ("input_image", "input_video"):
        if kind == "input_image" and p.get("file_id") is not None:
            raise unsupported(f"{where}.file_id", "image file ids need the Files API, which is not available.")
        if p.get("detail") not in (None, "auto"):
            raise unsupported(f"{where}.detail", "only 'auto' image detail is supported.")
        raise vision_disabled(where)
    if kind in ("input_file", "input_audio"):
        raise unsupported(where, f"'{kind}' content is not supported: NInfer accepts text (and images with --vision).")
    allowed = ("output_text", "refusal", "input_text") if role == "assistant" else ("input_text",)
    if kind not in allowed:
        raise invalid_value(f"{where}.type", f"content part type {kind!r} is not valid for a {role} message.")
    key = "refusal" if kind == "refusal" else "text"
    text = p.get(key)
    if not isinstance(text, str):
        raise invalid_type(f"{where}.{key}", "a string")
    out = {"type": kind, key: text}
    if kind == "output_text":
        out["annotations"] = []
    if cache_breakpoint(p, where):
        out["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return out


def _reasoning_item(item: dict, item_id: str, where: str) -> dict:
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise unsupported(where, "a reasoning Item without raw reasoning_text content (summary or encrypted "
                          "content only) cannot be restored into the prompt.")
    texts = []
    for j, c in enumerate(content):
        if not isinstance(c, dict) or c.get("type") != "reasoning_text" or not isinstance(c.get("text"), str):
            raise invalid_value(f"{where}.content[{j}]", "must be a {\"type\": \"reasoning_text\", \"text\"} part.")
        texts.append(c["text"])
    summary = item.get("summary", [])
    if not isinstance(summary, list):
        raise invalid_type(f"{where}.summary", "an array")
    return {"type": "reasoning", "id": item_id, "summary": summary,
            "content": [{"type": "reasoning_text", "text": t} for t in texts]}


def _call_item(item: dict, item_id: str, where: str) -> dict:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid_type(f"{where}.call_id", "a non-empty string")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_type(f"{where}.name", "a non-empty string")
    namespace = f.opt_str(item, "namespace", f"{where}.namespace")
    args = item.get("arguments")
    if not isinstance(args, str):
        raise invalid_type(f"{where}.arguments", "a JSON object string")
    if item.get("status") in ("in_progress", "incomplete"):
        raise unsupported(f"{where}.status", "a partial function_call cannot be replayed.")
    arguments(args, f"{where}.arguments")
    out = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": args,
           "status": "completed"}
    if namespace is not None:
        out["namespace"] = namespace
    return out


def _output_item(item: dict, item_id: str, where: str) -> dict:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid_type(f"{where}.call_id", "a non-empty string")
    output = item.get("output")
    if isinstance(output, str):
        parts: Any = output
    elif isinstance(output, list) and output:
        parts = [_content_part(p, "tool", f"{where}.output[{j}]") for j, p in enumerate(output)]
    elif isinstance(output, list):
        raise invalid_value(f"{where}.output", "an array of content parts must not be empty.")
    else:
        raise invalid_type(f"{where}.output", "a string or an array of content parts")
    if item.get("status") in ("in_progress", "incomplete"):
        raise unsupported(f"{where}.status", "a partial function_call_output cannot be replayed.")
    out = {"type": "function_call_output", "id": item_id, "call_id": call_id, "output": parts,
           "status": "completed"}
    for key in ("name", "namespace"):  # an optional assertion of the answered call's identity
        value = f.opt_str(item, key, f"{where}.{key}")
        if value is not None:
            out[key] = value
    return out


# --- lowering ---------------------------------------------------------------------------------

@attrs.define
class _Group:
    """Consecutive assistant-side Items: one assistant turn."""

    reasoning: list[str] = attrs.Factory(list)
    parts: list[Part] = attrs.Factory(list)
    calls: list[ToolCall] = attrs.Factory(list)
    named: dict[str, tuple[str | None, str]] = attrs.Factory(dict)  # call_id -> (namespace, name) as sent
    stage: int = 0  # 0 reasoning, 1 message content, 2 function calls: the only representable order


def build_conversation(history: tuple[dict, ...], req: ResponsesRequest,
                       inherited_preserve: bool | None = None) -> Conversation:
    """Stored history + this request's Items → Conversation (instructions lead, for this request only)."""
    _check_new_ids(history, req.items)
    messages: list[Message] = []
    if req.instructions:
        messages.append(Message("developer", (Part(req.instructions),)))
    messages.extend(lower_items(history + req.items, len(history)))
    options = req.options
    if options.preserve_thinking is None and inherited_preserve is not None:
        options = attrs.evolve(options, preserve_thinking=inherited_preserve)
    tools = tuple(Tool(d.identity, d.description, d.parameters) for d in req.tools.defs)
    return Conversation(tuple(messages), tools, req.tools.callable, options, req.implicit_cache)


def _check_new_ids(history: tuple[dict, ...], items: tuple[dict, ...]) -> None:
    """An input Item may not repeat one the previous_response_id chain already holds: it would enter the
    prompt twice (OpenAI refuses such input the same way)."""
    held = {it["id"] for it in history}
    for i, it in enumerate(items):
        if it["id"] in held:
            raise invalid_value(f"input[{i}].id", f"Item {it['id']!r} is already in the previous_response_id "
                                "history; send only the new Items.")


def lower_items(items: tuple[dict, ...], first_new: int = 0) -> list[Message]:
    out: list[Message] = []
    group: _Group | None = None
    pending: list[Result] = []  # function_call_output Items waiting for the group's calls

    def close(next_where: str | None = None) -> None:
        """End the assistant group; ``next_where``: the Item that follows it (None at the end)."""
        nonlocal group, pending
        if group is not None:
            out.append(Message("assistant", tuple(group.parts),
                               reasoning="".join(group.reasoning) if group.reasoning else None,
                               tool_calls=tuple(group.calls)))
        calls = [c.id for c in group.calls] if group is not None else []
        # Results are validated by call_id and reordered to the calls' declaration order; calls that
        # another Item follows without a single result are an empty, so partial, result set.
        if pending or (calls and next_where is not None):
            out.extend(answer_calls(calls, pending, id_field="call_id", opens_history=not out,
                                    missing_where=pending[0].where if pending else next_where))
        group, pending = None, []

    for i, item in enumerate(items):
        kind = item["type"]
        where = _where(i, first_new)
        if kind == "function_call_output":
            _check_asserted_call(item, group, where)
            pending.append(Result(item["call_id"], _parts(item["output"]), where))
            continue
        assistant_side = kind in ("reasoning", "function_call") or (kind == "message" and item["role"] == "assistant")
        if pending or not assistant_side:
            close(where)
        if not assistant_side:
            out.append(Message(item["role"], _parts(item["content"])))
            continue
        group = group or _Group()
        _add_to_group(group, item, where)
    close()
    return out


def _check_asserted_call(item: dict, group: _Group | None, where: str) -> None:
    """A result that names its call must name the call its call_id answers, as the call's own
    namespace/name pair: a name asserts the pair (no namespace: none), a namespace alone the namespace."""
    pair = group.named.get(item["call_id"]) if group is not None else None
    if pair is None or ("name" not in item and "namespace" not in item):
        return  # an unknown call_id is reported where results are matched to calls
    key = "name" if "name" in item else "namespace"
    asserted = (item.get("namespace"), item["name"]) if key == "name" else item["namespace"]
    if asserted != (pair if key == "name" else pair[0]):
        raise ProtocolError("invalid_tool_history", f"function_call_output {item['call_id']!r} names "
                            f"{asserted!r}, but that call is {pair!r} (namespace, name).", f"{where}.{key}")


def _where(i: int, first_new: int) -> str:
    return f"input[{i - first_new}]" if i >= first_new else f"previous_response_id history item {i}"


def _add_to_group(group: _Group, item: dict, where: str) -> None:
    kind = item["type"]
    stage = {"reasoning": 0, "message": 1, "function_call": 2}[kind]
    if stage < group.stage:
        raise ProtocolError("invalid_assistant_history", f"a {kind} Item after a later-stage assistant Item: an "
                            "assistant turn is represented only in the order reasoning → message → function_call.",
                            where)
    group.stage = stage
    if kind == "reasoning":
        group.reasoning.append("".join(c["text"] for c in item["content"]))
    elif kind == "message":
        group.parts.extend(_parts(item["content"]))
    else:
        args = arguments(item["arguments"], f"{where}.arguments")
        group.calls.append(ToolCall(item["call_id"], qualified(item.get("namespace"), item["name"]), args))
        group.named[item["call_id"]] = (item.get("namespace"), item["name"])


def _parts(content: Any) -> tuple[Part, ...]:
    if isinstance(content, str):
        return (Part(content),) if content else ()
    return tuple(Part(p.get("text", p.get("refusal", "")), "prompt_cache_breakpoint" in p) for p in content)

