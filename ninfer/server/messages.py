"""POST /v1/messages (aggregate JSON or Anthropic SSE) and POST /v1/messages/count_tokens.

Both run the same normalization (``protocols.anthropic_messages``) and prompt path as every other
family. Streaming sends ``message_start`` only once the engine has admitted the request (its first
progress event), so the uncached/cache-read split in it is already exact.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from ninfer.server.app import Exchange
from ninfer.server.generation import Done, GenerationSession, Progress
from ninfer.server.sse import data_frame
from protocols import anthropic_messages as am
from protocols.anthropic_output import BlockAssembler


async def create(ex: Exchange) -> None:
    req = am.parse_request(await ex.json_body())
    if req.generation.max_tokens is None:  # the server default applies: the budget must fit it too
        am.check_thinking_budget(req.generation.thinking_budget, ex.state.prompts.defaults.max_tokens, default=True)
    session = GenerationSession(ex.state, ex.request_id, protocol="anthropic_messages", stream=req.stream,
                                payload_bytes=ex.payload_bytes)
    await session.start(req.conversation, req.generation,
                        shape={"thinking": req.thinking_mode, "prefill": req.conversation.prefill is not None})
    mid = am.message_id()
    if req.stream:
        await session.respond_stream(ex.request, lambda: ex.send_sse(_stream(ex, session, req, mid)))
    else:
        await session.respond(ex.request, lambda: _aggregate(ex, session, req, mid))


def _final(done: Done, asm: BlockAssembler) -> tuple[str, str | None, dict]:
    fin = done.finished
    reason = am.stop_reason(fin.detail, done.finish_reason, asm.has_calls, done.stop_string)
    u = done.usage
    return reason, done.stop_string, am.usage(u["prompt_tokens"], u["cached_tokens"], u["completion_tokens"])


async def _aggregate(ex: Exchange, session: GenerationSession, req: am.MessagesRequest, mid: str) -> None:
    asm = BlockAssembler()
    done = await session.collect(asm.feed)
    asm.close()
    reason, stop_seq, use = _final(done, asm)
    await ex.send_json(200, am.message(mid, req.model, asm.blocks, reason, stop_seq, use))


def _frame(event: dict) -> bytes:
    return data_frame(event, event["type"])


async def _stream(ex: Exchange, session: GenerationSession, req: am.MessagesRequest,
                  mid: str) -> AsyncIterator[bytes]:
    asm = BlockAssembler()
    started = False

    def start(prompt_tokens: int, cached: int) -> list[bytes]:
        nonlocal started
        started = True
        msg = am.message(mid, req.model, [], None, None, am.usage(prompt_tokens, cached, 0))
        return [_frame({"type": "message_start", "message": msg}), _frame({"type": "ping"})]

    try:
        async with aclosing(session.events()) as events:
            async for ev in events:
                if isinstance(ev, Progress):
                    if not started:  # admission: the reuse split is decided
                        for b in start(ev.progress.total, ev.progress.cache):
                            yield b
                    continue
                if isinstance(ev, Done):
                    if not started:
                        for b in start(ev.usage["prompt_tokens"], ev.usage["cached_tokens"]):
                            yield b
                    for e in asm.close():
                        yield _frame(e)
                    reason, stop_seq, use = _final(ev, asm)
                    yield _frame({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_seq},
                                  "usage": use})
                    yield _frame({"type": "message_stop"})
                    continue
                if not started:
                    raise RuntimeError("output before admission progress")
                for e in asm.feed(ev):
                    yield _frame(e)
    except Exception as exc:  # the stream has started: the failure becomes an Anthropic error event
        yield _frame(session.stream_failure(exc, "message").anthropic_body(ex.request_id))


async def count_tokens(ex: Exchange) -> None:
    req = am.parse_request(await ex.json_body(), count_only=True)
    prepared = await ex.state.prompts.prepare_async(req.conversation)  # off the event loop, like create
    await ex.send_json(200, {"input_tokens": len(prepared.token_ids)})


def install(app) -> None:
    app.route("POST", "/v1/messages", create, family="anthropic")
    app.route("POST", "/v1/messages/count_tokens", count_tokens, family="anthropic")
