"""Anthropic Messages: wire JSON → normalized ``MessagesRequest`` (pure validation) and response shapes.

The request lowers to the shared ``Conversation``: consecutive same-role turns join without
separators, thinking blocks become assistant reasoning, tool_use blocks become tool calls and the
leading tool_result blocks of the next user turn become tool results in call order. A final
text-only assistant turn is a prefill that generation continues. Fields whose behavior NInfer
cannot provide are rejected naming the field; advisory fields (metadata, service tier, geography,
unknown hints) are accepted and ignored. The Anthropic error envelope has no ``param`` member, so
a rejection whose message does not already name its field is prefixed with it.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import attrs

from ninfer.text.stops import MAX_STOPS
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
    NO_SINGLE_CALL,
    ProtocolError,
    invalid_type,
    invalid_value,
    missing,
    unsupported,
    vision_disabled,
)
from protocols.tools import Result, answer_calls, check_executable

BILLING_HEADER = "x-anthropic-billing-header:"
CACHE_TTLS = ("5m", "1h")
MAX_BREAKPOINTS = 4
MIN_THINKING_BUDGET = 1024
EFFORTS = ("low", "medium", "high", "xhigh", "max")  # the Anthropic protocol's output_config.effort values
TOOL_ERROR_MARK = "[tool error]\n"  # is_error:true made explicit in the prompt, before the result
# Blocks that need an executor, a document pipeline or a cloud service NInfer does not have.
_UNSUPPORTED_BLOCKS = {
    "document": "document blocks (PDF/plain-text sources with citations) are not supported.",
    "search_result": "search result blocks are not supported.",
    "redacted_thinking": "redacted thinking cannot be restored: NInfer has no encrypted reasoning.",
    "server_tool_use": "server tools are not executed by NInfer.",
    "web_search_tool_result": "server tool results are not supported.",
    "web_fetch_tool_result": "server tool results are not supported.",
    "code_execution_tool_result": "server tool results are not supported.",
    "bash_code_execution_tool_result": "server tool results are not supported.",
    "text_editor_code_execution_tool_result": "server tool results are not supported.",
    "tool_search_tool_result": "server tool results are not supported.",
    "mcp_tool_use": "MCP connector tools are not executed by NInfer.",
    "mcp_tool_result": "MCP connector tools are not executed by NInfer.",
    "container_upload": "containers are not available.",
    "file": "file blocks are not supported.",
}
_UNSUPPORTED_FIELDS = {
    "container": "code-execution containers are not available.",
    "mcp_servers": "NInfer has no remote MCP connector.",
    "output_format": NO_CONSTRAINED_OUTPUT,
}
NO_CONTEXT_EDITING = "server-side context editing is not available."
CLEAR_THINKING = "clear_thinking_20251015"  # the one context edit with an executable form: keep all


@attrs.frozen
class MessagesRequest:
    model: str  # echoed; any non-empty local label
    conversation: Conversation
    generation: GenerationOptions
    stream: bool = False
    thinking_mode: str | None = None  # disabled | adaptive | enabled | None (unspecified)


def parse_request(body: Any, *, count_only: bool = False) -> MessagesRequest:
    """Validate a create (or count_tokens) body; ``count_only`` reads no output-only field."""
    try:
        return _parse_request(body, count_only)
    except ProtocolError as err:
        raise _located(err) from None


def _located(err: ProtocolError) -> ProtocolError:
    """The Anthropic envelope carries only the message: it names the field (``where: why``)."""
    if err.param is None or err.param in err.message:
        return err
    return ProtocolError(err.code, f"{err.param}: {err.message}", err.param, **err.extra)


def _parse_request(body: Any, count_only: bool) -> MessagesRequest:
    if not isinstance(body, dict):
        raise ProtocolError("invalid_json", "The request body must be a JSON object.")
    model = body.get("model")
    if model is None:
        raise missing("model")
    if not isinstance(model, str) or not model:
        raise invalid_type("model", "a non-empty string")
    for key, why in _UNSUPPORTED_FIELDS.items():
        if body.get(key) not in (None, [], {}):
            raise unsupported(key, why)
    slots = _Breakpoints()
    tools, callable_names = _parse_tools(body, slots)
    system = _parse_system(body.get("system"), slots)
    messages, prefill = _parse_messages(body.get("messages"), slots)
    mode, budget = _parse_thinking(body)
    if prefill is not None and mode in ("enabled", "adaptive"):
        raise invalid_value("thinking", "an assistant prefill cannot start with thinking enabled.")
    thinking = {"disabled": False, "enabled": True, "adaptive": True}.get(mode)  # type: ignore[arg-type]
    effort = _parse_effort(body)
    kwargs = f.opt_object(body, "chat_template_kwargs") or {}
    preserve = f.opt_bool(body, "preserve_thinking")
    keep_all = _parse_context_management(body)
    if keep_all is not None:  # every earlier thinking turn stays in the prompt: preserve_thinking
        for field, value in (("preserve_thinking", preserve),
                             ("chat_template_kwargs.preserve_thinking", kwargs.get("preserve_thinking"))):
            if value is False:
                raise ProtocolError("conflicting_template_option", f"'{keep_all}' keeps every thinking turn, but "
                                    f"'{field}' is false.", keep_all)
        preserve = True
    options = resolve_thinking_options(thinking, preserve, effort, kwargs,
                                       fields={"enable_thinking": "thinking",
                                               "reasoning_effort": "output_config.effort"})
    if prefill is not None:  # the prefill continues visible text, never an open <think>
        if options.enable_thinking:
            raise invalid_value("chat_template_kwargs.enable_thinking", "an assistant prefill cannot start with "
                                "thinking.")
        if options.reasoning_effort not in (None, "none"):
            field = "output_config.effort" if effort is not None else "chat_template_kwargs.reasoning_effort"
            raise invalid_value(field, "an assistant prefill cannot start with thinking.")
        options = attrs.evolve(options, enable_thinking=False)
    all_messages = system + messages
    all_messages = slots.apply_request_level(body.get("cache_control"), all_messages)
    conversation = Conversation(tuple(all_messages), tools, callable_names, options, implicit_cache=False,
                                prefill=prefill)
    if count_only:  # output-only sampling and streaming fields do not affect the count (spec): unread
        return MessagesRequest(model, conversation, GenerationOptions(thinking_budget=budget), False, mode)
    gen = _parse_generation(body, budget)
    return MessagesRequest(model, conversation, gen, bool(f.opt_bool(body, "stream")), mode)


# --- sampling and thinking --------------------------------------------------------------------

# Anthropic documents no cap on stop_sequences (the four of the spec are Chat's `stop`): the text
# layer's own bound.
STOP_SEQUENCES_LIMIT = MAX_STOPS

def _parse_generation(body: dict, budget: int | None) -> GenerationOptions:
    max_tokens = f.opt_int(body, "max_tokens", 0)
    if max_tokens == 0:
        raise invalid_value("max_tokens", "must be positive: a zero-output cache prewarm is not supported.")
    if max_tokens is not None:
        check_thinking_budget(budget, max_tokens)
    if body.get("stop_sequences") is not None and not isinstance(body["stop_sequences"], list):
        raise invalid_type("stop_sequences", "an array of strings")  # unlike OpenAI `stop`, never a bare string
    stops = f.stop_strings(body, "stop_sequences", limit=STOP_SEQUENCES_LIMIT)
    return GenerationOptions(
        max_tokens=max_tokens,
        temperature=f.opt_number(body, "temperature", 0.0, 1.0),
        top_p=f.opt_number(body, "top_p", 0.0, 1.0),
        top_k=f.opt_int(body, "top_k", 0, 20),
        stops=stops,
        thinking_budget=budget,
    )


def check_thinking_budget(budget: int | None, max_tokens: int, *, default: bool = False) -> None:
    """budget_tokens < max_tokens; ``default``: max_tokens was omitted and this is the server's default."""
    if budget is not None and budget >= max_tokens:
        what = f"the server default max_tokens (--default-max-tokens {max_tokens}) that applies when max_tokens " \
               "is omitted" if default else f"max_tokens ({max_tokens})"
        raise invalid_value("thinking.budget_tokens", f"{budget} must be less than {what}.")


