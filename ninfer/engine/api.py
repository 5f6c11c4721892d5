"""``ninfer.Engine``: the trio facade over the engine worker.

::

    async with Engine.open(runner_or_artifact_path, EngineConfig(...)) as engine:
        with engine.reserve() as ticket:              # may raise Overloaded
            handle = ticket.submit(GenerationRequest(prompt=ids, max_tokens=64))
            async for event in handle:                 # PromptProgress*, TokenDelta*, one Finished
                ...

Everything here runs on the trio thread and never blocks on the worker: commands go through the
worker's inbox, events come back through each request's outbox and a trio wake-up.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Iterable, Mapping

import trio

from ninfer.backends.runner import ModelRunner
from ninfer.backends.runner import SamplingRow
from ninfer.engine import sampling
from ninfer.engine.config import EngineConfig
from ninfer.engine.context_cost import load as load_context_cost
from ninfer.engine.core import EngineCore
from ninfer.engine.errors import (ContextLengthExceeded, EngineUnavailable, InvalidPrompt, Overloaded,
                                  QueueTimeout, ThinkingBudgetCapacityInsufficient)
from ninfer.engine.events import Finished, PromptProgress, TokenDelta
from ninfer.engine.request import MAX_CACHE_HINTS, GenerationRequest
from ninfer.engine.sequence import Sequence
from ninfer.engine.signature import model_signature
from ninfer.engine.stats import StatsSnapshot
from ninfer.engine.worker import Worker

log = logging.getLogger("ninfer.engine")


class Engine:
    """One resident model and its worker. Create it with :meth:`open`."""

    def __init__(self, config: EngineConfig) -> None:
        # Use Engine.open(); the worker thread builds the runner (for an artifact path) and the
        # core, so that every runner call — construction included — happens on that thread.
        self.config = config
        self._token = trio.lowlevel.current_trio_token()
        self._wake_lock = threading.Lock()
        self._wake_pending: dict[int, Sequence] = {}
        self._wake_scheduled = False
        self._rids = itertools.count()
        self._outstanding = 0
        self._closed = False
        self._generation: Mapping[str, Any] | None = None
        self._eos: frozenset[int] = frozenset()
        # The runner's model signature (ninfer.engine.signature), taken in build() on the worker
        # thread, which owns the runner; None for a runner without a model config (a test double).
        self.signature: str | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, source: ModelRunner | str | os.PathLike, config: EngineConfig | None = None, *,
                   eos_token_ids: Iterable[int] | None = None,
                   generation: Mapping[str, Any] | None = None,
                   close_runner: bool = False) -> AsyncIterator["Engine"]:
        """Start an engine over a runner (the caller keeps ownership unless ``close_runner``: then
        the worker closes it when the engine stops) or a ``.ninfer`` path (loaded on the reference
        backend by the worker; the engine owns and closes it).

        ``eos_token_ids`` end every request with finish "stop" (an artifact path supplies its
        own); ``generation`` is the artifact's generation block (sampling presets)."""
        config = config or EngineConfig()
        engine = cls(config)
        owns = isinstance(source, (str, os.PathLike))

        def build() -> EngineCore:
            if owns:
                runner, eos, gen = _load_reference(os.fspath(source), config)
            else:
                runner, eos, gen = source, (), None
            engine._eos = frozenset(int(t) for t in (eos if eos_token_ids is None else eos_token_ids))
            engine._generation = gen if generation is None else generation
            try:
                engine.signature = model_signature(runner)
                cost = load_context_cost(config.context_cost_presets, runner.info.backend, engine.signature)
                log.info("context cost: %s", cost.source)
                return EngineCore(runner, config, cost)
            except BaseException:
                if owns or close_runner:
                    runner.close()
                raise

        engine._worker = Worker(build, engine._wake_from_worker, close_runner=owns or close_runner)
        await engine._worker.start()
        engine._core = engine._worker.core
        engine.info = engine._core.runner.info
        try:
            yield engine
        finally:
            await engine.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._worker.post("close")
            # Shielded: a server stops by cancelling its scope, and the runner's device memory must be
            # back before the caller goes on (a process that starts another engine, as the GPU tests do).
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._worker.join, abandon_on_cancel=False)

    # -- public surface -------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._worker.ready and not self._closed

    @property
    def max_context(self) -> int:
        return self._core.limit

    def stats(self) -> StatsSnapshot:
        """The latest published snapshot (never touches the worker)."""
        return self._worker.snapshot

    def reserve(self) -> "Ticket":
        """Take one lifetime-capacity slot before preparation; raise Overloaded when full."""
        if not self.ready:
            raise EngineUnavailable("the engine is not available")
        capacity = self.config.lifetime_capacity
        if self._outstanding >= capacity:
            raise Overloaded(capacity)
        self._outstanding += 1
        return Ticket(self, self._core.clock() + self.config.pending_timeout_ms / 1000.0)

    # -- internals ------------------------------------------------------------------------

    def _release_slot(self) -> None:
        self._outstanding -= 1

    def _prepare(self, request: GenerationRequest, deadline: float) -> Sequence:
        limit = self._core.limit
        _validate(request, self.info.vocab_size, limit)
        preset = sampling.preset_for(self._generation, request.thinking.starts_in_thinking)
        row = sampling.resolve(preset, self.config, request.sampling)
        return Sequence(next(self._rids), request, row, self._eos | frozenset(request.stop_token_ids),
                        limit, deadline, self._core.clock(),
                        reserved=deadline - self.config.pending_timeout_ms / 1000.0)

    def _wake_from_worker(self, seqs: list[Sequence]) -> None:
        """Worker thread: wake the consumers of ``seqs``. While one wake-up is still queued on
        the trio loop, later ones join it instead of queueing another callback (a consumer
        behind by several steps costs one wake, not one per step)."""
        with self._wake_lock:
            self._wake_pending.update((id(s), s) for s in seqs)
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        try:
            self._token.run_sync_soon(self._wake_handles)
        except trio.RunFinishedError:
            pass  # the trio run is over: nobody is waiting

    def _wake_handles(self) -> None:
        with self._wake_lock:
            seqs = list(self._wake_pending.values())
            self._wake_pending.clear()
            self._wake_scheduled = False
        for seq in seqs:
            handle = seq.handle
            if handle is not None and handle._event is not None:
                handle._event.set()


