"""Streaming parser for Qwen's XML tool-call format in the content channel.

The model writes calls after its answer text, one block per call, possibly several in a row::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Ordinary text streams at once; only a tail that could start ``<tool_call>`` and the tool-call region
itself are held. The region is every call from its ``<tool_call>`` up to the end of the output,
with only whitespace between and after the calls. It becomes structured calls only when the output
ends that way, because any of these turns the whole region back into text, byte for byte
(the fallback reason in brackets):

* markup that does not follow the grammar, or an output that ends inside a call
  [malformed_structure] — this includes an unmatched nested ``<parameter=...>`` opener inside a
  value and a standalone ``</parameter>``, which the format cannot represent unambiguously;
* the same parameter twice in one call [duplicate_parameter];
* a function name that is not a valid tool name [invalid_tool_name] or names no declared tool
  [undeclared_tool];
* non-whitespace text after a complete call that is not another call [trailing_content] — the
  chat template can only replay answer text before the calls.

So the tool-call events of a region come at ``finish()``: ``ToolCallStart``, one
``ToolCallArgumentsDelta`` per parameter (their concatenation is the arguments JSON) and
``ToolCallEnd``. Emitting earlier would promise calls that a later byte may take back.

Parameter values are the text between ``<parameter=P>`` and its ``</parameter>`` minus one leading
and one trailing newline. A value may hold any markup; nested ``<parameter=...>``/``</parameter>``
pairs are balanced, so the closing tag is the one that brings the nesting back to zero. Values are
converted by the declared schema (``ninfer.text.tool_values``), and the arguments JSON keeps the
parameter order of the output. After a fallback the parser keeps scanning, so a later well-formed
region at the end of the output still becomes calls.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ninfer.text.events import ContentDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from ninfer.text.holdback import partial_marker_suffix
from ninfer.text.tool_values import Outcome, admitted_types, convert_parameter

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# Tool names as OpenAI and Anthropic define them; a declared name is accepted whatever its spelling.
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A tag name longer than this is not a tag: stop waiting for its ">".
MAX_TAG_NAME = 256
_NAME_BREAKERS = ("\n", "<", ">")


class FallbackReason(enum.Enum):
    NONE = "none"
    MALFORMED_STRUCTURE = "malformed_structure"
    DUPLICATE_PARAMETER = "duplicate_parameter"
    INVALID_TOOL_NAME = "invalid_tool_name"
    UNDECLARED_TOOL = "undeclared_tool"
    TRAILING_CONTENT = "trailing_content"


class _State(enum.Enum):
    TEXT = enum.auto()  # ordinary content, watching for <tool_call>
    CALL_OPENED = enum.auto()  # after <tool_call>: expect <function=
    FUNCTION_NAME = enum.auto()  # inside <function=...>
    FUNCTION_BODY = enum.auto()  # expect <parameter= or </function>
    PARAMETER_NAME = enum.auto()  # inside <parameter=...>
    PARAMETER_VALUE = enum.auto()  # value text up to the balancing </parameter>
    FUNCTION_CLOSED = enum.auto()  # after </function>: expect </tool_call>
    CALL_CLOSED = enum.auto()  # after </tool_call>: another <tool_call>, whitespace or the end


class _Fallback(Exception):
    def __init__(self, reason: FallbackReason) -> None:
        self.reason = reason


@attrs.define
class _Call:
    name: str
    properties: Mapping[str, Any]
    arguments: list[tuple[str, Any]] = attrs.Factory(list)
    names: set[str] = attrs.Factory(set)
    omitted: int = 0
    mismatched: int = 0


def declared_tools(tools: Iterable[Any] | None) -> dict[str, Mapping[str, Any]]:
    """Map each declared tool name to its parameter ``properties``.

    Accepts ``protocols.conversation.Tool``-like objects (``.name``, ``.parameters``) and the wire
    shapes of the three API families: ``{"type": "function", "function": {...}}``,
    ``{"name", "parameters"}`` and ``{"name", "input_schema"}``.
    """
    out: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools or ()):
        if isinstance(tool, Mapping):
            fn = tool["function"] if isinstance(tool.get("function"), Mapping) else tool
            name = fn.get("name")
            schema = fn.get("parameters", fn.get("input_schema"))
        else:
            name = getattr(tool, "name", None)
            schema = getattr(tool, "parameters", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool {i} has no name")
        properties = schema.get("properties") if isinstance(schema, Mapping) else None
        out[name] = properties if isinstance(properties, Mapping) else {}
    return out


class ToolCallParser:
    """Streaming parser: ``feed(text)`` and ``finish()`` return content and tool-call events."""

    def __init__(self, tools: Iterable[Any] | None) -> None:
        self._tools = declared_tools(tools)
        self._state = _State.TEXT
        self._buf = ""  # text received and not consumed yet
        self._raw: list[str] = []  # the current region's consumed text, for a byte-exact fallback
        self._region: list[_Call] = []  # complete calls of the current region
        self._call: _Call | None = None
        self._param = ""  # name of the parameter being read
        self._value: list[str] = []
        self._depth = 0  # nested <parameter=...> openers inside the current value
        self._out: list[Any] = []
        self._finished = False
        self._steps = self._step_table()
        self._tail = ""  # last characters passed through, to notice a marker split across feeds
        self.marker_seen = False
        self.structured_calls = 0
        self.empty_non_string_omitted = 0
        self.schema_mismatch_preserved = 0
        self.fallback_reason = FallbackReason.NONE

    @property
    def diagnostics(self) -> dict[str, Any]:
        """The request log's ``tool_call_parse`` record (no arguments, no generated text)."""
        return {
            "marker_seen": self.marker_seen,
            "structured_calls": self.structured_calls,
            "empty_non_string_omitted": self.empty_non_string_omitted,
            "schema_mismatch_preserved": self.schema_mismatch_preserved,
            "fallback_reason": self.fallback_reason.value,
        }

    def feed(self, text: str) -> list[Any]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        self._run()
        return self._take()

    def finish(self) -> list[Any]:
        if self._finished:
            return []
        self._finished = True
        if self._state is _State.TEXT:
            self._text(self._buf)
        elif self._state is _State.CALL_CLOSED and not self._buf.strip():
            self._confirm_region()
        elif self._state is _State.CALL_CLOSED:
            # A held "<", "<tool_" ...: the output ended on text after the calls, not on another call.
            self._fall_back(FallbackReason.TRAILING_CONTENT, rest=self._buf)
        else:
            self._fall_back(FallbackReason.MALFORMED_STRUCTURE, rest=self._buf)
        self._buf = ""
        return self._take()

    # -- driving -----------------------------------------------------------------------------

    def _run(self) -> None:
        steps = self._steps
        while self._buf:
            try:
                if not steps[self._state]():
                    return  # waiting for more text
            except _Fallback as fallback:
                self._fall_back(fallback.reason)

    def _step_table(self) -> dict[_State, Any]:
        return {
            _State.TEXT: self._scan_text,
            _State.CALL_OPENED: self._after_call_open,
            _State.FUNCTION_NAME: self._function_name,
            _State.FUNCTION_BODY: self._function_body,
            _State.PARAMETER_NAME: self._parameter_name,
            _State.PARAMETER_VALUE: self._parameter_value,
            _State.FUNCTION_CLOSED: self._function_closed,
            _State.CALL_CLOSED: self._call_closed,
        }

    def _take(self) -> list[Any]:
        out, self._out = self._out, []
        return out

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._out and isinstance(self._out[-1], ContentDelta):
            self._out[-1] = ContentDelta(self._out[-1].text + text)
        else:
            self._out.append(ContentDelta(text))

    def _consume(self, n: int) -> str:
        piece, self._buf = self._buf[:n], self._buf[n:]
        self._raw.append(piece)
        return piece

    def _expect(self, literals: tuple[str, ...], reason: FallbackReason) -> str | None:
        """Skip whitespace, then consume one of ``literals``; None while the text could still become one."""
        rest = self._buf.lstrip()
        if len(rest) < len(self._buf):
            self._consume(len(self._buf) - len(rest))
        for literal in literals:
            if rest.startswith(literal):
                self._consume(len(literal))
                return literal
        if any(literal.startswith(rest) for literal in literals):
            return None
        raise _Fallback(reason)

    def _read_name(self) -> str | None:
        """The tag name up to ``>`` (consumed with it); None while it is still arriving."""
        end = len(self._buf)
        for breaker in _NAME_BREAKERS:
            at = self._buf.find(breaker)
            if at >= 0:
                end = min(end, at)
        if end == len(self._buf):
            if end > MAX_TAG_NAME:
                raise _Fallback(FallbackReason.MALFORMED_STRUCTURE)
            return None
        if self._buf[end] != ">" or end > MAX_TAG_NAME:
            raise _Fallback(FallbackReason.MALFORMED_STRUCTURE)
        name = self._consume(end)
        self._consume(1)
        return name

    # -- states --------------------------------------------------------------------------------

    def _scan_text(self) -> bool:
        if not self._tools:
            return self._pass_through()
        at = self._buf.find(TOOL_CALL_OPEN)
        if at < 0:
            keep = partial_marker_suffix(self._buf, (TOOL_CALL_OPEN,))
            self._text(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._text(self._buf[:at])
        self._buf = self._buf[at:]
        self._raw = []
        self._consume(len(TOOL_CALL_OPEN))
        self.marker_seen = True
        self._state = _State.CALL_OPENED
        return True

    def _pass_through(self) -> bool:
        """No callable tool: every call would fall back, so nothing is held; markers are only noted."""
        window = self._tail + self._buf
        self.marker_seen = self.marker_seen or TOOL_CALL_OPEN in window
        self._tail = window[-(len(TOOL_CALL_OPEN) - 1):]
        self._text(self._buf)
        self._buf = ""
        return False

    def _after_call_open(self) -> bool:
        if self._expect((FUNCTION_OPEN,), FallbackReason.MALFORMED_STRUCTURE) is None:
            return False
        self._state = _State.FUNCTION_NAME
        return True

    def _function_name(self) -> bool:
        name = self._read_name()
        if name is None:
            return False
        if name not in self._tools:
            raise _Fallback(FallbackReason.UNDECLARED_TOOL if TOOL_NAME_RE.fullmatch(name)
                            else FallbackReason.INVALID_TOOL_NAME)
        self._call = _Call(name, self._tools[name])
        self._state = _State.FUNCTION_BODY
        return True

    def _function_body(self) -> bool:
        tag = self._expect((PARAMETER_OPEN, FUNCTION_CLOSE), FallbackReason.MALFORMED_STRUCTURE)
        if tag is None:
            return False
        self._state = _State.PARAMETER_NAME if tag == PARAMETER_OPEN else _State.FUNCTION_CLOSED
        return True

    def _parameter_name(self) -> bool:
        name = self._read_name()
        if name is None:
            return False
        assert self._call is not None
        if not name:
            raise _Fallback(FallbackReason.MALFORMED_STRUCTURE)
        if name in self._call.names:
            raise _Fallback(FallbackReason.DUPLICATE_PARAMETER)
        self._call.names.add(name)
        self._param, self._value, self._depth = name, [], 0
        self._state = _State.PARAMETER_VALUE
        return True

    def _parameter_value(self) -> bool:
        lt = self._buf.find("<")
        if lt < 0:
            self._value.append(self._consume(len(self._buf)))
            return False
        if lt:
            self._value.append(self._consume(lt))
        rest = self._buf
        if rest.startswith(PARAMETER_CLOSE):
            self._consume(len(PARAMETER_CLOSE))
            if self._depth == 0:
                self._end_parameter()
                return True
            self._depth -= 1
            self._value.append(PARAMETER_CLOSE)
            return True
        opener = self._nested_opener(rest)
        if opener is None:
            return False  # could still become a tag
        if opener:
            self._depth += 1
            self._value.append(self._consume(len(opener)))
        else:
            self._value.append(self._consume(1))  # a literal "<"
        return True

    @staticmethod
    def _nested_opener(rest: str) -> str | None:
        """At a "<" inside a value: the complete ``<parameter=NAME>`` tag, "" for a literal "<",
        or None while the text could still become a tag."""
        if not rest.startswith(PARAMETER_OPEN):
            could_be_tag = PARAMETER_OPEN.startswith(rest) or PARAMETER_CLOSE.startswith(rest)
            return None if could_be_tag else ""
        tail = rest[len(PARAMETER_OPEN):]
        end = min((at for at in (tail.find(b) for b in _NAME_BREAKERS) if at >= 0), default=-1)
        if end < 0:
            return None if len(tail) <= MAX_TAG_NAME else ""
        if tail[end] == ">" and 0 < end <= MAX_TAG_NAME:
            return rest[:len(PARAMETER_OPEN) + end + 1]
        return ""

    def _end_parameter(self) -> None:
        assert self._call is not None
        text = "".join(self._value)
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        outcome, value = convert_parameter(text, admitted_types(self._call.properties.get(self._param)))
        if outcome is Outcome.OMITTED:
            self._call.omitted += 1
        else:
            self._call.mismatched += outcome is Outcome.MISMATCH
            self._call.arguments.append((self._param, value))
        self._value = []
        self._state = _State.FUNCTION_BODY

    def _function_closed(self) -> bool:
        if self._expect((TOOL_CALL_CLOSE,), FallbackReason.MALFORMED_STRUCTURE) is None:
            return False
        assert self._call is not None
        self._region.append(self._call)
        self._call = None
        self._state = _State.CALL_CLOSED
        return True

    def _call_closed(self) -> bool:
        if self._expect((TOOL_CALL_OPEN,), FallbackReason.TRAILING_CONTENT) is None:
            return False
        self._state = _State.CALL_OPENED
        return True

    # -- outcomes ------------------------------------------------------------------------------

    def _fall_back(self, reason: FallbackReason, rest: str = "") -> None:
        """The whole region so far becomes text; scanning resumes on the unconsumed text."""
        self._text("".join(self._raw) + rest)
        if self.fallback_reason is FallbackReason.NONE:
            self.fallback_reason = reason
        self._raw, self._region, self._call, self._value = [], [], None, []
        self._state = _State.TEXT

    def _confirm_region(self) -> None:
        for call in self._region:
            index = self.structured_calls
            self.structured_calls += 1
            self.empty_non_string_omitted += call.omitted
            self.schema_mismatch_preserved += call.mismatched
            self._out.append(ToolCallStart(index, call.name))
            pieces = arguments_pieces(call.arguments)
            self._out.extend(ToolCallArgumentsDelta(index, piece) for piece in pieces)
            self._out.append(ToolCallEnd(index, "".join(pieces)))
        self._raw, self._region = [], []


def arguments_pieces(arguments: list[tuple[str, Any]]) -> list[str]:
    """The arguments JSON object in parameter order, cut into one piece per parameter."""
    if not arguments:
        return ["{}"]
    pieces = []
    for i, (name, value) in enumerate(arguments):
        member = json.dumps(name, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        pieces.append(("{" if i == 0 else ", ") + member)
    pieces[-1] += "}"
    return pieces
