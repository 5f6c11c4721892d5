"""Anthropic Messages output: decoder events → content blocks and the SSE block lifecycle.

``BlockAssembler`` (on the shared ``protocols.assembly.Assembler``) keeps the content blocks as
they grow and returns, for every decoder event, the ``content_block_start``/``content_block_delta``/
``content_block_stop`` events it produces. Aggregate and streamed Messages therefore come from one
state machine. A thinking block gets its
opaque signature as a ``signature_delta`` just before it closes; a tool_use block streams its
input as ``input_json_delta`` pieces whose concatenation is the final input JSON.
"""

from __future__ import annotations

import json
from protocols.anthropic_messages import thinking_signature, tool_use_id
from protocols.assembly import Assembler


class BlockAssembler(Assembler):
    REASONING = "thinking"
    CONTENT = "text"

    @property
    def blocks(self) -> list[dict]:
        return self.units

    def close(self) -> list[dict]:
        """Close the open block (the end of the output)."""
        return self._close()

    def _text_unit(self, kind: str) -> dict:
        return {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
            {"type": "text", "text": ""}

    def _call_unit(self, name: str) -> dict:
        return {"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}}

    def _started(self, idx: int, unit: dict) -> list[dict]:
        return [{"type": "content_block_start", "index": idx, "content_block": dict(unit)}]

    def _delta(self, idx: int, unit: dict, text: str) -> dict:
        kind = unit["type"]
        if kind == "thinking":
            delta = {"type": "thinking_delta", "thinking": text}
        elif kind == "text":
            delta = {"type": "text_delta", "text": text}
        else:
            delta = {"type": "input_json_delta", "partial_json": text}
        return _delta(idx, delta)

    def _sealed(self, idx: int, unit: dict, text: str, status: str) -> list[dict]:
        events: list[dict] = []
        if unit["type"] == "thinking":
            unit["thinking"] = text
            unit["signature"] = thinking_signature(text)
            events.append(_delta(idx, {"type": "signature_delta", "signature": unit["signature"]}))
        elif unit["type"] == "tool_use":
            unit["input"] = json.loads(text) if text.strip() else {}
        else:
            unit["text"] = text
        return events + [{"type": "content_block_stop", "index": idx}]


def _delta(idx: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": idx, "delta": delta}
