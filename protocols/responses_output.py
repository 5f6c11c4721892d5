"""Responses output: decoder events → typed output Items and the semantic SSE event sequence.

``OutputAssembler`` (on the shared ``protocols.assembly.Assembler``) consumes the protocol-neutral
text events (reasoning, content, tool calls) and keeps the output Items as they grow; each ``feed``
returns the SSE events (dicts without ``sequence_number``) that the change produces, so the
aggregate and the streamed Response come from one state machine and concatenated deltas always
equal the terminal Items. A new Item opens whenever the kind of output changes (reasoning →
message → function_call, or text after a call).
"""

from __future__ import annotations

import secrets
import time

from protocols.assembly import Assembler
from protocols.openai_responses import ResponsesRequest, ToolSet, new_id


def response_id() -> str:
    return "resp_" + secrets.token_hex(24)


class OutputAssembler(Assembler):
    REASONING = "reasoning"
    CONTENT = "message"

    def __init__(self, tools: ToolSet):
        super().__init__()
        self.tools = tools

    @property
    def items(self) -> list[dict]:
        return self.units

    def finish(self, status: str) -> list[dict]:
        """Close the open Item; an incomplete Response leaves it ``incomplete``."""
        return self._close("incomplete" if status == "incomplete" else "completed")

    def output(self) -> list[dict]:
        """The output Items so far, the open one included with its text up to now."""
        if self._open is not None:
            _store(self._open, self._joined())
        return self.units

    def _text_unit(self, kind: str) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning", "id": new_id("rs_"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        return {"type": "message", "id": new_id("msg_"), "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}

    def _call_unit(self, name: str) -> dict:
        namespace, name = self.tools.split(name)
        item = {"type": "function_call", "id": new_id("fc_"), "call_id": "call_" + secrets.token_hex(12),
                "name": name, "arguments": "", "status": "in_progress"}
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def _started(self, idx: int, item: dict) -> list[dict]:
        added = {"type": "response.output_item.added", "output_index": idx, "item": _copy(item)}
        if item["type"] == "function_call":
            return [added]
        added["item"]["content"] = []  # the part arrives in its own event
        return [added, {"type": "response.content_part.added", "item_id": item["id"], "output_index": idx,
                        "content_index": 0, "part": dict(item["content"][0])}]

    def _delta(self, idx: int, item: dict, text: str) -> dict:
        kind = item["type"]
        if kind == "function_call":
            return {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": idx,
                    "delta": text}
        if kind == "reasoning":
            return {"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": idx,
                    "content_index": 0, "delta": text}
        return {"type": "response.output_text.delta", "item_id": item["id"], "output_index": idx,
                "content_index": 0, "delta": text, "logprobs": []}

    def _sealed(self, idx: int, item: dict, text: str, status: str) -> list[dict]:
        _store(item, text)
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


def _store(item: dict, text: str) -> None:
    if item["type"] == "function_call":
        item["arguments"] = text
    else:
        item["content"][0]["text"] = text


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