class Ticket:
    """One lifetime-capacity slot, held from before preparation until the result is released."""

    def __init__(self, engine: Engine, deadline: float) -> None:
        self._engine = engine
        self.deadline = deadline
        self._released = False
        self._entered = False
        self.handle: Handle | None = None

    def submit(self, request: GenerationRequest) -> "Handle":
        """Validate and queue ``request``. Raises InvalidPrompt, ValueError (another bad field),
        ContextLengthExceeded or ThinkingBudgetCapacityInsufficient at preparation; admission errors
        come from the handle. A rejection is the caller's to count (the server counts its own in
        ninfer_requests_total{outcome="rejected"})."""
        if self._released or self.handle is not None:
            raise RuntimeError("a ticket submits exactly one request while it is held")
        engine = self._engine
        if not engine.ready:
            raise EngineUnavailable("the engine is not available")
        seq = engine._prepare(request, self.deadline)
        self.handle = Handle(self, seq)
        seq.handle = self.handle
        engine._worker.post("submit", seq)
        return self.handle

    def release(self) -> None:
        """Give the slot back; an unfinished request is cancelled first."""
        if self._released:
            return
        if self.handle is not None:
            self.handle._cancel()
        self._released = True
        self._engine._release_slot()

    def __enter__(self) -> "Ticket":
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Handle:
    """The event stream of one request. Iterate it; ``stop()`` ends it early with "stop"."""

    def __init__(self, ticket: Ticket, seq: Sequence) -> None:
        self._ticket = ticket
        self._seq = seq
        self._event: trio.Event | None = None
        self._done = False  # the terminal item was consumed (or the request was cancelled)
        self._received = 0  # output token ids yielded so far
        self._progress_seen = False  # the first PromptProgress is delivered as it was emitted
        self._stopped_at: int | None = None
        self._outcome_read = False  # the Finished item was returned (by iteration or take_outcome)

    @property
    def sampling(self) -> SamplingRow:
        """The sampler this request runs with: preset, process flags, request and --greedy
        resolved, the seed drawn when none was given (the request log records it)."""
        return self._seq.row

    def __aiter__(self) -> "Handle":
        return self

    async def __anext__(self) -> PromptProgress | TokenDelta | Finished:
        while True:
            item = await self._next_item()
            # After stop(), tokens the worker committed before it saw the stop are not output.
            if not (self._stopped_at is not None and isinstance(item, TokenDelta)):
                break
        if isinstance(item, TokenDelta):
            self._received += len(item.token_ids)
        return item

    async def _next_item(self) -> PromptProgress | TokenDelta | Finished:
        if self._done:
            self._end()
            raise StopAsyncIteration
        seq = self._seq
        outbox = seq.outbox
        while not outbox:
            self._event = trio.Event()
            try:
                if seq.claimed or seq.expired:
                    await self._event.wait()
                else:
                    # Not admitted yet: the pending deadline is enforced here as well, so a long
                    # worker step cannot stretch it.
                    with trio.move_on_at(trio.current_time() + seq.deadline - time.monotonic()):
                        await self._event.wait()
                    if not outbox and seq.expire():
                        self._ticket._engine._worker.post("expire", seq)
                        self._done = True
                        self._end()
                        raise QueueTimeout(self._ticket._engine.config.pending_timeout_ms)
            except QueueTimeout:
                raise
            except BaseException:
                self._cancel()
                raise
            finally:
                self._event = None
        item = outbox.popleft()
        # Coalesce: a slow consumer sees the latest progress and all pending tokens at once. The
        # first progress event (processed == cache, the committed reuse choice) is never merged away.
        if isinstance(item, PromptProgress):
            if self._progress_seen:
                while outbox and isinstance(outbox[0], PromptProgress):
                    item = outbox.popleft()
            self._progress_seen = True
        elif isinstance(item, TokenDelta) and outbox and isinstance(outbox[0], TokenDelta):
            ids = list(item.token_ids)
            while outbox and isinstance(outbox[0], TokenDelta):
                ids.extend(outbox.popleft().token_ids)
            item = TokenDelta(tuple(ids))
        if isinstance(item, BaseException):
            self._done = True
            self._end()
            raise item
        if isinstance(item, Finished):
            self._done = True
            self._outcome_read = True
        return item

    def transitions(self) -> tuple:
        """The pause/restore boundaries recorded so far (events.Transition), for a consumer that ends
        without the outcome, whose ``Finished`` would carry them. The worker only appends to the list."""
        return tuple(self._seq.transitions)

    def take_outcome(self) -> tuple[list[int], Finished] | None:
        """The outcome the engine already returned but the consumer has not read: the output token
        ids not yet received (none past a ``stop()``) and the ``Finished``; None while the request
        is unfinished, failed or expired. For a consumer that stops reading (its client left) to
        record the outcome that exists instead of a cancellation. The worker appends ``Finished``
        last, so once it is at the end of the outbox nothing follows it."""
        outbox = self._seq.outbox
        if self._outcome_read or not outbox or not isinstance(outbox[-1], Finished):
            return None
        ids: list[int] = []
        while outbox:
            item = outbox.popleft()
            if isinstance(item, TokenDelta) and self._stopped_at is None:
                ids.extend(item.token_ids)
        self._received += len(ids)
        self._done = self._outcome_read = True
        self._end()
        return ids, item

    def stop(self, accepted: int | None = None) -> None:
        """A stop string matched in the text layer within the tokens received so far: finish
        "stop" at the next boundary. Output (usage, generated ids, the retained endpoint) ends
        after ``accepted`` output tokens (default: all this handle has yielded; a delta may carry
        tokens past the one that completed the match); later deltas are dropped."""
        if not self._done and self._stopped_at is None:
            self._stopped_at = self._received if accepted is None else max(0, min(accepted, self._received))
            self._ticket._engine._worker.post("stop", (self._seq, self._stopped_at))

    async def aclose(self) -> None:
        self._cancel()
        self._end()

    async def __aenter__(self) -> "Handle":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _cancel(self) -> None:
        if not self._done:
            self._done = True
            self._ticket._engine._worker.post("cancel", self._seq)

    def _end(self) -> None:
        # Without `with ticket:` the slot is released as soon as the stream ends.
        if not self._ticket._entered:
            self._ticket.release()


