"""The generation session every API family drives: prepare → submit → events → result.

A family handler parses its wire JSON into a ``Conversation`` and ``GenerationOptions``, then:

    session = GenerationSession(state, request_id, protocol="openai_chat", stream=...)
    await session.start(conversation, options)     # raises ProtocolError (HTTP error response)
    await session.respond(request, work)           # work: async for ev in session.events(): ...
                                                   # (Progress | OutputEvent | Done), then the reply

``start`` reserves engine capacity first (so preparation counts against it), renders and tokenizes
the prompt (``ninfer.server.prompt.PromptBuilder``, on a worker thread), and submits. ``events`` feeds committed tokens through the ``OutputDecoder`` (reasoning,
content, tool calls, stop strings) on the request's own task and ends with one ``Done`` carrying
usage, llama.cpp timings and the engine's ``Finished``. Leaving ``events`` early (client gone)
cancels the engine request; the capacity slot is held until ``respond`` has written the reply. The
session also writes the request's metrics-independent records:
the JSONL request_start / request_rejected / request_done / request_error events and stderr lines.
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, NoReturn

import attrs
import trio

from ninfer.engine import GenerationRequest, SamplingOverrides
from ninfer.engine import errors as engine_errors
from ninfer.engine.events import Finished, PromptProgress, TokenDelta
from ninfer.engine.stats import HOST_PHASES
from ninfer.server.http import Request, run_until_disconnect
from ninfer.server.prompt import PreparedPrompt, PromptBuilder
from ninfer.text.output import OutputDecoder, StopMatched
from protocols.conversation import Conversation, GenerationOptions
from protocols.errors import ProtocolError

log = logging.getLogger("ninfer.server")


# --- events a family consumes ------------------------------------------------------------------

@attrs.frozen
class Progress:
    progress: PromptProgress


@attrs.frozen
class Done:
    finished: Finished
    finish_reason: str  # "stop" | "length" | "cancelled" (families map tool calls themselves)
    stop_string: str | None
    usage: dict  # prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens
    timings: dict  # llama.cpp ``timings`` object


def llama_timings(cache_n: int, prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float) -> dict:
    """llama.cpp ``timings``: the first token belongs to prompt time; rates are finite zeros when empty."""
    prompt_ms = prompt_s * 1000.0
    predicted_ms = predicted_s * 1000.0
    intervals = max(predicted_n - 1, 0)
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n * 1000.0 / prompt_ms if prompt_n and prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / intervals if intervals else 0.0,
        "predicted_per_second": intervals * 1000.0 / predicted_ms if intervals and predicted_ms > 0 else 0.0,
    }


class GenerationSession:
    def __init__(self, state: Any, request_id: str, *, protocol: str, stream: bool,
                 payload_bytes: int | None = None):
        self.state = state
        self.request_id = request_id
        self.protocol = protocol
        self.stream = stream
        self.seq = state.request_log.next_seq() if state.request_log else None
        self.handle: Any = None
        self._ticket: Any = None  # the Engine capacity slot, from start() to the end of respond()
        self.decoder: OutputDecoder | None = None
        self.prepared: PreparedPrompt | None = None
        self.t0 = time.monotonic()
        # Local observations for timings_per_token snapshots.
        self._admitted_at: float | None = None
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._cache_n = 0
        self.committed = 0
        self._ended = False  # its terminal record (request_done or request_error) is written
        self._shape: dict = {}
        self._session: tuple[str | None, bool] = (None, True)
        self._requested: Any = None  # the thinking options the request named (start())
        self.prepare_seconds: float | None = None
        self.payload_bytes = payload_bytes  # the raw JSON body the request came from
        self.acquisition_seconds: float | None = None  # preparation entry → capacity ticket held
        self._config: dict = {}  # the resolved request configuration request_start logged
        self._first: Any = None  # the engine's first event, taken by admitted() before a stream starts

    # -- start ------------------------------------------------------------------------------------

    async def start(self, conv: Conversation, gen: GenerationOptions, *, shape: dict | None = None,
                    session_key: str | None = None, capture_endpoint: bool = True,
                    params: tuple[str, str] = ("messages", "max_tokens"), requested: Any = None) -> None:
        """``params``: the family's names of the prompt and of the output limit, which a rejection
        for the context or the output capacity names (Responses: ``input``, ``max_output_tokens``).
        ``requested``: the options the request itself named, where the conversation's carry inherited
        ones (a Responses child): the JSONL records log the explicit options, null when unspecified."""
        self._params = params
        self._requested = requested if requested is not None else conv.options
        # The request's shape for the JSONL records: the conversation's counts, then family members.
        self._shape = {"messages": len(conv.messages), "tools": len(conv.tools),
                       "callable_tools": len(conv.callable_tools), "stream": self.stream, **(shape or {})}
        self._session = (session_key, capture_endpoint)  # Responses chains (engine-local reuse)
        state = self.state
        try:
            ticket = state.engine.reserve()
        except engine_errors.Overloaded as e:
            self._reject(ProtocolError("server_overloaded", f"The server is at capacity ({e.capacity} requests); "
                                       "retry later."))
        except engine_errors.EngineUnavailable:
            self._reject(ProtocolError("engine_unavailable", "The engine is not available."))
        # reserve() never waits (a full Engine answers 429 above): Engine FIFO waiting comes after
        # submission, in timings_seconds.queue.
        self.acquisition_seconds = time.monotonic() - self.t0
        # Held until respond() ends, not only until the Engine's outcome: a finished result whose
        # response is still being written counts against the lifetime capacity (spec).
        self._ticket = ticket.__enter__()
        try:
            try:
                prepared = await state.prompts.prepare_async(conv)
            except ProtocolError as err:
                self._reject(err)
            self._submit(ticket, conv, gen, prepared)
        except BaseException:
            ticket.release()
            raise

    def _submit(self, ticket: Any, conv: Conversation, gen: GenerationOptions, prepared: PreparedPrompt) -> None:
        builder: PromptBuilder = self.state.prompts
        max_tokens = gen.max_tokens if gen.max_tokens is not None else builder.defaults.max_tokens
        budget = gen.thinking_budget if gen.thinking_budget is not None else builder.defaults.thinking_budget
        request = GenerationRequest(
            prompt=prepared.token_ids,
            max_tokens=max_tokens,
            # The engine's sampler fields, by name: a field the protocols do not carry fails loudly here.
            sampling=SamplingOverrides(**{a.name: getattr(gen, a.name) for a in attrs.fields(SamplingOverrides)}),
            thinking=builder.thinking_control(prepared, budget),
            input_checkpoint=prepared.input_checkpoint,
            cache_boundaries=prepared.cache_boundaries,  # at most four: Conversation.cache_marks
            request_id=self.request_id,
            session_key=self._session[0],
            capture_endpoint=self._session[1],
        )
        try:
            self.handle = ticket.submit(request)
        except engine_errors.ContextLengthExceeded as e:
            self._reject(ProtocolError("context_length_exceeded", self._too_long(e), self._params[0],
                                       prompt_tokens=e.prompt_tokens, max_context_tokens=e.limit))
        except engine_errors.ThinkingBudgetCapacityInsufficient as e:
            self._reject(ProtocolError("thinking_budget_capacity_insufficient", str(e), self._params[1]))
        except engine_errors.EngineUnavailable:
            self._reject(ProtocolError("engine_unavailable", "The engine is not available."))
        except engine_errors.InvalidPrompt as e:  # any other ValueError is ours: a 500 with its log record
            self._reject(ProtocolError("invalid_prompt", f"The prepared request is invalid: {e}"))
        self.prepared = prepared
        self.prepare_seconds = time.monotonic() - self.t0
        tools = conv.callable_tool_defs()
        self.decoder = OutputDecoder(builder.tokenizer, starts_in_thinking=prepared.starts_in_thinking,
                                     tools=tools or None, stops=list(gen.stops), tool_parsing=bool(tools))
        self._log_start(conv, gen, request)

    def _too_long(self, e: engine_errors.ContextLengthExceeded) -> str:
        if self.protocol == "anthropic_messages":
            # Anthropic's own wording, which clients such as Claude Code read to start compacting; the
            # maximum is the longest prompt that leaves the one output position a create needs.
            return f"prompt is too long: {e.prompt_tokens} tokens > {e.limit - 1} maximum"
        if e.prompt_tokens <= e.limit:  # it fits alone, not with the output position a generation needs
            return (f"The prompt has {e.prompt_tokens} tokens, which leaves no room for an output token "
                    f"within the context ceiling of {e.limit} tokens.")
        return f"The prompt has {e.prompt_tokens} tokens; the context ceiling is {e.limit} tokens."

    def reject(self, err: ProtocolError, requested: Any, shape: dict) -> NoReturn:
        """A preparation failure before ``start`` (a Responses request's stored parent or the history
        it continues): its request_rejected record, then ``err`` raised."""
        self._requested, self._shape = requested, {"stream": self.stream, **shape}
        self._reject(err)

    def _reject(self, err: ProtocolError) -> NoReturn:
        # The status and type the client receives: Anthropic's family has its own (529 for 429).
        if self.protocol == "anthropic_messages":
            status, kind = err.anthropic_status(), err.kind.anthropic_type
        else:
            status, kind = err.status, err.kind.openai_type
        rl = self.state.request_log
        if rl is not None:
            rl.write("request_rejected", request_id=self.request_id, request_seq=self.seq, protocol=self.protocol,
                     phase="prepare", shape=self._shape, requested_reasoning_effort=self._requested.reasoning_effort,
                     media_items=0, status=status, type=kind, code=err.code, param=err.param, message=err.message)
        log.info("request %s rejected: %d %s", self.request_id, status, err.code)
        self.state.metrics.rejected += 1  # a generation attempt that entered preparation
        raise err

    def _log_start(self, conv: Conversation, gen: GenerationOptions, request: GenerationRequest) -> None:
        log.info("request %s started: %s, %d prompt tokens, max_tokens %d%s", self.request_id, self.protocol,
                 len(request.prompt), request.max_tokens, ", stream" if self.stream else "")
        rl = self.state.request_log
        if rl is None:
            return
        # request_error repeats this configuration: a request without an outcome still says what it asked for.
        self._config = dict(
            stream=self.stream, shape=self._shape, sampling=_resolved_sampling(self.handle.sampling),
            max_tokens=request.max_tokens, requested_reasoning_effort=self._requested.reasoning_effort,
            enable_thinking=request.thinking.starts_in_thinking, preserve_thinking=self._requested.preserve_thinking,
            thinking_budget=request.thinking.budget, prompt_tokens=len(request.prompt),
            stop_strings=len(gen.stops), cache_boundaries=list(request.cache_boundaries))
        prepared = self.prepared
        rl.write("request_start", request_id=self.request_id, request_seq=self.seq, protocol=self.protocol,
                 **self._config, payload_bytes=self.payload_bytes, acquisition_seconds=self.acquisition_seconds,
                 # cache: null, the builder keeps no cache of rendered or tokenized prompts.
                 tokenizer={"seconds": prepared.tokenizer_seconds, "tokens": len(prepared.token_ids),
                            "cache_hint_seconds": prepared.cache_hint_seconds, "cache": None},
                 # No Vision in this build: a media request is refused before preparation (vision_disabled).
                 media={"items": 0, "wall_seconds": None, "work_seconds": None, "cache": None})

    # -- events -----------------------------------------------------------------------------------

    async def admitted(self) -> None:
        """Wait for the engine's first event (the request is admitted), kept for ``events``: a stream
        starts only then, so a request never admitted gets its 503 request_queue_timeout as a plain
        error response (spec: Execution behavior), not inside a started 200 stream."""
        assert self.handle is not None and self._first is None
        try:
            self._first = await self.handle.__anext__()
        except (engine_errors.QueueTimeout, engine_errors.EngineUnavailable) as e:
            raise self._engine_failure(e) from None

    async def _engine_events(self) -> AsyncIterator[Any]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for ev in self.handle:
            yield ev

    def _engine_failure(self, e: Exception) -> ProtocolError:
        """The terminal record of an engine-side end (not admitted in time, or an engine failure),
        and the error the client gets."""
        if isinstance(e, engine_errors.QueueTimeout):
            self._error("queue", str(e))
            return ProtocolError("request_queue_timeout", f"The request was not admitted in time: {e}.")
        self._error("generation", str(e))
        log.error("request %s: engine failure: %s", self.request_id, e)
        return ProtocolError("engine_unavailable", "The engine failed while generating.")

    async def events(self) -> AsyncIterator[Any]:
        assert self.handle is not None and self.decoder is not None
        finished: Finished | None = None
        try:
            async for ev in self._engine_events():
                if isinstance(ev, PromptProgress):
                    # Events reach us a step late or coalesced, never early: the earliest admission
                    # any of them implies is the closest to the engine's (timings_per_token).
                    admitted = time.monotonic() - ev.time_ms / 1000.0
                    if self._admitted_at is None:
                        self._cache_n = ev.cache
                    self._admitted_at = min(admitted, self._admitted_at or admitted)
                    yield Progress(ev)
                elif isinstance(ev, TokenDelta):
                    now = time.monotonic()
                    self._first_token_at = self._first_token_at or now
                    self._last_token_at = now
                    self.committed += len(ev.token_ids)
                    for out in self.decoder.push(ev.token_ids):
                        if isinstance(out, StopMatched):  # the output ends at the matching token
                            self.handle.stop(self.decoder.stop_tokens)
                        else:
                            yield out
                elif isinstance(ev, Finished):
                    finished = ev
        except (engine_errors.QueueTimeout, engine_errors.EngineUnavailable) as e:
            raise self._engine_failure(e) from None
        except BaseException as e:
            # Cancellation (client gone) or an internal failure: one terminal record, request_error
            # unless the client left after the engine had returned the outcome.
            if _is_cancel(e):
                self._end_unread("cancelled", type(e).__name__)
            else:
                self._error("generation", type(e).__name__)
            raise
        finally:
            await self.aclose()
        if finished is None:
            self._error("generation", "the engine ended the request without an outcome")
            raise RuntimeError("engine handle ended without a Finished event")
        # The outcome exists: flush the decoder and write request_done now, before the trailing
        # output reaches the consumer, so a client leaving during that output cannot drop the terminal.
        tail = [out for out in self.decoder.finish() if not isinstance(out, StopMatched)]
        done = self._done(finished)
        for out in tail:
            yield out
        yield done

    async def aclose(self) -> None:
        """Cancel the engine request if it is still running (idempotent); ``respond`` gives the
        capacity slot back once the response is written."""
        if self.handle is not None:
            await self.handle.aclose()

    async def respond(self, request: Request, work: Callable[[], Awaitable[None]]) -> None:
        """Run the family's response ``work`` until it ends or the client goes away.

        The engine request never outlives it, and its terminal record is written, even when ``work``
        ends before consuming ``events`` (a stream whose first send finds the client gone never
        starts its generator).
        """
        try:
            await run_until_disconnect(request, work)
        except BaseException as e:
            self._end_unrecorded("cancelled" if _is_cancel(e) else "generation", type(e).__name__)
            raise
        else:
            # Work that returns without having recorded the outcome was cancelled by the disconnect.
            self._end_unrecorded("cancelled", "the client went away before the response started")
        finally:
            await self.aclose()
            if self._ticket is not None:
                self._ticket.release()  # the response is written (or abandoned): the capacity slot is free

    async def respond_stream(self, request: Request, send_stream: Callable[[], Awaitable[None]]) -> None:
        """``respond`` for a streamed response: ``send_stream`` starts it once the request is admitted."""
        async def work() -> None:
            await self.admitted()
            await send_stream()
        await self.respond(request, work)

    async def collect(self, feed: Callable[[Any], object]) -> "Done":
        """Run to the end for an aggregate response: output events go to ``feed``; returns the ``Done``."""
        done: Done | None = None
        async with aclosing(self.events()) as events:
            async for ev in events:
                if isinstance(ev, Done):
                    done = ev
                elif not isinstance(ev, Progress):
                    feed(ev)
        assert done is not None, "events() ends with Done or raises"
        return done

    def _end_unrecorded(self, phase: str, message: str) -> None:
        """The terminal record of a submitted request whose ``work`` ended before ``events`` wrote
        one (a stream whose first send found the client gone never starts consuming them)."""
        if self.handle is None:
            return
        if phase == "cancelled":
            self._end_unread(phase, message)
        else:
            self._error(phase, message)

    def _end_unread(self, phase: str, message: str) -> None:
        """The client left before the outcome was read. If the engine had already returned it, the
        terminal record is that outcome's request_done (the spec: an Engine outcome is the terminal,
        a later transport failure is not, and the metrics counted it by its finish reason); only a
        request without an outcome gets request_error."""
        settled = None if self._ended else self.handle.take_outcome()
        if settled is None:
            self._error(phase, message)
            return
        ids, finished = settled
        self.committed += len(ids)
        for _ in self.decoder.push(ids):  # the decoder's counts (reasoning, tool-call parse) cover them
            pass
        self.decoder.finish()
        self._done(finished)

    def stream_failure(self, exc: Exception, what: str) -> ProtocolError:
        """The error to report in-band for a failure after a stream started (the status is already sent).

        It counts in ninfer_response_failures_total. An internal failure stays internal: logged with its
        traceback, reported as internal_error without details.
        """
        self.state.metrics.response_failures += 1
        if isinstance(exc, ProtocolError):
            return exc
        log.error("internal error in %s stream (request %s)", what, self.request_id, exc_info=exc)
        return ProtocolError("internal_error", f"The server failed while generating this {what}.")

    def timings_snapshot(self) -> dict:
        """The cumulative llama.cpp timings so far (timings_per_token)."""
        now = time.monotonic()
        admitted = self._admitted_at or now
        first = self._first_token_at
        prompt_s = (first or now) - admitted
        predicted_s = (self._last_token_at - first) if first and self._last_token_at else 0.0
        total = len(self.prepared.token_ids) if self.prepared else 0
        return llama_timings(self._cache_n, total - self._cache_n, prompt_s, self.committed, predicted_s)

    def _done(self, fin: Finished) -> Done:
        stats = self.decoder.stats
        u = fin.usage
        usage = {"prompt_tokens": u.prompt_tokens, "cached_tokens": u.cached_tokens,
                 "completion_tokens": u.completion_tokens, "reasoning_tokens": stats.reasoning_tokens}
        timings = llama_timings(u.cached_tokens, u.prompt_tokens - u.cached_tokens, fin.timings.prompt,
                                u.completion_tokens, fin.timings.generation)
        stop_string = self.decoder.stopped
        done = Done(fin, fin.reason, stop_string, usage, timings)
        self._ended = True
        reason = stats.tool_call_parse.get("fallback_reason", "none")
        if reason != "none":
            # One warning with the classification only, never the generated markup.
            log.warning("request %s: tool-call markup returned to text (%s)", self.request_id, reason)
        self._log_done(done, stats)
        return done

    def _log_done(self, done: Done, stats: Any) -> None:
        fin = done.finished
        u = done.usage
        log.info("request %s done: %s, prompt %d (%s), completion %d, %.1f ms", self.request_id, fin.reason,
                 u["prompt_tokens"], cache_label(u["cached_tokens"], u["prompt_tokens"], fin.prefix_reuse_path),
                 u["completion_tokens"], fin.timings.total * 1000.0)
        rl = self.state.request_log
        if rl is None:
            return
        self._log_transitions(rl, fin.scheduling.transitions)  # pause/restore boundaries, with the outcome
        t = fin.timings
        rl.write(
            "request_done", request_id=self.request_id, request_seq=self.seq, protocol=self.protocol,
            result={"finish_reason": fin.reason, "finish_detail": fin.detail, "stop_string_matched": done.stop_string
                    is not None, "prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                    "prefix_cache_hit_tokens": u["cached_tokens"],
                    "computed_prefill_tokens": u["prompt_tokens"] - u["cached_tokens"],
                    "reasoning_tokens": u["reasoning_tokens"], "prefix_reuse_path": fin.prefix_reuse_path,
                    "tool_call_parse": stats.tool_call_parse, "generated_token_ids": list(fin.generated_token_ids),
                    "seed": fin.seed},
            # speculative: null, this build has no speculative backend (no MTP / DFlash rounds to count).
            timings_seconds={"prepare": self.prepare_seconds, "queue": t.queue, "ttft": t.ttft, "vision": 0.0,
                             "prefill": t.prompt, "decode": t.generation, "total": t.total, "speculative": None},
            engine_timing=_engine_timing(fin.engine_timing),
            first_output_timing=None if fin.first_output is None else attrs.asdict(fin.first_output),
            # Device time of its prefill/replay stream intervals (null without a device), and its
            # context copies: evidence beside the wall-time stages, not another stage.
            work={"gpu_seconds": fin.gpu_seconds, "context_transfers": fin.scheduling.context_transfers},
            generation={"scheduling": {**attrs.asdict(fin.scheduling),
                                       "transitions": [_transition_record(tr) for tr in fin.scheduling.transitions]}},
        )

    def _log_transitions(self, rl: Any, transitions: tuple) -> None:
        for tr in transitions:
            rl.write("request_scheduling", request_id=self.request_id, request_seq=self.seq,
                     **_transition_record(tr))

    def _error(self, phase: str, message: str) -> None:
        if self._ended:
            return  # a request has exactly one terminal record
        self._ended = True
        log.info("request %s ended without outcome: %s", self.request_id, phase)
        rl = self.state.request_log
        if rl is not None:
            if self.handle is not None:  # a paused request's boundaries so far (no terminal one)
                self._log_transitions(rl, self.handle.transitions())
            rl.write("request_error", request_id=self.request_id, request_seq=self.seq, protocol=self.protocol,
                     **self._config, phase=phase, message=message)


# Readable labels of the JSONL prefix_reuse_path values, for the stderr completion record.
REUSE_PATH_LABELS = {"root": "no reuse", "checkpoint": "reused checkpoint"}


def cache_label(cached: int, prompt: int, path: str) -> str:
    """The completion record's "cache N (P%, path)" (spec: Execution behavior)."""
    share = 100.0 * cached / prompt if prompt else 0.0
    return f"cache {cached} ({share:.0f}%, {REUSE_PATH_LABELS.get(path, path)})"


