"""Server-sent events: frames from a producer, plus `: keep-alive` comments when it goes quiet.

The comment is transport-only (SSE clients ignore it); it exists so that a dead peer is noticed
by TCP while a request waits or prefills. The producer runs in its own task so a slow protocol
event never delays the heartbeat.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator

import trio

from ninfer.server.http import Send, dumps

KEEPALIVE_SECONDS = 5.0
KEEPALIVE_FRAME = b": keep-alive\n\n"
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def data_frame(obj: Any, event: str | None = None) -> bytes:
    """One SSE frame; ``event`` names it (Responses/Anthropic), Chat Completions uses data only."""
    payload = obj.encode() if isinstance(obj, str) else dumps(obj)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"


async def stream(send: Send, headers: list[tuple[bytes, bytes]], frames: AsyncIterator[bytes],
                 keepalive_s: float = KEEPALIVE_SECONDS) -> None:
    """Send a 200 event stream of ``frames``; a comment goes out after each quiet ``keepalive_s``."""
    await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *headers]})
    tx, rx = trio.open_memory_channel[bytes](0)

    async def produce() -> None:
        # Close the frames at once when the client goes away: the family's cleanup (the engine
        # request's cancel, its terminal log record) runs now, not when the generator is collected.
        async with tx, aclosing(frames):
            async for frame in frames:
                await tx.send(frame)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        async with rx:
            while True:
                frame = None
                with trio.move_on_after(keepalive_s):
                    try:
                        frame = await rx.receive()
                    except trio.EndOfChannel:
                        break
                await send({"type": "http.response.body", "body": frame or KEEPALIVE_FRAME, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
