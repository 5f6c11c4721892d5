"""Responses output: decoder events → typed output Items and the semantic SSE event sequence.

``OutputAssembler`` consumes the protocol-neutral text events (reasoning, content, tool calls) and
keeps the output Items as they grow; each ``feed`` returns the SSE events (dicts without
``sequence_number``) that the change produces, so the aggregate and the streamed Response come
from one state machine and concatenated deltas always equal the terminal Items. A new Item opens
whenever the kind of output changes (reasoning → message → function_call, or text after a call).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from ninfer.text.events import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from protocols.openai_responses import ResponsesRequest, ToolSet, new_id


def response_id() -> str:
    return "resp_" + secrets.token_hex(24)


class OutputAssembler:
    def __init__(self, tools: ToolSet):
        self.tools = tools
        self.items: list[dict] = []
        self._open: dict | None = None  # the Item receiving deltas
        # The open Item's text (or arguments) as pieces, joined when it closes: appending to one
        # growing string would copy the whole output on every token.
        self._buf: list[str] = []
        self._calls: dict[int, int] = {}  # decoder call index -> output index

    def feed(self, ev: Any) -> list[dict]:
        if isinstance(ev, ReasoningDelta):
            return self._text("reasoning", ev.text) if ev.text else []
        if isinstance(ev, ContentDelta):
            return self._text("message", ev.text) if ev.text else []
        if isinstance(ev, ToolCallStart):
            return self._call_start(ev)
        if isinstance(ev, ToolCallArgumentsDelta):
            return self._call_delta(ev) if ev.text else []
        if isinstance(ev, ToolCallEnd):
            return self._call_end(ev)
        return []

    def finish(self, status: str) -> list[dict]:
        """Close the open Item; an incomplete Response leaves it ``incomplete``."""
        return self._close("incomplete" if status == "incomplete" else "completed")

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def output(self) -> list[dict]:
        """The output Items so far, the open one included with its text up to now."""
        if self._open is not None:
            self._store("".join(self._buf))
        return self.items

    def _joined(self) -> str:
        text = "".join(self._buf)
        self._buf = [text]
        return text

    def _store(self, text: str) -> None:
        item = self._open
        if item["type"] == "function_call":
            item["arguments"] = text
        else:
            item["content"][0]["text"] = text

    # -- text Items ------------------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._start_text(kind)
        item = self._open
        self._buf.append(text)
        idx = len(self.items) - 1
        if kind == "reasoning":
            events.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": idx,
                           "content_index": 0, "delta": text})
        else:
            events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": idx,
                           "content_index": 0, "delta": text, "logprobs": []})
        return events

    def _start_text(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": new_id("msg_"), "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        idx = len(self.items)
        events = [{"type": "response.output_item.added", "output_index": idx, "item": _copy(item)},
                  {"type": "response.content_part.added", "item_id": item["id"], "output_index": idx,
                   "content_index": 0, "part": dict(part)}]
        item["content"].append(part)
        self.items.append(item)
        self._open = item
        self._buf = []
        return events

    # -- function calls --------------------------------------------------------------------------

    def _call_start(self, ev: ToolCallStart) -> list[dict]:
        events = self._close("completed")
        namespace, name = self.tools.split(ev.name)
        item = {"type": "function_call", "id": new_id("fc_"), "call_id": "call_" + secrets.token_hex(12),
                "name": name, "arguments": "", "status": "in_progress"}
        if namespace is not None:
            item["namespace"] = namespace
        idx = len(self.items)
        self.items.append(item)
        self._open = item
        self._buf = []
        self._calls[ev.index] = idx
        events.append({"type": "response.output_item.added", "output_index": idx, "item": _copy(item)})
        return events

    def _call_delta(self, ev: ToolCallArgumentsDelta) -> list[dict]:
        idx = self._calls[ev.index]
        item = self.items[idx]
        assert item is self._open, "argument deltas for a call that is not open"
        self._buf.append(ev.text)
        return [{"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": idx,
                 "delta": ev.text}]

    def _call_end(self, ev: ToolCallEnd) -> list[dict]:
        idx = self._calls[ev.index]
        item = self.items[idx]
        events: list[dict] = []
        seen = self._joined()
        if ev.arguments != seen:
            # The decoder guarantees deltas concatenate to the final text; send any remainder so
            # the stream still adds up even if it did not.
            assert ev.arguments.startswith(seen), "tool-call deltas diverged from the final arguments"
            rest = ev.arguments[len(seen):]
            self._buf = [ev.arguments]
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": idx, "delta": rest})
        return events + self._close("completed")

    # -- closing ---------------------------------------------------------------------------------

    def _close(self, status: str) -> list[dict]:
        item = self._open
        if item is None:
            return []
        self._store("".join(self._buf))
        self._open, self._buf = None, []
        idx = len(self.items) - 1  # the open Item is always the latest
        item["status"] = status
        if item["type"] == "function_call":
            return [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": idx,
                     "name": item["name"], "arguments": item["arguments"]},
                    {"type": "response.output_item.done", "output_index": idx, "item": _copy(item)}]
        part = item["content"][0]
        if item["type"] == "reasoning":
            done = {"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": idx,
                    "content_index": 0, "text": part["text"]}
            item.pop("status")  # reasoning Items carry no status in finished output
        else:
            done = {"type": "response.output_text.done", "item_id": item["id"], "output_index": idx,
                    "content_index": 0, "text": part["text"], "logprobs": []}
        return [done,
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": idx,
                 "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": idx, "item": _copy(item)}]


def _copy(item: dict) -> dict:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out


# --- the Response object ----------------------------------------------------------------------

def usage(prompt_tokens: int, cached: int, output_tokens: int, reasoning: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(rid: str, req: ResponsesRequest, created_at: float, status: str, output: list[dict],
                    use: dict | None, error: dict | None = None) -> dict:
    """A Response in any lifecycle status; ``completed_at`` only when completed."""
    echo = req.echo
    return {
        "id": rid, "object": "response", "created_at": int(created_at), "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo["instructions"], "max_output_tokens": echo["max_output_tokens"],
        "max_tool_calls": echo["max_tool_calls"], "model": req.model, "output": output,
        "parallel_tool_calls": echo["parallel_tool_calls"], "previous_response_id": req.previous_response_id,
        "reasoning": echo["reasoning"], "service_tier": "default", "store": req.store,
        "temperature": echo["temperature"], "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": echo["tool_choice"], "tools": echo["tools"], "top_logprobs": 0, "top_p": echo["top_p"],
        "truncation": "disabled", "usage": use, "user": echo["user"], "metadata": req.metadata,
        "background": False, "prompt_cache_key": echo["prompt_cache_key"],
        "safety_identifier": echo["safety_identifier"],
    }


def status_of(finish_reason: str) -> str:
    """Engine finish → Response status: capacity exhaustion is incomplete, a cancel is cancelled."""
    return {"length": "incomplete", "cancelled": "cancelled"}.get(finish_reason, "completed")
