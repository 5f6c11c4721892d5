"""The /v1/responses endpoints: create (JSON or semantic SSE), the local store, input_tokens.

Create parses the request, expands the stored parent chain, and drives one ``GenerationSession``
(the same path as Chat Completions). Output events go through one ``OutputAssembler`` so the
aggregate Response and the SSE deltas always agree. Errors before the stream starts are ordinary
HTTP errors; after it starts they become ``response.failed``.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from contextlib import aclosing
from typing import AsyncIterator

import attrs

from ninfer.server.app import Exchange
from ninfer.server.generation import Done, GenerationSession, Progress
from ninfer.server.response_store import ResponseStore, StoredResponse, page
from ninfer.server.sse import data_frame
from protocols import fields as f
from protocols import openai_responses as orp
from protocols import responses_output as out
from protocols.conversation import Conversation
from protocols.errors import ProtocolError, invalid_value, unsupported

log = logging.getLogger("ninfer.server")

SESSION_PREFIX = "resp:"


@attrs.define
class _Plan:
    """A parsed create request with its parent chain expanded."""

    req: orp.ResponsesRequest
    conv: Conversation
    history: tuple[dict, ...]
    session_key: str | None
    capture_endpoint: bool
    # The child sets preserve_thinking unlike its parent: a new semantic branch (the spec's
    # "Responses semantic-change flag" of request_start).
    semantic_change: bool


def _pairs(ex: Exchange) -> list[tuple[str, str]]:
    raw = ex.request.scope.get("query_string", b"").decode("latin-1")
    return urllib.parse.parse_qsl(raw, keep_blank_values=True)


def _query(ex: Exchange) -> dict[str, str]:
    return dict(_pairs(ex))  # a repeated key keeps its last value


def _asks_include(ex: Exchange) -> bool:
    """Whether any ``include`` value is non-empty: the SDK repeats the key per value, and ``_query``
    keeps only the last, which an empty trailing value would hide."""
    return any(v for k, v in _pairs(ex) if k in ("include", "include[]"))


def _store(ex: Exchange) -> ResponseStore:
    return ex.state.response_store


def _plan(ex: Exchange, req: orp.ResponsesRequest, rid: str) -> _Plan:
    parent: StoredResponse | None = None
    if req.previous_response_id is not None:
        try:
            parent = _store(ex).get(req.previous_response_id)
        except ProtocolError as e:
            raise ProtocolError(e.code, e.message, "previous_response_id") from None
    history = parent.context if parent else ()
    conv = orp.build_conversation(history, req, parent.preserve_thinking if parent else None)
    if not any(m.role == "user" for m in conv.messages) and not any(m.role == "tool" for m in conv.messages):
        raise invalid_value("input", "the conversation has no user input to respond to.")
    if parent is not None:
        # The chain shares one session key; a store:false child reads it but does not move its endpoint.
        key, capture = parent.session_key, req.store
    else:
        key, capture = (SESSION_PREFIX + rid if req.store else None), True
    explicit = req.options.preserve_thinking
    branch = parent is not None and explicit is not None and explicit != parent.preserve_thinking
    return _Plan(req, conv, history, key, capture, branch)


def _shape(req: orp.ResponsesRequest, plan: _Plan | None) -> dict:
    """The Responses members of the logged request shape (the session adds the conversation's);
    without a plan (its parent or history refused) the stored chain's are null."""
    return {"items": len(req.items), "history_items": len(plan.history) if plan else None, "store": req.store,
            "previous_response_id": req.previous_response_id is not None,
            "semantic_change": plan.semantic_change if plan else None}


async def create(ex: Exchange) -> None:
    state = ex.state
    req = orp.parse_request(await ex.json_body(), state.model_id)
    rid = out.response_id()
    session = GenerationSession(state, ex.request_id, protocol="openai_responses", stream=req.stream,
                                payload_bytes=ex.payload_bytes)
    try:  # preparation: the stored parent and the conversation it continues
        plan = _plan(ex, req, rid)
    except ProtocolError as err:
        session.reject(err, req.options, _shape(req, None))
    await session.start(plan.conv, req.generation, shape=_shape(req, plan), session_key=plan.session_key,
                        capture_endpoint=plan.capture_endpoint, params=("input", "max_output_tokens"),
                        requested=req.options)
    created = time.time()
    if req.stream:
        await session.respond_stream(ex.request, lambda: ex.send_sse(_stream(ex, session, plan, rid, created)))
    else:
        await session.respond(ex.request, lambda: _aggregate(ex, session, plan, rid, created))


def _terminal(plan: _Plan, rid: str, created: float, asm: out.OutputAssembler,
              done: Done) -> tuple[dict, list[dict]]:
    """The terminal Response and the closing events of the open Item."""
    status = out.status_of(done.finish_reason)
    events = asm.finish(status)
    u = done.usage
    use = out.usage(u["prompt_tokens"], u["cached_tokens"], u["completion_tokens"], u["reasoning_tokens"])
    return out.response_object(rid, plan.req, created, status, asm.output(), use), events


def _keep(ex: Exchange, plan: _Plan, response: dict) -> None:
    """Store the terminal Response where the request asks (``store``)."""
    if not plan.req.store:
        return
    try:
        _store(ex).put(response, plan.req.items, plan.history, plan.conv.options.preserve_thinking,
                       plan.session_key)
    except ProtocolError as e:  # an operational response event: no second JSONL terminal
        log.warning("response %s (request %s) not stored: %s", response["id"], ex.request_id, e.code)
        raise


async def _aggregate(ex: Exchange, session: GenerationSession, plan: _Plan, rid: str, created: float) -> None:
    asm = out.OutputAssembler(plan.req.tools)
    done = await session.collect(asm.feed)
    response, _ = _terminal(plan, rid, created, asm, done)
    try:
        _keep(ex, plan, response)
    except ProtocolError:  # after generation: a response failure, as a stream's response.failed is
        ex.state.metrics.response_failures += 1
        raise
    await ex.send_json(200, response)


CANCELLED = {"code": "cancelled", "message": "The request was cancelled before the Response finished."}


async def _stream(ex: Exchange, session: GenerationSession, plan: _Plan, rid: str,
                  created: float) -> AsyncIterator[bytes]:
    seq = 0

    def frame(event: dict) -> bytes:
        nonlocal seq
        event = {"type": event["type"], "sequence_number": seq, **{k: v for k, v in event.items() if k != "type"}}
        seq += 1
        return data_frame(event, event["type"])

    asm = out.OutputAssembler(plan.req.tools)
    initial = out.response_object(rid, plan.req, created, "in_progress", [], None)
    yield frame({"type": "response.created", "response": initial})
    yield frame({"type": "response.in_progress", "response": initial})
    try:
        async with aclosing(session.events()) as events:
            async for ev in events:
                if isinstance(ev, Progress):
                    continue
                if isinstance(ev, Done) and out.status_of(ev.finish_reason) == "cancelled":
                    # OpenAI's stream has no cancelled terminal event: a Response the engine cancelled
                    # while the client still reads ends as failed (status and event agree), carries why
                    # in its error, and, like every failed stream, is not stored.
                    u = ev.usage
                    use = out.usage(u["prompt_tokens"], u["cached_tokens"], u["completion_tokens"],
                                    u["reasoning_tokens"])
                    failed = out.response_object(rid, plan.req, created, "failed", asm.output(), use, CANCELLED)
                    yield frame({"type": "response.failed", "response": failed})
                    continue
                if isinstance(ev, Done):
                    response, closing = _terminal(plan, rid, created, asm, ev)
                    for e in closing:  # the open Item closes on the wire before the store can fail
                        yield frame(e)
                    _keep(ex, plan, response)
                    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}[response["status"]]
                    yield frame({"type": kind, "response": response})
                    continue
                for e in asm.feed(ev):
                    yield frame(e)
    except Exception as exc:  # the stream has started: every failure ends it with response.failed
        err = session.stream_failure(exc, "Response")
        error = {"code": err.code, "message": err.message}
        failed = out.response_object(rid, plan.req, created, "failed", asm.output(), None, error)
        yield frame({"type": "response.failed", "response": failed})


