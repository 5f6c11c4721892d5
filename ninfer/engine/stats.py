"""Engine counters, gauges and histogram inputs, published as immutable snapshots.

The worker mutates :class:`Counters`; every publication copies them into a frozen
:class:`StatsSnapshot` and swaps one reference, so any thread reads a consistent view without
touching the worker (spec: Live metrics, throughput record).
"""

from __future__ import annotations

import bisect
from typing import Any, Mapping

import attrs

# Context copies by (resource, direction): Main KV pages and StateImages.
TRANSFERS = tuple((resource, direction) for resource in ("main_kv", "state")
                  for direction in ("device_to_host", "host_to_device", "device_to_device"))
STATE_OPERATIONS = ("capture", "reuse", "snapshot", "restore", "spill", "restore_from_host")
# The work classes timed directly (throughput work_class_seconds); control is what they leave.
PROGRAM_CLASSES = ("decode", "prefill")
HOST_PHASES = ("engine_boundary", "program_submit", "program_post", "engine_commit_output", "engine_maintenance")
# Prometheus-style upper bounds in seconds (the +Inf bucket is implied by ``count``).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@attrs.frozen
class Histogram:
    buckets: tuple[float, ...]
    counts: tuple[int, ...]  # cumulative count per upper bound
    sum: float
    count: int


class HistogramInput:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def freeze(self) -> Histogram:
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return Histogram(self.buckets, tuple(cumulative), self.sum, self.count)