def _validate(request: GenerationRequest, vocab: int, limit: int) -> None:
    n = len(request.prompt)
    if n == 0:
        raise InvalidPrompt("prompt must contain at least one token")
    if min(request.prompt) < 0 or max(request.prompt) >= vocab:
        raise InvalidPrompt(f"prompt token ids must be in 0..{vocab - 1}")
    if request.max_tokens < 0:
        raise ValueError(f"max_tokens must be non-negative, got {request.max_tokens}")
    if n + (1 if request.max_tokens > 0 else 0) > limit:
        raise ContextLengthExceeded(n, limit)
    if len(request.cache_boundaries) > MAX_CACHE_HINTS:
        raise ValueError(f"cache_boundaries holds at most {MAX_CACHE_HINTS} boundaries")
    for b in request.cache_boundaries:
        if not 0 < b <= n:
            raise ValueError(f"cache_boundaries entry {b} is outside the prompt (1..{n})")
    if request.input_checkpoint is not None and not 0 <= request.input_checkpoint <= n:
        raise ValueError(f"input_checkpoint {request.input_checkpoint} is outside the prompt (0..{n})")
    sampling.validate_overrides(request.sampling)
    thinking = request.thinking
    if thinking.budget is not None:
        if thinking.budget < 1:
            raise ValueError(f"thinking.budget must be positive, got {thinking.budget}")
        if thinking.starts_in_thinking:
            if not thinking.close_ids:
                raise ValueError("thinking.close_ids is required when a thinking budget is set")
            capacity = min(request.max_tokens, limit - n)
            suffix = len(thinking.close_ids)
            if thinking.budget < capacity < thinking.budget + suffix + 1:
                raise ThinkingBudgetCapacityInsufficient(thinking.budget, capacity, suffix)


def _load_reference(path: str, config: EngineConfig):
    """Open an artifact on the reference backend (on the worker thread)."""
    from ninfer.artifact import open_artifact
    from ninfer.backends.reference import ReferenceRunner

    from ninfer.backends.reference.hybrid_runner import is_hybrid_config

    art = open_artifact(path, components=("text",))
    # A hybrid model's extra StateImage slots (beyond one per lane) hold retained checkpoints.
    extra = {"state_slots": config.state_slots - config.max_concurrency} if is_hybrid_config(art.config) else {}
    runner = ReferenceRunner(art, page_size=config.page_size, num_pages=config.kv_pages,
                             max_batch=config.max_concurrency, max_context=config.max_context, **extra)
    eos = art.special_tokens.get("eos_token_ids") or []
    return runner, eos, art.generation
