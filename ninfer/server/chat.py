"""POST /v1/chat/completions: aggregate JSON and the SSE chunk sequence over a GenerationSession."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from ninfer.server.app import Exchange
from ninfer.server.generation import Done, GenerationSession, Progress
from ninfer.server.sse import data_frame
from ninfer.text.events import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallEnd, ToolCallStart
from protocols import openai_chat as oc


def _finish_reason(done: Done, saw_tool_call: bool) -> str:
    # A matched stop string ends the output even when the engine also reached max_tokens (in the same
    # step, or in the steps decoded before its stop took effect): that is a stop, not a truncation.
    if done.finish_reason == "length" and done.stop_string is None:
        return "length"
    return "tool_calls" if saw_tool_call else "stop"


async def chat_completions(ex: Exchange) -> None:
    state = ex.state
    body = await ex.json_body()
    req = oc.parse_request(body, state.model_id)
    session = GenerationSession(state, ex.request_id, protocol="openai_chat", stream=req.stream,
                                payload_bytes=ex.payload_bytes)
    # An output-capacity rejection names the spelling the client sent.
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    await session.start(req.conversation, req.generation, params=("messages", limit))
    cid = oc.completion_id()
    created = int(time.time())
    if req.stream:
        await session.respond_stream(ex.request, lambda: ex.send_sse(_stream(session, req, cid, created)))
    else:
        await session.respond(ex.request, lambda: _aggregate(ex, session, req, cid, created))


async def _aggregate(ex: Exchange, session: GenerationSession, req: oc.ChatRequest, cid: str, created: int) -> None:
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, dict] = {}

    def feed(ev: Any) -> None:
        if isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, ContentDelta):
            content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            calls[ev.index] = {"id": oc.tool_call_id(), "type": "function",
                               "function": {"name": ev.name, "arguments": ""}}
        elif isinstance(ev, ToolCallEnd):
            calls[ev.index]["function"]["arguments"] = ev.arguments

    done = await session.collect(feed)
    text = "".join(content)
    body = oc.envelope(cid, created, req.model, "chat.completion")
    message = oc.message(text if (text or not calls) else None, "".join(reasoning) or None,
                         [calls[i] for i in sorted(calls)])
    body["choices"] = [{"index": 0, "message": message, "logprobs": None,
                        "finish_reason": _finish_reason(done, bool(calls))}]
    u = done.usage
    body["usage"] = oc.usage(u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"], u["reasoning_tokens"])
    body["timings"] = done.timings
    await ex.send_json(200, body)


async def _stream(session: GenerationSession, req: oc.ChatRequest, cid: str, created: int) -> AsyncIterator[bytes]:
    base = oc.envelope(cid, created, req.model, "chat.completion.chunk")

    def chunk(choices: list, **extra: Any) -> bytes:
        return data_frame({**base, "choices": choices, **extra})

    yield chunk([oc.chunk_choice({"role": "assistant", "content": ""})])
    saw_tool_call = False
    try:
        async with aclosing(session.events()) as events:
            async for ev in events:
                if isinstance(ev, Progress):
                    if req.return_progress:
                        p = ev.progress
                        yield chunk([], prompt_progress={"total": p.total, "cache": p.cache,
                                                         "processed": p.processed, "time_ms": p.time_ms})
                    continue
                if isinstance(ev, Done):
                    yield _finish_chunk(chunk, ev, req, saw_tool_call)
                    if req.include_usage:
                        u = ev.usage
                        yield chunk([], usage=oc.usage(u["prompt_tokens"], u["completion_tokens"], u["cached_tokens"],
                                                       u["reasoning_tokens"]), timings=ev.timings)
                    continue
                delta = _delta(ev)
                if delta is None:
                    continue
                if "tool_calls" in delta:
                    saw_tool_call = True
                extra = {"timings": session.timings_snapshot()} if req.timings_per_token and "tool_calls" not in delta else {}
                yield chunk([oc.chunk_choice(delta)], **extra)
    except Exception as exc:
        # The stream has started: a failure becomes an error frame (the SDKs raise it), never [DONE].
        yield data_frame(session.stream_failure(exc, "chat completion").openai_body())
        return
    yield b"data: [DONE]\n\n"


def _finish_chunk(chunk, done: Done, req: oc.ChatRequest, saw_tool_call: bool) -> bytes:
    """The finish-reason chunk; it carries the terminal timings unless a usage chunk follows."""
    extra = {} if req.include_usage else {"timings": done.timings}
    return chunk([oc.chunk_choice({}, _finish_reason(done, saw_tool_call))], **extra)


def _delta(ev: Any) -> dict | None:
    if isinstance(ev, ReasoningDelta):
        return {"reasoning_content": ev.text} if ev.text else None
    if isinstance(ev, ContentDelta):
        return {"content": ev.text} if ev.text else None
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": oc.tool_call_id(), "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    if isinstance(ev, ToolCallArgumentsDelta):
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]} if ev.text else None
    return None  # ToolCallEnd: the argument deltas already carried the whole text