def _parse_thinking(body: dict) -> tuple[str | None, int | None]:
    t = f.opt_object(body, "thinking")
    if t is None:
        return None, None
    kind = t.get("type")
    if kind not in ("disabled", "adaptive", "enabled"):
        raise invalid_value("thinking.type", "must be 'disabled', 'adaptive' or 'enabled'.")
    display = t.get("display")
    if display == "omitted":
        raise unsupported("thinking.display", "omitted thinking needs encrypted hidden-reasoning restore, "
                          "which NInfer cannot provide; thinking is returned visibly.")
    if display not in (None, "summarized"):
        raise invalid_value("thinking.display", "must be 'summarized' or 'omitted'.")
    if kind != "enabled":
        return kind, None
    budget = f.opt_int(t, "budget_tokens", param="thinking.budget_tokens")
    if budget is None:
        raise missing("thinking.budget_tokens")
    if budget < MIN_THINKING_BUDGET:
        raise invalid_value("thinking.budget_tokens", f"{budget} is below the minimum {MIN_THINKING_BUDGET}.")
    return kind, budget


def _parse_context_management(body: dict) -> str | None:
    """The location of a keep-all thinking edit, or None when no edit is asked for.

    Claude Code sends ``{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}`` (or no
    edits) on its requests: keep every earlier thinking block in the context, which the template's
    preserve_thinking provides. An edit that removes context (thinking turns, tool uses,
    compaction) needs server-side context editing and is rejected naming it.
    """
    cm = body.get("context_management")
    if cm in (None, [], {}):
        return None
    if not isinstance(cm, dict):
        raise invalid_type("context_management", "an object")
    if set(cm) - {"edits"}:
        raise unsupported("context_management", NO_CONTEXT_EDITING)
    edits = cm.get("edits")
    if edits is None:
        return None
    if not isinstance(edits, list):
        raise invalid_type("context_management.edits", "an array")
    keep_all = None
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        if not isinstance(edit, dict):
            raise invalid_type(where, "an object")
        if edit.get("type") != CLEAR_THINKING:
            raise unsupported(where, NO_CONTEXT_EDITING)
        if edit.get("keep") not in ("all", {"type": "all"}):
            raise unsupported(f"{where}.keep", "clearing earlier thinking turns is server-side context editing, "
                              "which is not available; keep 'all' is executable.")
        keep_all = keep_all or f"{where}.keep"
    return keep_all


