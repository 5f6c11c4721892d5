"""Tool definitions and tool history rules that more than one API family shares.

``arguments`` reads a function call's JSON-object argument string (Chat Completions, Responses).
``check_executable`` refuses the tool-definition flags whose semantics need an executor or
constrained decoding (Responses, Anthropic Messages). ``answer_calls`` matches the results that
follow an assistant turn to its calls and puts them in call order (Responses, Anthropic Messages).
"""

from __future__ import annotations

import json
from typing import Sequence

import attrs

from protocols.conversation import Message, Part
from protocols.errors import NO_STRICT_TOOLS, ProtocolError, invalid_type, invalid_value, unsupported
from protocols.fields import loads_unpaired_surrogate


def arguments(raw: str, where: str) -> dict:
    """A call's arguments: a JSON object string (blank means no arguments)."""
    try:
        args = json.loads(raw) if raw.strip() else {}
        # The server refuses such escapes in the request body; here they sit one JSON level deeper.
        unpaired = loads_unpaired_surrogate(raw, args)
    except json.JSONDecodeError as e:
        raise invalid_value(where, f"not valid JSON ({e.msg}).") from None
    except RecursionError:  # the decoder's stack ends long before the request size limit does
        raise invalid_value(where, "the JSON nests too deeply to decode.") from None
    except ValueError:  # valid JSON that Python refuses: an integer beyond its digit limit
        raise invalid_value(where, "an integer in the JSON has too many digits to decode.") from None
    if unpaired:
        raise invalid_value(where, "a string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), which "
                            "is no Unicode text.")
    if not isinstance(args, dict):
        raise invalid_value(where, "must encode a JSON object.")
    return args


def check_executable(tool: dict, where: str) -> None:
    """Refuse definition flags NInfer cannot honour: each needs constrained decoding or an executor."""
    for flag in ("strict", "defer_loading"):
        if tool.get(flag) is not None and not isinstance(tool[flag], bool):
            raise invalid_type(f"{where}.{flag}", "a boolean")
    if tool.get("strict") is True:
        raise unsupported(f"{where}.strict", NO_STRICT_TOOLS)
    if tool.get("defer_loading") is True:
        raise unsupported(f"{where}.defer_loading", "deferred tool loading needs a tool-search executor.")
    callers = tool.get("allowed_callers")
    if callers is not None and (not isinstance(callers, list) or "direct" not in callers):
        raise unsupported(f"{where}.allowed_callers", "a tool the model cannot call directly needs an executor "
                          "NInfer does not have.")


@attrs.frozen
class Result:
    """One tool result as received: the call it answers, its content and its location."""

    call_id: str
    parts: tuple[Part, ...]
    where: str


def answer_calls(calls: Sequence[str], results: Sequence[Result], *, id_field: str, opens_history: bool,
                 missing_where: str) -> list[Message]:
    """Tool messages for the calls of the preceding assistant turn, in call order.

    Each result must answer one of ``calls`` (its ``id_field`` names the error), once, and every call
    needs a result. A call id the turn declares twice cannot be answered: one result would have to
    stand for both calls. Results with no calls before them and nothing else before
    (``opens_history``) are a truncated or imported history: they are kept, in client order.
    """
    if not calls and opens_history:
        return [Message("tool", r.parts, tool_call_id=r.call_id) for r in results]
    repeated = next((c for i, c in enumerate(calls) if c in calls[:i]), None)
    if repeated is not None:
        where = next((f"{r.where}.{id_field}" for r in results if r.call_id == repeated), missing_where)
        raise ProtocolError("invalid_tool_history", f"the preceding assistant turn declares call id {repeated!r} "
                            "twice, so no result can identify one of its calls.", where)
    by_id: dict[str, Result] = {}
    for r in results:
        if r.call_id not in calls:
            raise ProtocolError("invalid_tool_history", f"{id_field} {r.call_id!r} answers no call of the preceding "
                                "assistant turn.", f"{r.where}.{id_field}")
        if r.call_id in by_id:
            raise ProtocolError("invalid_tool_history", f"{id_field} {r.call_id!r} is answered twice.",
                                f"{r.where}.{id_field}")
        by_id[r.call_id] = r
    missing = [c for c in calls if c not in by_id]
    if missing:
        raise ProtocolError("invalid_tool_history", "a partial result set cannot be represented: every call of the "
                            f"preceding assistant turn needs one result; missing {', '.join(missing)}.", missing_where)
    return [Message("tool", by_id[c].parts, tool_call_id=c) for c in calls]
