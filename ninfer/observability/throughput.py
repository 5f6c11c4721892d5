"""The periodic throughput record (``--log-stats-interval-ms``): stderr line + JSONL event.

Each interval compares the engine snapshots read at its two ticks; fully idle intervals are omitted.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import trio

from ninfer.engine.stats import throughput

log = logging.getLogger("ninfer.stats")


def _busy(t: dict) -> bool:
    """Token work, queued or resident requests, or context materialization or retention activity."""
    cache = t["context_cache"]
    return bool(t["prefill_tokens"] or t["generation_tokens"] or t["replayed_tokens"] or t["running"]
                or t["waiting"] or t["paused"] or t["preemptions"] or t["materializing"] or cache["captures"]
                or any(cache["transfer_bytes"].values()))


def pretty(t: dict) -> str:
    parts = []
    if t["prefill_tokens"]:
        parts.append(f"prefill {t['prefill_tokens_per_second']:.1f} tok/s ({t['prefill_tokens']})")
    if t["decode_tokens"]:
        parts.append(f"decode {t['decode_tokens_per_second']:.1f} tok/s ({t['decode_tokens']})")
    parts.append(f"running {t['running']} (prefill {t['prefilling']}, decode-ready {t['decode_ready']})")
    for key in ("waiting", "paused", "replaying", "materializing"):
        if t[key]:
            parts.append(f"{key} {t[key]}")
    if t["average_batch"] is not None:
        parts.append(f"batch {t['average_batch']:.2f}")
    parts.append(f"host {t['host_work_seconds']['total'] * 1000:.0f} ms ({t['host_active_fraction'] * 100:.0f}%)")
    return "throughput: " + ", ".join(parts)


def record(t: dict) -> dict:
    """The JSONL throughput fields (docs/request-log.md)."""
    scheduler = {k: t[k] for k in ("running", "prefilling", "decode_ready", "waiting", "paused", "replaying",
                                   "materializing")}
    # Not tracked by this Engine: checkpoint captures run synchronously inside the step that plans
    # them, and a terminal is delivered in the step that decides it, so neither has a pending count.
    scheduler["capture_pending"] = None
    scheduler["terminal_pending"] = None
    keep = ("interval_seconds", "prefill_tokens", "decode_tokens", "generation_tokens", "replayed_tokens",
            "decode_rounds", "decode_row_rounds", "preemptions", "snapshot_restores", "replay_restores")
    out = {k: t[k] for k in keep}
    out["average_size"] = t["average_batch"]  # the spec's name: decode row-rounds / decode rounds
    out["average_batch"] = t["average_batch"]  # the same value under its earlier name
    out["scheduler"] = scheduler
    # The spec's separate scheduling object (the same counts stay at the top level, as before).
    out["scheduling"] = {k: t[k] for k in ("preemptions", "snapshot_restores", "replay_restores", "replayed_tokens")}
    out["context_cache"] = t["context_cache"]
    out["host_work"] = {"elapsed_seconds": t["host_work_seconds"], "device_wait_seconds": t["device_wait_seconds"],
                        "per_round_seconds": t["host_seconds_per_round"],
                        "per_row_round_seconds": t["host_seconds_per_row_round"],
                        "work_class_seconds": t["work_class_seconds"],
                        # Detail inside the phases above (never added to their total).
                        "detail_subset_seconds": {"stats_publication": t["stats_publication_seconds"]},
                        "detail_invocations": {"stats_publication": t["stats_publications"]}}
    return out


class ThroughputReporter:
    """Reports the interval between two ticks. The interval is timed by the ticks, not by snapshot
    publications: an idle worker publishes nothing, so the latest snapshot may be minutes old, and
    rates over the span since it would spread an interval's work over all the idle time before it."""

    def __init__(self, engine: Any, request_log: Any, now: float) -> None:
        self.engine = engine
        self.request_log = request_log
        self.prev, self.prev_at = engine.stats(), now

    def tick(self, now: float) -> dict | None:
        """Log (and write) the interval ending ``now``; its figures, or None when it was fully idle."""
        cur = self.engine.stats()
        t = throughput(attrs.evolve(self.prev, monotonic=self.prev_at), attrs.evolve(cur, monotonic=now))
        self.prev, self.prev_at = cur, now
        if not _busy(t):
            return None
        log.info("%s", pretty(t))
        if self.request_log is not None:
            self.request_log.write("throughput", **record(t))
        return t


async def throughput_loop(engine: Any, request_log: Any, interval_s: float) -> None:
    reporter = ThroughputReporter(engine, request_log, time.monotonic())
    while True:
        await trio.sleep(interval_s)
        reporter.tick(time.monotonic())