def _parse_effort(body: dict) -> str | None:
    oc = f.opt_object(body, "output_config")
    if oc is None:
        return None
    if oc.get("format") is not None:
        raise unsupported("output_config.format", NO_CONSTRAINED_OUTPUT)
    effort = oc.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid_value("output_config.effort", f"must be one of {', '.join(EFFORTS)}.")
    return effort


# --- cache_control ----------------------------------------------------------------------------

class _Breakpoints:
    """Block-level cache_control markers: at most four distinct targets, each with one TTL."""

    def __init__(self) -> None:
        self.targets: dict[str, str] = {}  # target key -> ttl

    def read(self, block: dict, where: str) -> bool:
        """Record the block's marker, if any; a block's target key is its location ``where``."""
        cc = block.get("cache_control")
        if cc is None:
            return False
        ttl = _ttl(cc, f"{where}.cache_control")
        self.targets[where] = ttl
        if len(self.targets) > MAX_BREAKPOINTS:
            raise invalid_value(f"{where}.cache_control", f"at most {MAX_BREAKPOINTS} cache_control breakpoints "
                                "are allowed.")
        return True

    def apply_request_level(self, cc: Any, messages: list[Message]) -> list[Message]:
        """Top-level cache_control targets the last cacheable block (the last text part)."""
        if cc is None:
            return messages
        ttl = _ttl(cc, "cache_control")
        target = _last_part(messages)
        if target is None:
            return messages  # nothing cacheable: a legal advisory hint with no frontier
        mi, pi, key = target
        if key in self.targets:
            if self.targets[key] != ttl:
                raise invalid_value("cache_control", f"ttl {ttl!r} conflicts with the block-level ttl "
                                    f"{self.targets[key]!r} on the same block.")
            return messages  # the same breakpoint: merged
        if len(self.targets) >= MAX_BREAKPOINTS:
            raise invalid_value("cache_control", f"{MAX_BREAKPOINTS} block-level breakpoints already use every "
                                "slot; the request-level breakpoint needs a fifth.")
        self.targets[key] = ttl
        msg = messages[mi]
        parts = list(msg.parts)
        parts[pi] = attrs.evolve(parts[pi], cache_breakpoint=True)
        out = list(messages)
        out[mi] = attrs.evolve(msg, parts=tuple(parts))
        return out


