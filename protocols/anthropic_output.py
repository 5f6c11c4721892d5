"""Anthropic Messages output: decoder events → content blocks and the SSE block lifecycle.

``BlockAssembler`` keeps the content blocks as they grow and returns, for every decoder event,
the ``content_block_start``/``content_block_delta``/``content_block_stop`` events it produces.
Aggregate and streamed Messages therefore come from one state machine. A thinking block gets its
opaque signature as a ``signature_delta`` just before it closes; a tool_use block streams its
input as ``input_json_delta`` pieces whose concatenation is the final input JSON.
"""

from __future__ import annotations

import json
from typing import Any

from ninfer.text.events import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from protocols.anthropic_messages import thinking_signature, tool_use_id


class BlockAssembler:
    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open: dict | None = None
        # The open block's text (or tool input JSON) as pieces, joined when it closes: appending
        # to one growing string would copy the whole output on every token.
        self._buf: list[str] = []
        self._calls: dict[int, int] = {}  # decoder call index -> block index

    @property
    def saw_tool_use(self) -> bool:
        return bool(self._calls)

    def feed(self, ev: Any) -> list[dict]:
        if isinstance(ev, ReasoningDelta):
            return self._text("thinking", ev.text) if ev.text else []
        if isinstance(ev, ContentDelta):
            return self._text("text", ev.text) if ev.text else []
        if isinstance(ev, ToolCallStart):
            return self._tool_start(ev)
        if isinstance(ev, ToolCallArgumentsDelta):
            return self._tool_delta(self._calls[ev.index], ev.text) if ev.text else []
        if isinstance(ev, ToolCallEnd):
            idx = self._calls[ev.index]
            seen = "".join(self._buf)
            self._buf = [seen]
            assert ev.arguments.startswith(seen), "tool-call deltas diverged from the final arguments"
            events = self._tool_delta(idx, ev.arguments[len(seen):]) if len(ev.arguments) > len(seen) else []
            return events + self.close()
        return []

    def close(self) -> list[dict]:
        block = self._open
        if block is None:
            return []
        text = "".join(self._buf)
        self._open, self._buf = None, []
        idx = len(self.blocks) - 1  # the open block is always the latest
        events: list[dict] = []
        if block["type"] == "thinking":
            block["thinking"] = text
            block["signature"] = thinking_signature(text)
            events.append(_delta(idx, {"type": "signature_delta", "signature": block["signature"]}))
        elif block["type"] == "tool_use":
            block["input"] = json.loads(text) if text.strip() else {}
        else:
            block["text"] = text
        return events + [{"type": "content_block_stop", "index": idx}]

    def _start(self, block: dict, wire: dict) -> list[dict]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        self._buf = []
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": wire}]

    def _text(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events += self._start(dict(empty), dict(empty))
        self._buf.append(text)
        idx = len(self.blocks) - 1
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return events + [_delta(idx, delta)]

    def _tool_start(self, ev: ToolCallStart) -> list[dict]:
        block = {"type": "tool_use", "id": tool_use_id(), "name": ev.name, "input": {}}
        events = self._start(block, dict(block, input={}))
        idx = len(self.blocks) - 1
        self._calls[ev.index] = idx
        return events

    def _tool_delta(self, idx: int, text: str) -> list[dict]:
        assert self._open is self.blocks[idx], "input deltas for a tool_use block that is not open"
        self._buf.append(text)
        return [_delta(idx, {"type": "input_json_delta", "partial_json": text})]


def _delta(idx: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": idx, "delta": delta}
