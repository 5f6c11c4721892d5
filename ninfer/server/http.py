"""Minimal ASGI primitives: the request view, bounded body reading, JSON responses, disconnects.

We speak ASGI directly (hypercorn's trio worker is the only host) instead of adding a web
framework: the server needs a handful of routes and full control over streaming and cancellation.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

import trio

from protocols.errors import ProtocolError
from protocols.fields import loads_unpaired_surrogate

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]

JSON_TYPE = b"application/json"


class ClientGone(Exception):
    """The client disconnected; whatever it asked for is cancelled."""


class Request:
    def __init__(self, scope: dict, receive: Receive):
        self.scope = scope
        self.receive = receive
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {}
        for k, v in scope.get("headers", []):
            self.headers[k.decode("latin-1").lower()] = v.decode("latin-1")
        self.json_bytes: int | None = None  # size of the raw body ``json`` parsed (the request log's payload_bytes)

    async def body(self, limit_bytes: int) -> bytes:
        """Read the whole body, failing with 413 as soon as it passes ``limit_bytes`` (before parsing)."""
        declared = self.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
            await self._discard_rest()  # known too large: never buffer it
            raise _too_large(limit_bytes)
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            chunk = msg.get("body", b"")
            size += len(chunk)
            more = msg.get("more_body", False)
            if size > limit_bytes:
                chunks.clear()  # nothing past the limit is kept or parsed
                if more:
                    await self._discard_rest()
                raise _too_large(limit_bytes)
            chunks.append(chunk)
            if not more:
                return b"".join(chunks)

    async def _discard_rest(self) -> None:
        # Reading (and dropping) the rest lets an HTTP/1.1 client that is still sending see the 413.
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            if not msg.get("more_body", False):
                return

    async def json(self, limit_bytes: int) -> Any:
        raw = await self.body(limit_bytes)
        self.json_bytes = len(raw)
        try:
            body = json.loads(raw)
            unpaired = loads_unpaired_surrogate(raw, body)
        # ValueError: not JSON, not UTF-8, or an integer past Python's digit limit.
        except ValueError as e:
            raise ProtocolError("invalid_json", f"The request body is not valid JSON: {e}.") from None
        except RecursionError:
            raise ProtocolError("invalid_json", "The request body nests too deeply to decode.") from None
        if unpaired:
            raise ProtocolError("invalid_json", "The request body is not valid JSON: a string holds an unpaired "
                                "UTF-16 surrogate escape (\\ud800-\\udfff), which is no Unicode text.")
        return body

    async def wait_disconnect(self) -> None:
        """Return when the client goes away (call only after the body was read)."""
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                return


def _too_large(limit_bytes: int) -> ProtocolError:
    return ProtocolError(
        "request_too_large",
        f"The request body exceeds the {limit_bytes // (1024 * 1024)} MiB limit (--max-request-mib).",
    )


def dumps(obj: Any) -> bytes:
    # ensure_ascii=False keeps UTF-8 text readable on the wire; separators keep frames compact.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


async def send_response(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]],
                        content_type: bytes = JSON_TYPE) -> None:
    all_headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def run_until_disconnect(request: Request, work: Callable[[], Awaitable[None]]) -> bool:
    """Run ``work`` while watching for a disconnect; return False if the client went away first.

    Leaving the cancelled ``work`` is what cancels an engine request (its handle's iterator closes).
    """
    finished = False

    async def watch(cancel: trio.CancelScope) -> None:
        await request.wait_disconnect()
        cancel.cancel()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery.cancel_scope)
            await work()
            finished = True
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # Only ``work`` can fail; surface its exception itself so handlers see a ProtocolError.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return finished