# --- the local store --------------------------------------------------------------------------

async def retrieve(ex: Exchange) -> None:
    query = _query(ex)
    if query.get("stream") not in (None, "false"):
        raise unsupported("stream", "stream recovery of a finished Response is not supported.")
    if "starting_after" in query:
        raise unsupported("starting_after", "stream recovery of a finished Response is not supported.")
    if _asks_include(ex):
        raise unsupported("include", "no optional output data is available from this server.")
    await ex.send_json(200, _store(ex).get(ex.params["response_id"]).response)


async def delete(ex: Exchange) -> None:
    rid = ex.params["response_id"]
    _store(ex).delete(rid)
    await ex.send_json(200, {"id": rid, "object": "response.deleted", "deleted": True})


async def input_items(ex: Exchange) -> None:
    rec = _store(ex).get(ex.params["response_id"])
    query = _query(ex)
    limit = query.get("limit", "20")
    if not limit.lstrip("-").isdigit():
        raise ProtocolError("invalid_type", "'limit' must be an integer.", "limit")
    lim = f.opt_int({"limit": int(limit)}, "limit", 1, 100)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid_value("order", "must be 'asc' or 'desc'.")
    if _asks_include(ex):
        raise unsupported("include", "no optional Item data is available from this server.")
    await ex.send_json(200, page(rec.input_items, after=query.get("after"), limit=lim, order=order))


async def cancel(ex: Exchange) -> None:
    _store(ex).get(ex.params["response_id"])
    raise unsupported("background", "only background Responses can be cancelled, and background execution is "
                      "not supported: every Response ran to completion in the foreground.")


async def compact(ex: Exchange) -> None:
    raise ProtocolError("compaction_not_supported", "Response compaction is not supported by this server.")


async def input_tokens(ex: Exchange) -> None:
    state = ex.state
    req = orp.parse_request(await ex.json_body(), state.model_id, count_only=True)
    plan = _plan(ex, req, "")
    prepared = await state.prompts.prepare_async(plan.conv)  # off the event loop, like create
    await ex.send_json(200, {"object": "response.input_tokens", "input_tokens": len(prepared.token_ids)})


def install(app) -> None:
    app.route("POST", "/v1/responses", create)
    app.route("POST", "/v1/responses/input_tokens", input_tokens)
    app.route("POST", "/v1/responses/compact", compact)
    app.route("GET", "/v1/responses/{response_id}", retrieve)
    app.route("DELETE", "/v1/responses/{response_id}", delete)
    app.route("GET", "/v1/responses/{response_id}/input_items", input_items)
    app.route("POST", "/v1/responses/{response_id}/cancel", cancel)