class Counters:
    """Monotonic totals since startup (mutated on the worker only)."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.prefill_tokens = 0
        self.replayed_tokens = 0
        self.generation_tokens = 0
        self.decode_tokens = 0
        self.forced_tokens = 0
        self.preemptions = 0
        self.snapshot_restores = 0
        self.replay_restores = 0
        self.decode_rounds = 0
        self.decode_row_rounds = 0
        self.prefill_units = 0
        self.control_units = 0
        self.prefix_hits = 0
        self.prefix_captures = 0
        self.cow_copies = 0
        self.thinking_budget_applied = 0
        self.last_selection: dict | None = None  # the latest initial binding's prefix selection
        self.transfer_bytes = dict.fromkeys(TRANSFERS, 0)
        # StateImage operations of a recurrent model: checkpoint captures (lane -> slot), reuses
        # (slot -> lane), pause snapshots (lane -> Host), snapshot restores (Host -> lane),
        # spills of evicted checkpoints (slot -> Host) and their reuse (Host -> lane).
        self.state_ops = dict.fromkeys(STATE_OPERATIONS, 0)
        self.host_work = dict.fromkeys(HOST_PHASES, 0.0)
        self.device_wait = 0.0
        # The decode and prefill programs' shares of Host and Device-wait time (work_class_seconds);
        # control is the rest of each: context copies, control chunks, scheduling between steps.
        self.class_host = dict.fromkeys(PROGRAM_CLASSES, 0.0)
        self.class_device = dict.fromkeys(PROGRAM_CLASSES, 0.0)
        # Stats publication: a detail of the Host phase it runs in (commit output or maintenance).
        self.stats_publication_seconds = 0.0
        self.stats_publications = 0
        self.requests = {}  # outcome -> count
        self.ttft = HistogramInput()
        self.duration = HistogramInput()
        self.queue = HistogramInput()

    def outcome(self, name: str) -> None:
        self.requests[name] = self.requests.get(name, 0) + 1


@attrs.frozen(kw_only=True)
class StatsSnapshot:
    # Identity and startup limits.
    backend: str
    max_concurrency: int
    max_context_tokens: int
    page_size: int
    context_cost_source: str
    ready: bool
    # Gauges (scheduler state at publication).
    requests_running: int
    requests_waiting: int
    requests_paused: int
    requests_prefilling: int
    requests_decode_ready: int
    requests_replaying: int
    # The next two count the copies of a step planned but not run yet: copies are synchronous, so
    # only a publication between planning and the runner calls (the worker's event delivery) sees
    # them. Requests whose snapshot, checkpoint StateImage or tail page the plan copies in:
    requests_materializing: int
    device_kv_used_pages: int
    device_kv_capacity_pages: int
    device_state_used_slots: int
    device_state_capacity_slots: int
    host_context_used_bytes: int
    host_context_reserved_bytes: int  # of used: snapshot destinations whose device-to-host copy has not run
    host_context_capacity_bytes: int
    host_context_peak_bytes: int
    prefix_cache_nodes: int
    prefix_cache_evictions: int
    last_selection: Mapping[str, Any] | None  # path, prompt_tokens, reused_tokens, state source
    # Counters.
    prompt_tokens_total: int
    prompt_tokens_cached_total: int
    prefill_tokens_total: int
    replayed_tokens_total: int
    generation_tokens_total: int
    decode_tokens_total: int
    forced_tokens_total: int
    preemptions_total: int
    snapshot_restores_total: int
    replay_restores_total: int
    decode_rounds_total: int
    decode_row_rounds_total: int
    prefill_units_total: int
    control_units_total: int
    prefix_hits_total: int
    prefix_captures_total: int
    cow_copies_total: int
    thinking_budget_applied_total: int
    spec_decode_rounds_total: int = 0  # no speculative backend in this build
    spec_decode_draft_tokens_total: int = 0
    spec_decode_accepted_tokens_total: int = 0
    spec_decode_fallback_steps_total: int = 0
    context_transfer_bytes_total: Mapping[tuple[str, str], int]
    state_image_operations_total: Mapping[str, int] = attrs.field(factory=dict)
    host_work_seconds_total: Mapping[str, float]
    device_wait_seconds_total: float
    # {"decode" | "prefill" | "control": {"host": s, "device_wait": s}}: a partition of the two above.
    work_class_seconds_total: Mapping[str, Mapping[str, float]] = attrs.field(factory=dict)
    stats_publication_seconds_total: float = 0.0  # inside host_work_seconds_total, not beside it
    stats_publications_total: int = 0
    requests_total: Mapping[str, int]
    time_to_first_token_seconds: Histogram
    request_duration_seconds: Histogram
    request_queue_seconds: Histogram
    monotonic: float  # when it was published (time.monotonic)


def throughput(prev: StatsSnapshot, cur: StatsSnapshot) -> dict:
    """Interval figures of the periodic throughput record between two snapshots."""
    seconds = max(cur.monotonic - prev.monotonic, 1e-9)
    rounds = cur.decode_rounds_total - prev.decode_rounds_total
    rows = cur.decode_row_rounds_total - prev.decode_row_rounds_total
    host = {k: cur.host_work_seconds_total[k] - prev.host_work_seconds_total[k] for k in HOST_PHASES}
    host_total = sum(host.values())
    prefill = cur.prefill_tokens_total - prev.prefill_tokens_total
    decode = cur.decode_tokens_total - prev.decode_tokens_total
    return {
        "interval_seconds": seconds,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "generation_tokens": cur.generation_tokens_total - prev.generation_tokens_total,
        "replayed_tokens": cur.replayed_tokens_total - prev.replayed_tokens_total,
        "prefill_tokens_per_second": prefill / seconds,
        "decode_tokens_per_second": decode / seconds,
        "decode_rounds": rounds,
        "decode_row_rounds": rows,
        "average_batch": rows / rounds if rounds else None,
        "preemptions": cur.preemptions_total - prev.preemptions_total,
        "snapshot_restores": cur.snapshot_restores_total - prev.snapshot_restores_total,
        "replay_restores": cur.replay_restores_total - prev.replay_restores_total,
        "host_work_seconds": {**host, "total": host_total},
        "device_wait_seconds": cur.device_wait_seconds_total - prev.device_wait_seconds_total,
        "work_class_seconds": {cls: {k: v - prev.work_class_seconds_total.get(cls, {}).get(k, 0.0)
                                     for k, v in times.items()}
                               for cls, times in cur.work_class_seconds_total.items()},
        "stats_publication_seconds": cur.stats_publication_seconds_total - prev.stats_publication_seconds_total,
        "stats_publications": cur.stats_publications_total - prev.stats_publications_total,
        "host_active_fraction": host_total / seconds,
        "host_seconds_per_round": host_total / rounds if rounds else None,
        "host_seconds_per_row_round": host_total / rows if rows else None,
        "context_cache": context_cache(prev, cur),
        "running": cur.requests_running,
        "prefilling": cur.requests_prefilling,
        "decode_ready": cur.requests_decode_ready,
        "waiting": cur.requests_waiting,
        "paused": cur.requests_paused,
        "replaying": cur.requests_replaying,
        "materializing": cur.requests_materializing,
    }


def context_cache(prev: StatsSnapshot, cur: StatsSnapshot) -> dict:
    """The throughput record's context-cache figures: interval deltas of selections (prefix hits),
    captures, StateImage operations, transfers and tail-page copies; occupancy and the last
    selection at the end."""
    return {
        "selections": cur.prefix_hits_total - prev.prefix_hits_total,
        "captures": cur.prefix_captures_total - prev.prefix_captures_total,
        "state_image_operations": {k: v - prev.state_image_operations_total.get(k, 0)
                                   for k, v in cur.state_image_operations_total.items()},
        "transfer_bytes": {f"{resource}.{direction}": v - prev.context_transfer_bytes_total.get((resource, direction), 0)
                           for (resource, direction), v in cur.context_transfer_bytes_total.items()},
        "tail_page_cow": cur.cow_copies_total - prev.cow_copies_total,
        "occupancy": {"kv_pages": cur.device_kv_used_pages, "state_slots": cur.device_state_used_slots,
                      "host_bytes": cur.host_context_used_bytes,
                      "host_reserved_bytes": cur.host_context_reserved_bytes, "nodes": cur.prefix_cache_nodes},
        "last_selection": None if cur.last_selection is None else dict(cur.last_selection),
    }
