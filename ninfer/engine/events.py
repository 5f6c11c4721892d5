"""What a request's handle yields: prompt progress, committed token deltas, one Finished."""

from __future__ import annotations

from typing import Mapping

import attrs


@attrs.frozen
class PromptProgress:
    """Cumulative prompt processing (spec ``prompt_progress``); never moves backwards."""

    total: int  # prompt tokens
    cache: int  # reused prefix tokens
    processed: int  # cache + prefill tokens committed so far
    time_ms: float  # since committed admission


@attrs.frozen
class TokenDelta:
    """Newly committed output token ids, in order (including forced thinking-close tokens)."""

    token_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # exact reused prefix; prompt_tokens - cached_tokens were prefilled
    completion_tokens: int  # committed output ids, including a stop token and forced ids


@attrs.frozen(kw_only=True)
class Timings:
    """Request stage seconds (spec request_done.timings_seconds, llama.cpp ``timings``)."""

    queue: float  # submit → admission (initial binding)
    prompt: float  # admission → first committed output token (or prompt done when none)
    generation: float  # first → last committed output token
    total: float  # submit → finish
    ttft: float | None  # submit → first committed output token


@attrs.frozen(kw_only=True)
class WorkProgress:
    """Cumulative completed work, in tokens (one side of a request_scheduling ``progress``)."""

    prefill_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    decode_tokens: int  # tokens committed by decode and control units
    replayed_tokens: int  # tokens recomputed to restore paused requests


@attrs.frozen(kw_only=True)
class Transition:
    """One pause/restore boundary (spec request_scheduling), in order within a pause cycle:
    pause_started (route still None), paused (its snapshot read, or its pages dropped for replay),
    restore_started, restored (binding installed: snapshot written back or replay prefix bound),
    replay_complete (the replay rebuilt the saved frontier), recovery_complete (the first fresh
    committed unit, or a normal finish, after restoring); terminal ends a preempted request.

    ``steady_ns`` is taken on the engine worker (compare it across requests, not delivery
    order); ``elapsed_ns`` starts at submission. Between two boundaries, the engine-wide progress
    minus this request's progress is other requests' completed work.
    """

    kind: str
    preemption_index: int
    route: str | None  # "snapshot", "replay", or None before pause preparation chose one
    steady_ns: int
    elapsed_ns: int
    engine_progress: WorkProgress  # every request's work (the spec's "global" counters)
    request_progress: WorkProgress  # this request's own


@attrs.frozen(kw_only=True)
class SchedulingCounters:
    """Pressure history of one request (spec generation.scheduling)."""

    preemptions: int = 0
    snapshot_restores: int = 0
    replay_restores: int = 0
    replayed_tokens: int = 0
    paused_seconds: float = 0.0
    transfer_bytes: int = 0  # every request-owned context copy: the sum of ``context_transfers``
    # {resource: {direction: bytes}}: main_kv / state x device_to_host / host_to_device /
    # device_to_device — its snapshot out and back, checkpoint reuse, Host checkpoint restore and
    # the tail-page copy of its reused prefix (captures and spills are the prefix cache's own).
    context_transfers: dict = attrs.Factory(dict)
    thinking_budget_applied: int = 0  # times the close suffix was forced (0 or 1)
    forced_tokens: int = 0
    transitions: tuple[Transition, ...] = ()


@attrs.frozen(kw_only=True)
class EngineTiming:
    """Worker time while this request was resident (spec request_done.engine_timing).

    In a compact batch every row waits for the whole round, so these explain one request's
    latency and must not be summed across concurrent requests.
    """

    queue_wait_seconds: float
    host_exposed_seconds: float  # the sum of ``host_phases``
    device_wait_exposed_seconds: float
    decode_rounds: int
    prefill_units: int
    control_units: int
    # The Host time above by worker phase (stats.HOST_PHASES; engine_maintenance runs between steps
    # and is nobody's, so it stays 0 here), and the share of Host and Device-wait time spent in
    # decode rounds (the rest is prefill and control units).
    host_phases: Mapping[str, float] = attrs.Factory(dict)
    decode_host_seconds: float = 0.0
    decode_device_wait_seconds: float = 0.0


@attrs.frozen(kw_only=True)
class FirstOutputTiming:
    """Observations frozen just before the first output token was published (spec
    request_done.first_output_timing). Elapsed time starts at submission; queue ends at
    admission; paused covers pause, waiting and restore; the rest is resident time."""

    elapsed_seconds: float
    queue_seconds: float
    paused_seconds: float
    resident_seconds: float
    host_exposed_seconds: float  # worker host time of the steps this request took part in
    device_wait_exposed_seconds: float
    prefill_tokens: int  # this request's prompt tokens computed (reused prefix excluded)
    replayed_tokens: int


@attrs.frozen(kw_only=True)
class Finished:
    """The one terminal event. ``reason`` is "stop", "length" or "cancelled".

    ``detail`` says why: "eos" (a stop token id), "stop_string" (``handle.stop()``),
    "max_tokens", "context" (the sequence reached the context ceiling), "cancelled".
    """

    reason: str
    detail: str
    usage: Usage
    timings: Timings
    scheduling: SchedulingCounters
    engine_timing: EngineTiming
    prefix_reuse_path: str  # "root" (no reuse) or "checkpoint"
    generated_token_ids: tuple[int, ...]
    seed: int  # the seed actually used (request, process flag, or fresh random)
    first_output: FirstOutputTiming | None = None  # None when no output token was committed
    # Device seconds of its prefill/replay stream intervals (request_done work.gpu_seconds); None on
    # a backend without device timing (the reference backend). Overlaps Host time: not a wall stage.
    gpu_seconds: float | None = None