def _is_cancel(e: BaseException) -> bool:
    return isinstance(e, (trio.Cancelled, GeneratorExit))


def _engine_timing(et: Any) -> dict[str, Any]:
    """request_done.engine_timing in the spec's shape: the queue wait, the Host exposure by worker
    phase with its total, the Device wait, the decode rounds' share of both, and the unit counts."""
    phases = {phase: et.host_phases.get(phase, 0.0) for phase in HOST_PHASES}
    return {"queue_wait_seconds": et.queue_wait_seconds,
            "host_exposed_seconds": {**phases, "total": sum(phases.values())},  # exactly their sum
            "device_wait_exposed_seconds": et.device_wait_exposed_seconds,
            "decode": {"rounds": et.decode_rounds, "host_exposed_seconds": et.decode_host_seconds,
                       "device_wait_exposed_seconds": et.decode_device_wait_seconds},
            "units": {"prefill": et.prefill_units, "control": et.control_units},
            # The flat counts of earlier records (before the nesting above), kept for their readers.
            "decode_rounds": et.decode_rounds, "prefill_units": et.prefill_units, "control_units": et.control_units}


def _transition_record(tr: Any) -> dict[str, Any]:
    """A request_scheduling event's members: the boundary, and its ``progress`` — cumulative
    engine-wide ("global") and request-owned work, whose deltas between two boundaries tell whether
    other requests advanced meanwhile."""
    boundary = attrs.asdict(tr)
    progress = {"global": boundary.pop("engine_progress"), "request": boundary.pop("request_progress")}
    return {"transition": boundary, "progress": progress}


def _resolved_sampling(row: Any) -> dict[str, Any]:
    """The sampler the engine resolved for a request, seed included (``step`` is per token)."""
    return {k: v for k, v in attrs.asdict(row).items() if k != "step"}