def _ttl(cc: Any, where: str) -> str:
    if not isinstance(cc, dict):
        raise invalid_type(where, "an object")
    if cc.get("type") != "ephemeral":
        raise invalid_value(f"{where}.type", "must be 'ephemeral'.")
    ttl = cc.get("ttl", "5m")
    if ttl not in CACHE_TTLS:
        raise invalid_value(f"{where}.ttl", "must be '5m' or '1h'.")
    return ttl


@attrs.frozen
class _Keyed(Part):
    """A part that remembers which wire block it came from (for request-level cache_control)."""

    key: str = ""


def _last_part(messages: list[Message]) -> tuple[int, int, str] | None:
    for mi in range(len(messages) - 1, -1, -1):
        parts = messages[mi].parts
        for pi in range(len(parts) - 1, -1, -1):
            p = parts[pi]
            if p.text and isinstance(p, _Keyed):
                return mi, pi, p.key
    return None


# --- system -----------------------------------------------------------------------------------

def _parse_system(system: Any, slots: _Breakpoints) -> list[Message]:
    if system is None:
        return []
    if isinstance(system, str):
        return [Message("system", (_Keyed(system, key="system"),))] if system else []
    if not isinstance(system, list):
        raise invalid_type("system", "a string or an array of text blocks")
    parts: list[Part] = []
    for i, block in enumerate(system):
        where = f"system[{i}]"
        if not isinstance(block, dict):
            raise invalid_type(where, "an object")
        if block.get("type") != "text":
            raise invalid_value(f"{where}.type", "system blocks must be text blocks.")
        text = block.get("text")
        if not isinstance(text, str):
            raise invalid_type(f"{where}.text", "a string")
        if i == 0 and text.startswith(BILLING_HEADER):
            continue  # Claude Code attribution: consumed with its cache_control, never prompt content
        marked = slots.read(block, where)
        parts.append(_Keyed(text, marked, key=where))
    return [Message("system", tuple(parts))] if parts else []


# --- messages ---------------------------------------------------------------------------------

@attrs.define
class _Turn:
    """One role's run of wire messages, joined."""

    role: str
    where: str
    reasoning: list[str] = attrs.Factory(list)
    parts: list[Part] = attrs.Factory(list)
    calls: list[ToolCall] = attrs.Factory(list)
    results: list[Result] = attrs.Factory(list)


def _parse_messages(raw: Any, slots: _Breakpoints) -> tuple[list[Message], str | None]:
    if raw is None:
        raise missing("messages")
    if not isinstance(raw, list):
        raise invalid_type("messages", "an array")
    if not raw:
        raise invalid_value("messages", "at least one message is required.")
    turns: list[_Turn] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid_type(where, "an object")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise invalid_value(f"{where}.role", "must be 'user', 'assistant' or 'system'.")
        if not turns or turns[-1].role != role or role == "system":
            turns.append(_Turn(role, where))
        _add_content(turns[-1], m.get("content"), where, slots)
    prefill = _prefill(turns)
    if prefill is not None:
        turns = turns[:-1]
    return _lower(turns), prefill


def _add_content(turn: _Turn, content: Any, where: str, slots: _Breakpoints) -> None:
    if content is None:
        raise missing(f"{where}.content")
    if isinstance(content, str):
        if turn.role == "assistant" and turn.calls:
            _assistant_order(where)
        if content or turn.role == "user":  # an empty user turn stays a turn, as an empty text block does
            turn.parts.append(_Keyed(content, key=where))
        return
    if not isinstance(content, list):
        raise invalid_type(f"{where}.content", "a string or an array of content blocks")
    for j, block in enumerate(content):
        _add_block(turn, block, f"{where}.content[{j}]", slots)


