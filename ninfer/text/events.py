"""The protocol-neutral output events that ``ninfer.text.output.OutputDecoder`` produces.

Each API family turns these into its own wire shape (Chat Completions deltas, Responses SSE items,
Anthropic content blocks). Text deltas carry only newly visible text; tool-call events carry a
0-based ``index`` that counts structured calls across the whole output.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class ReasoningDelta:
    """Visible text of the reasoning channel (between ``<think>`` and ``</think>``)."""

    text: str


@attrs.frozen
class ContentDelta:
    """Visible answer text, including tool-call markup that fell back to text."""

    text: str


@attrs.frozen
class ToolCallStart:
    """A structured call begins; ``name`` is a declared tool."""

    index: int
    name: str


@attrs.frozen
class ToolCallArgumentsDelta:
    """A piece of the call's arguments JSON; the pieces of one index concatenate to the final text."""

    index: int
    text: str


@attrs.frozen
class ToolCallEnd:
    """The call is complete; ``arguments`` is the full JSON object text (parameter order kept)."""

    index: int
    arguments: str


@attrs.frozen
class StopMatched:
    """A stop string matched; no text at or after it is emitted and the caller stops the request."""

    stop: str


TextEvent = ReasoningDelta | ContentDelta
ToolCallEvent = ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd
OutputEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd | StopMatched
