"""/metrics: the spec's ``ninfer_*`` families from the Engine's published stats snapshot.

A custom collector reads ``engine.stats()`` (an immutable snapshot the worker publishes) at scrape
time and formats it on the request's task, so scraping never touches the worker or resets
anything. Labels are bounded (phase, outcome, resource/direction); no request ids or text.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

_GAUGES = (
    ("max_concurrency", "Resident execution lanes fixed at startup."),
    ("max_context_tokens", "Logical context ceiling of each sequence."),
    ("requests_running", "Resident requests (prefilling, decoding or replaying)."),
    ("requests_waiting", "Requests waiting for admission."),
    ("requests_paused", "Requests paused under resource pressure."),
    ("requests_prefilling", "Resident requests in prompt prefill."),
    ("requests_decode_ready", "Resident requests ready for the next decode round."),
    ("requests_replaying", "Resident requests rebuilding state by replay."),
    ("requests_materializing", "Requests whose context copies into the device are planned but not yet run."),
    ("device_kv_used_pages", "Main KV pages in use, retained prefixes included."),
    ("device_kv_capacity_pages", "Main KV pool capacity in pages."),
    ("device_state_used_slots", "Device StateImage slots in use."),
    ("device_state_capacity_slots", "Device StateImage slot capacity."),
    ("host_context_used_bytes", "Host context backing in use (reserved included)."),
    ("host_context_reserved_bytes", "Host context bytes reserved for device-to-host copies in flight (in used)."),
    ("host_context_capacity_bytes", "Host context backing capacity."),
    ("host_context_peak_bytes", "Peak Host context backing use."),
)

_COUNTERS = (
    ("prompt_tokens", "Full prompt tokens, counted once at initial binding."),
    ("prompt_tokens_cached", "Prompt tokens reused from the prefix cache."),
    ("prefill_tokens", "Prompt tokens actually computed by initial prefill."),
    ("replayed_tokens", "Tokens recomputed by replay recovery."),
    ("generation_tokens", "All committed output tokens."),
    ("decode_tokens", "Output tokens committed by decode/control, excluding the first."),
    ("spec_decode_rounds", "Speculative decoding rounds."),
    ("spec_decode_draft_tokens", "Speculative draft tokens."),
    ("spec_decode_accepted_tokens", "Accepted speculative tokens."),
    ("spec_decode_fallback_steps", "Speculative fallback steps."),
    ("preemptions", "Pressure pauses."),
    ("snapshot_restores", "Paused requests restored from a snapshot."),
    ("replay_restores", "Paused requests restored by replay."),
    ("device_wait_seconds", "Worker time blocked waiting on the device."),
)

_HISTOGRAMS = (
    ("time_to_first_token_seconds",
     "Submit to first committed token, including preparation, queueing and binding."),
    ("request_duration_seconds", "Duration of settled generation requests."),
    ("request_queue_seconds", "Time from submission to admission."),
)


class EngineCollector:
    def __init__(self, engine: Any, model_id: str, response_failures: Callable[[], int],
                 rejected: Callable[[], int]):
        self.engine = engine
        self.model_id = model_id
        self.response_failures = response_failures
        self.rejected = rejected

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        info = GaugeMetricFamily("ninfer_model_info", "Served model and backend.", labels=["model", "backend"])
        info.add_metric([self.model_id, s.backend], 1)
        yield info
        yield GaugeMetricFamily("ninfer_engine_ready", "1 while the Engine accepts work.",
                                value=1 if self.engine.ready else 0)
        for name, doc in _GAUGES:
            yield GaugeMetricFamily(f"ninfer_{name}", doc, value=getattr(s, name))
        for name, doc in _COUNTERS:  # the snapshot's field is NAME_total, as is the sample's name
            yield CounterMetricFamily(f"ninfer_{name}", doc, value=getattr(s, f"{name}_total"))
        yield _labeled("ninfer_context_transfer_bytes", "Context payload transfer bytes.", ["resource", "direction"],
                       sorted(s.context_transfer_bytes_total.items()))
        yield _labeled("ninfer_state_image_operations", "StateImage captures, reuses, spills and restores.",
                       ["operation"], sorted(s.state_image_operations_total.items()))
        yield _labeled("ninfer_host_work_seconds", "Instrumented worker Host wall time by phase.", ["phase"],
                       s.host_work_seconds_total.items())
        outcomes = dict(s.requests_total)
        if self.rejected():  # refused while being prepared: only the server sees these
            outcomes["rejected"] = self.rejected()
        yield _labeled("ninfer_requests", "Generation attempts by outcome.", ["outcome"], sorted(outcomes.items()))
        yield CounterMetricFamily("ninfer_response_failures", "Failures after a response started.",
                                  value=self.response_failures())
        for name, doc in _HISTOGRAMS:
            h = getattr(s, name)
            buckets = [(_le(b), c) for b, c in zip(h.buckets, h.counts)] + [("+Inf", h.count)]
            yield HistogramMetricFamily(f"ninfer_{name}", doc, buckets=buckets, sum_value=h.sum)


def _labeled(name: str, doc: str, labels: list[str], samples: Iterable[tuple[Any, float]]) -> Metric:
    """A counter family with one sample per label value (a tuple when there are several labels)."""
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, v in samples:
        family.add_metric(list(key) if isinstance(key, tuple) else [key], v)
    return family


def _le(bound: float) -> str:
    return repr(float(bound))


class Metrics:
    """The registry behind /metrics plus the few counters only the server sees."""

    def __init__(self, engine: Any, model_id: str):
        self.response_failures = 0
        self.rejected = 0  # generation requests rejected during preparation (429, 400 context length, ...)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(engine, model_id, lambda: self.response_failures,
                                               lambda: self.rejected))

    def render(self) -> bytes:
        return generate_latest(self.registry)