def _add_block(turn: _Turn, block: Any, where: str, slots: _Breakpoints) -> None:
    if not isinstance(block, dict):
        raise invalid_type(where, "an object")
    kind = block.get("type")
    if not isinstance(kind, str):  # a list or object type would not even hash
        raise invalid_type(f"{where}.type", "a string")
    if kind in _UNSUPPORTED_BLOCKS:
        raise unsupported(where, _UNSUPPORTED_BLOCKS[kind])
    role = turn.role
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise invalid_type(f"{where}.text", "a string")
        if role == "assistant" and turn.calls:
            _assistant_order(where)
        marked = slots.read(block, where)
        turn.parts.append(_Keyed(text, marked, key=where))
    elif kind == "image":
        slots.read(block, where)
        raise vision_disabled(where, "image")
    elif kind == "thinking" and role == "assistant":
        text = block.get("thinking")
        if not isinstance(text, str):
            raise invalid_type(f"{where}.thinking", "a string")
        sig = block.get("signature")
        if sig is not None and not isinstance(sig, str):
            raise invalid_type(f"{where}.signature", "a string")  # non-semantic transport metadata
        if block.get("cache_control") is not None:  # no breakpoint on reasoning, but a well-formed marker
            _ttl(block["cache_control"], f"{where}.cache_control")
        if turn.parts or turn.calls:
            _assistant_order(where)
        turn.reasoning.append(text)
    elif kind == "tool_use" and role == "assistant":
        call = _tool_use(block, where)
        turn.calls.append(attrs.evolve(call, cache_breakpoint=slots.read(block, where)))
    elif kind == "tool_result" and role == "user":
        if turn.parts:
            raise ProtocolError("invalid_tool_history", "tool_result blocks must lead their user turn, before "
                                "any text.", where)
        turn.results.append(_tool_result(block, where, slots))
    else:
        raise invalid_value(f"{where}.type", f"block type {kind!r} is not valid in a {role} message.")


def _assistant_order(where: str) -> None:
    raise ProtocolError("invalid_assistant_history", "assistant content must be ordered thinking → text → "
                        "tool_use; this order cannot be represented by the chat template.", where)


def _tool_use(block: dict, where: str) -> ToolCall:
    call_id = block.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid_type(f"{where}.id", "a non-empty string")
    name = block.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_type(f"{where}.name", "a non-empty string")
    args = block.get("input")
    if not isinstance(args, dict):
        raise invalid_type(f"{where}.input", "an object")
    return ToolCall(call_id, name, args)


def _tool_result(block: dict, where: str, slots: _Breakpoints) -> Result:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid_type(f"{where}.tool_use_id", "a non-empty string")
    is_error = f.opt_bool(block, "is_error", f"{where}.is_error")
    marked = slots.read(block, where)
    content = block.get("content", "")
    parts: list[Part] = []
    if isinstance(content, str):
        parts.append(_Keyed(content, marked, key=where))
    elif isinstance(content, list):
        for k, inner in enumerate(content):
            iw = f"{where}.content[{k}]"
            if not isinstance(inner, dict):
                raise invalid_type(iw, "an object")
            if not isinstance(inner.get("type"), str):
                raise invalid_type(f"{iw}.type", "a string")
            if inner.get("type") == "image":
                raise vision_disabled(iw, "image")
            if inner.get("type") != "text":
                if inner.get("type") in _UNSUPPORTED_BLOCKS:
                    raise unsupported(iw, _UNSUPPORTED_BLOCKS[inner["type"]])
                raise invalid_value(f"{iw}.type", "tool results hold text (and image) blocks.")
            text = inner.get("text")
            if not isinstance(text, str):
                raise invalid_type(f"{iw}.text", "a string")
            inner_mark = slots.read(inner, iw)
            parts.append(_Keyed(text, inner_mark, key=iw))
        if marked and parts:
            # The block's marker ends at its last text; request-level cache_control finds it by the block key.
            parts[-1] = attrs.evolve(parts[-1], cache_breakpoint=True, key=where)
    else:
        raise invalid_type(f"{where}.content", "a string or an array of blocks")
    if is_error:
        parts.insert(0, Part(TOOL_ERROR_MARK))
    return Result(call_id, tuple(parts), where)


def _prefill(turns: list[_Turn]) -> str | None:
    last = turns[-1]
    if last.role != "assistant":
        return None
    if last.calls or last.reasoning:
        raise invalid_value(last.where, "a final assistant message is a prefill and may hold only text "
                            "(no thinking, tool_use or media).")
    return "".join(p.text for p in last.parts)


