"""The periodic throughput record (``--log-stats-interval-ms``): stderr line + JSONL event.

Each interval compares two published engine snapshots; fully idle intervals are omitted.
"""

from __future__ import annotations

import logging
from typing import Any

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
    out["context_cache"] = t["context_cache"]
    out["host_work"] = {"elapsed_seconds": t["host_work_seconds"], "device_wait_seconds": t["device_wait_seconds"],
                        "per_round_seconds": t["host_seconds_per_round"],
                        "per_row_round_seconds": t["host_seconds_per_row_round"],
                        # The Engine counts Host phases, not work classes or stats-publication detail.
                        "work_class_seconds": None, "detail_subset_seconds": None, "detail_invocations": None}
    return out


async def throughput_loop(engine: Any, request_log: Any, interval_s: float) -> None:
    prev = engine.stats()
    while True:
        await trio.sleep(interval_s)
        cur = engine.stats()
        if cur is prev or cur.monotonic <= prev.monotonic:
            continue
        t = throughput(prev, cur)
        prev = cur
        if not _busy(t):
            continue
        log.info("%s", pretty(t))
        if request_log is not None:
            request_log.write("throughput", **record(t))
