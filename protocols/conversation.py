"""The normalized conversation every API family parses into.

Chat Completions, Responses and Anthropic Messages each turn their wire JSON into one
``Conversation``: ordered messages made of text parts, assistant reasoning and tool calls, tool
results, the declared tools, the template options and the prompt-cache hints. The conversation
then lowers itself to the Hugging Face chat-template ``messages``/``tools``/kwargs that
``ninfer.text.ChatFormatter.render`` takes. Nothing here knows about HTTP or the engine.
"""

from __future__ import annotations

from typing import Any

import attrs

# The template kwargs a client cannot override (the conversation, the generation mode, what the
# tokenizer and the render call provide): defined once, where the template is rendered.
from ninfer.text.chat_template import RESERVED_TEMPLATE_KWARGS
from protocols.errors import ProtocolError

ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
MAX_CACHE_WRITES = 4  # one request carries at most four prefix-capture writes



@attrs.frozen
class Part:
    """One ordered text piece of a message; parts join without separators."""

    text: str
    cache_breakpoint: bool = False  # an explicit prompt-cache marker ends here


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]  # member order as received
    cache_breakpoint: bool = False  # an explicit prompt-cache marker ends with this rendered call


@attrs.frozen
class Message:
    role: str
    parts: tuple[Part, ...] = ()
    reasoning: str | None = None  # assistant reasoning history
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # tool results only

    def __attrs_post_init__(self) -> None:
        assert self.role in ROLES, self.role

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts)

    def to_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@attrs.frozen
class Tool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Example inputs (Anthropic ``input_examples``); they render inside the function's JSON
    # declaration, which is where the chat template shows the model each tool.
    examples: tuple[dict[str, Any], ...] | None = None
    # An explicit prompt-cache marker: the declarations up to this tool form a prefix candidate.
    cache_breakpoint: bool = False

    def to_template(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        if self.examples:
            fn["input_examples"] = list(self.examples)
        return {"type": "function", "function": fn}


@attrs.frozen
class TemplateOptions:
    """Explicit request options; ``None`` means unspecified (server default, then template default)."""

    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None
    reasoning_effort: str | None = None
    kwargs: dict[str, Any] = attrs.field(factory=dict)  # other chat_template_kwargs, passed through


@attrs.frozen
class CacheMark:
    """A prefix-capture candidate: the end of part ``part`` of message ``message``."""

    message: int
    part: int
    explicit: bool


@attrs.frozen
class Conversation:
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()  # declared tools: all are rendered into the prompt
    callable_tools: tuple[str, ...] = ()  # names the output parser may turn into structured calls
    options: TemplateOptions = TemplateOptions()
    implicit_cache: bool = True  # prompt_cache_options.mode != "explicit"
    # Anthropic assistant prefill: the final assistant text that generation continues (the prompt
    # is the generation prompt with this text appended; thinking is off).
    prefill: str | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.to_template() for t in self.tools] or None

    def callable_tool_defs(self) -> list[dict[str, Any]]:
        names = set(self.callable_tools)
        return [t.to_template() for t in self.tools if t.name in names]

    def thinking(self, server_default: bool | None) -> bool | None:
        """Resolved enable_thinking: the request, else the server flag, else None (template default).
        A request's effort is a request option too: "none" turns thinking off, any other value leaves
        it to the template that interprets the effort, whatever the server default (--no-thinking)."""
        opts = self.options
        if opts.enable_thinking is not None:
            return opts.enable_thinking
        if opts.reasoning_effort is not None:
            return False if opts.reasoning_effort == "none" else None
        return server_default

    def template_kwargs(self, *, thinking_default: bool | None, preserve_default: bool | None) -> dict[str, Any]:
        kwargs = dict(self.options.kwargs)
        thinking = self.thinking(thinking_default)
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        preserve = self.options.preserve_thinking
        if preserve is None:
            preserve = preserve_default
        if preserve is not None:
            kwargs["preserve_thinking"] = preserve
        if self.options.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.options.reasoning_effort
        return kwargs

    def cache_marks(self) -> list[CacheMark]:
        """Write candidates: the latest four explicit markers, then the implicit one if a slot is left."""
        explicit = [
            CacheMark(mi, pi, True)
            for mi, m in enumerate(self.messages)
            for pi, p in enumerate(m.parts)
            if p.cache_breakpoint
        ][-MAX_CACHE_WRITES:]
        marks = list(explicit)
        if self.implicit_cache and len(marks) < MAX_CACHE_WRITES:
            last = self._last_content_part()
            if last is not None and all((m.message, m.part) != last for m in marks):
                marks.append(CacheMark(last[0], last[1], False))
        return marks

    def _last_content_part(self) -> tuple[int, int] | None:
        for mi in range(len(self.messages) - 1, -1, -1):
            parts = self.messages[mi].parts
            for pi in range(len(parts) - 1, -1, -1):
                if parts[pi].text:
                    return mi, pi
        return None


def resolve_thinking_options(
    enable_thinking: Any, preserve_thinking: Any, effort: Any, kwargs: dict[str, Any], *,
    fields: dict[str, str] | None = None,
) -> TemplateOptions:
    """Merge typed fields with chat_template_kwargs: duplicated values must agree.

    ``None`` means unspecified. ``fields`` maps an option (``enable_thinking``, ``preserve_thinking``,
    ``reasoning_effort``) to the request field that carries it when the family spells it otherwise
    (Responses ``reasoning.effort``); errors name that field, or the kwarg when the value came from it.
    """
    kwargs = dict(kwargs)
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise ProtocolError(
                "invalid_value",
                f"chat_template_kwargs.{key} cannot be overridden: the request itself defines it.",
                f"chat_template_kwargs.{key}",
            )
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}  # option -> the request field its value came from
    for name, typed in (("enable_thinking", enable_thinking), ("preserve_thinking", preserve_thinking),
                        ("reasoning_effort", effort)):
        field = (fields or {}).get(name, name)
        in_kwargs = kwargs.pop(name, None)  # null standard options mean unspecified
        if typed is not None and in_kwargs is not None and typed != in_kwargs:
            raise ProtocolError(
                "conflicting_template_option",
                f"'{field}' is {typed!r} but chat_template_kwargs.{name} is {in_kwargs!r}.",
                field,
            )
        merged[name] = typed if typed is not None else in_kwargs
        source[name] = field if typed is not None else f"chat_template_kwargs.{name}"
    for name in ("enable_thinking", "preserve_thinking"):
        if merged[name] is not None and not isinstance(merged[name], bool):
            raise ProtocolError("invalid_type", f"'{source[name]}' must be a boolean.", source[name])
    eff = merged["reasoning_effort"]
    if eff is not None and eff not in REASONING_EFFORTS:
        raise ProtocolError("invalid_value", f"'{source['reasoning_effort']}' must be one of "
                            f"{', '.join(REASONING_EFFORTS)}.", source["reasoning_effort"])
    if eff is not None and merged["enable_thinking"] is not None and merged["enable_thinking"] != (eff != "none"):
        raise ProtocolError(
            "conflicting_template_option",
            f"enable_thinking={merged['enable_thinking']} conflicts with reasoning_effort={eff!r}.",
            source["reasoning_effort"],
        )
    return TemplateOptions(merged["enable_thinking"], merged["preserve_thinking"], eff, kwargs)


@attrs.frozen
class GenerationOptions:
    """Output controls shared by every family; ``None`` means unspecified (server/preset default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stops: tuple[str, ...] = ()
    thinking_budget: int | None = None  # per-request cap (Anthropic); None inherits the server default