def _lower(turns: list[_Turn]) -> list[Message]:
    out: list[Message] = []
    pending: list[str] = []  # the call ids the next user turn must answer
    for t in turns:
        if t.role == "assistant":
            out.append(Message("assistant", tuple(t.parts), reasoning="".join(t.reasoning) if t.reasoning else None,
                               tool_calls=tuple(t.calls)))
            pending = [c.id for c in t.calls]
            continue
        if t.role == "user":
            # The leading results of a user turn, in the order of the calls they answer.
            out.extend(answer_calls(pending, t.results, id_field="tool_use_id", missing_where=t.where,
                                    opens_history=all(m.role == "system" for m in out)))
            if t.parts or not t.results:  # a turn of only tool results is those results
                out.append(Message("user", tuple(t.parts)))
        else:
            if pending:
                raise ProtocolError("invalid_tool_history", "the tool_use calls must be answered by the next "
                                    "user turn.", t.where)
            out.append(Message("system", tuple(t.parts)))
        pending = []
    return out


# --- tools ------------------------------------------------------------------------------------

def _parse_tools(body: dict, slots: _Breakpoints) -> tuple[tuple[Tool, ...], tuple[str, ...]]:
    raw = body.get("tools")
    tools: list[Tool] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise invalid_type("tools", "an array")
        for i, t in enumerate(raw):
            tools.append(_parse_tool(t, f"tools[{i}]", slots))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid_value("tools", "tool names must be unique.")
    choice = body.get("tool_choice")
    if choice is None:
        return tuple(tools), tuple(names)
    if not isinstance(choice, dict):
        raise invalid_type("tool_choice", "an object")
    kind = choice.get("type")
    if kind in ("any", "tool"):
        raise unsupported("tool_choice", f"tool_choice {kind!r} forces a call, which needs constrained decoding.")
    if kind not in ("auto", "none"):
        raise invalid_value("tool_choice.type", "must be 'auto', 'none', 'any' or 'tool'.")
    callable_names = tuple(names) if kind == "auto" else ()
    if f.opt_bool(choice, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use") and callable_names:
        raise unsupported("tool_choice.disable_parallel_tool_use", NO_SINGLE_CALL)
    return tuple(tools), callable_names


def _parse_tool(t: Any, where: str, slots: _Breakpoints) -> Tool:
    if not isinstance(t, dict):
        raise invalid_type(where, "an object")
    kind = t.get("type")
    if kind not in (None, "custom"):
        raise unsupported(f"{where}.type", f"tool type {kind!r} is an Anthropic-provided or server tool that "
                          "NInfer cannot execute; only user-defined tools are supported.")
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_type(f"{where}.name", "a non-empty string")
    check_executable(t, where)
    schema = t.get("input_schema")
    if schema is None:
        raise missing(f"{where}.input_schema")
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise invalid_value(f"{where}.input_schema", "must be a JSON Schema object with type 'object'.")
    examples = t.get("input_examples")
    if examples is not None and (not isinstance(examples, list) or not all(isinstance(e, dict) for e in examples)):
        raise invalid_type(f"{where}.input_examples", "an array of objects")
    marked = slots.read(t, where)
    return Tool(name, f.opt_str(t, "description", f"{where}.description"), schema,
                tuple(examples) if examples else None, cache_breakpoint=marked)


# --- responses --------------------------------------------------------------------------------

def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def thinking_signature(text: str) -> str:
    """An opaque compatibility signature; lowering ignores it and reads the visible text instead."""
    return "ninfer-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def stop_reason(finish_detail: str, finish_reason: str, saw_tool_use: bool, stop_string: str | None) -> str:
    if stop_string is not None:
        return "stop_sequence"
    if finish_reason == "length":
        return "model_context_window_exceeded" if finish_detail == "context" else "max_tokens"
    return "tool_use" if saw_tool_use else "end_turn"


def usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    """Uncached input, verified reads and output; cache creation is unknown (null)."""
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": None,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def message(mid: str, model: str, content: list[dict], reason: str | None, stop_sequence: str | None,
            use: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence, "usage": use}
