"""The ASGI application: routing and the cross-cutting rules every endpoint shares.

Request ids, authentication, CORS and error envelopes live here once; endpoint handlers (health,
metrics, models, chat completions, responses, messages) only see an ``Exchange``. A handler raises
``ProtocolError`` for client-visible failures; anything else is an internal error (500, logged).
"""

from __future__ import annotations

import itertools
import logging
import re
import secrets
from typing import Any, AsyncIterator, Awaitable, Callable

from ninfer.server import sse
from ninfer.server.http import ClientGone, Receive, Request, Send, dumps, send_response
from protocols.errors import ProtocolError

log = logging.getLogger("ninfer.server")

Handler = Callable[["Exchange"], Awaitable[None]]

CORS_HEADERS = [(b"access-control-allow-origin", b"*"), (b"access-control-expose-headers", b"*")]
PREFLIGHT_HEADERS = [
    (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
    # The Fetch standard's wildcard never covers Authorization: a browser's Bearer client needs it named.
    (b"access-control-allow-headers", b"authorization, *"),
    (b"access-control-max-age", b"600"),
]


class Exchange:
    """One HTTP request/response pair as a handler sees it."""

    def __init__(self, app: "App", request: Request, send: Send, family: str, params: dict[str, str]):
        self.app = app
        self.state = app.state
        self.request = request
        self.family = family  # "openai" or "anthropic": error envelope and request-id header
        self.params = params
        self.request_id = _new_request_id(family)
        self._send = send
        self.started = False
        self.payload_bytes: int | None = None  # the raw JSON body's size once json_body has read it

    def headers(self) -> list[tuple[bytes, bytes]]:
        name = b"request-id" if self.family == "anthropic" else b"x-request-id"
        out = [(name, self.request_id.encode())]
        if self.app.cors:
            out += CORS_HEADERS
        return out

    async def json_body(self) -> Any:
        body = await self.request.json(self.app.max_request_bytes)
        self.payload_bytes = self.request.json_bytes
        return body

    async def send_json(self, status: int, obj: Any) -> None:
        self.started = True
        await send_response(self._send, status, dumps(obj), self.headers())

    async def send_text(self, status: int, body: bytes, content_type: bytes,
                        extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.started = True
        await send_response(self._send, status, body, self.headers() + (extra_headers or []), content_type)

    async def send_error(self, err: ProtocolError) -> None:
        if self.family == "anthropic":
            await self.send_json(err.anthropic_status(), err.anthropic_body(self.request_id))
        else:
            await self.send_json(err.status, err.openai_body())

    async def send_sse(self, frames: AsyncIterator[bytes]) -> None:
        self.started = True
        await sse.stream(self._send, self.headers(), frames, self.app.keepalive_s)


def _new_request_id(family: str) -> str:
    """Unique, and in this server instance monotonic (spec: Structured request log): a fixed-width
    counter, then random digits so that ids of different instances do not collide."""
    return ("req_" if family == "anthropic" else "req-") + f"{next(_REQUEST_COUNTER):010x}" + secrets.token_hex(7)


_REQUEST_COUNTER = itertools.count()


class App:
    def __init__(self, state: Any, *, api_key: str | None = None, cors: bool = False,
                 max_request_mib: int = 384, keepalive_s: float = sse.KEEPALIVE_SECONDS):
        self.state = state
        self.api_key = api_key
        self.cors = cors
        self.max_request_bytes = max_request_mib * 1024 * 1024
        self.keepalive_s = keepalive_s
        # Request bodies in memory at once (spec: input memory is bounded by the outstanding-request
        # count and --max-request-mib). Twice the Engine's lifetime capacity: its own reservation (a
        # 429 with its JSONL record) stays the limit a client normally meets, while a flood of uploads
        # that would all be refused anyway cannot hold more than this many bodies.
        self.body_slots = 2 * state.engine.config.lifetime_capacity
        self.bodies = 0  # handlers of body-carrying requests running now (one trio thread: no lock)
        self._routes: list[tuple[str, re.Pattern[str], Handler, str, bool]] = []

    def route(self, method: str, path: str, handler: Handler, *, family: str = "openai",
              public: bool = False) -> None:
        """Register ``handler``; ``{name}`` placeholders become ``exchange.params[name]``."""
        # `{name}` matches one segment; `{name:path}` the rest of the path (model ids may hold "/").
        regex = re.sub(r"\{(\w+):path\}", r"(?P<\1>.+)", path)
        pattern = re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", regex) + "$")
        self._routes.append((method, pattern, handler, family, public))

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        handler, family, public, params, allowed = self._match(request)
        ex = Exchange(self, request, send, family, params)
        if request.method == "OPTIONS":
            await self._preflight(ex)
            return
        try:
            if not public:  # before 404 / 405 too: without the key, the route table is not disclosed
                self._authenticate(request)
            if handler is None:
                if allowed:
                    raise ProtocolError("method_not_allowed", f"{request.method} is not allowed on {request.path}.")
                raise ProtocolError("not_found", f"No route for {request.method} {request.path}.")
            if request.method == "POST":
                await self._with_body_slot(handler, ex)
            else:
                await handler(ex)
        except ProtocolError as err:
            if ex.started:
                self._response_failed()
            else:
                await ex.send_error(err)
        except ClientGone:
            pass
        except Exception:
            # Internal invariant failures stay 500s and are logged; the client sees no internals.
            log.exception("internal error on %s %s (request %s)", request.method, request.path, ex.request_id)
            if ex.started:
                self._response_failed()
            else:
                await ex.send_error(ProtocolError("internal_error", "The server failed to process the request."))

    async def _with_body_slot(self, handler: Handler, ex: Exchange) -> None:
        """Run a POST handler holding one of ``body_slots``; none free: 429 before the body is read."""
        if self.bodies >= self.body_slots:
            raise ProtocolError("server_overloaded", f"The server is at capacity ({self.body_slots} requests "
                                "in flight); retry later.")
        self.bodies += 1
        try:
            await handler(ex)
        finally:
            self.bodies -= 1

    def _response_failed(self) -> None:
        """A failure after the response began (ninfer_response_failures_total)."""
        self.state.metrics.response_failures += 1

    def _match(self, request: Request):
        """(handler or None, family, public, path params, whether another method serves the path).
        A path no route serves is not public; one a public route serves under another method is."""
        allowed = path_public = False
        for method, pattern, handler, family, public in self._routes:
            m = pattern.match(request.path)
            if m is None:
                continue
            if method != request.method:
                allowed = True
                path_public = path_public or public
                continue
            return handler, family, public, m.groupdict(), True
        family = "anthropic" if request.path.startswith("/v1/messages") else "openai"
        return None, family, path_public, {}, allowed

    def _authenticate(self, request: Request) -> None:
        if self.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        bearer = auth[7:] if auth[:7].lower() == "bearer " else None
        # Either header may carry the key (SDKs of both families send their own, some clients both):
        # one that matches is enough, whatever the other says.
        for given in (bearer, request.headers.get("x-api-key")):
            if given is not None and secrets.compare_digest(given.encode(), self.api_key.encode()):
                return
        raise ProtocolError("invalid_api_key", "Missing or invalid API key (Authorization: Bearer or x-api-key).")

    async def _preflight(self, ex: Exchange) -> None:
        # Preflight is never authenticated; without --cors it advertises nothing (a 405 like any
        # other method a path does not serve). Either way it carries the family's request id.
        if self.cors:
            await ex.send_text(204, b"", b"text/plain", PREFLIGHT_HEADERS)
        else:
            await ex.send_error(ProtocolError("method_not_allowed", f"OPTIONS is not allowed on {ex.request.path}."))


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
