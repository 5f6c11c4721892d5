"""The spec's Live metrics and stderr operational records, checked on the live server.

/metrics families, types and histogram shape; pretty records free of terminal control sequences
even when a client chose the text; throughput rates over the fixed report interval.
"""

from __future__ import annotations

import io
import logging
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ninfer.observability import logs
from ninfer.observability.throughput import ThroughputReporter

MODEL = "random-tiny-qwen3"
HI = [{"role": "user", "content": "Hello there"}]
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (TRACE|DEBUG|INFO|WARNING|ERROR|CRITICAL) \S")

# Every family of the spec's table, with its Prometheus type.
SPEC_FAMILIES = {
    "ninfer_model_info": "gauge", "ninfer_engine_ready": "gauge", "ninfer_max_concurrency": "gauge",
    "ninfer_max_context_tokens": "gauge",
    **{f"ninfer_requests_{s}": "gauge" for s in ("running", "waiting", "paused", "prefilling", "decode_ready",
                                                 "replaying", "materializing")},
    **{f"ninfer_{c}": "counter" for c in (
        "prompt_tokens", "prompt_tokens_cached", "prefill_tokens", "replayed_tokens", "generation_tokens",
        "decode_tokens", "spec_decode_rounds", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
        "spec_decode_fallback_steps", "preemptions", "snapshot_restores", "replay_restores",
        "context_transfer_bytes", "host_work_seconds", "device_wait_seconds", "requests", "response_failures")},
    **{f"ninfer_device_{g}": "gauge" for g in ("kv_used_pages", "kv_capacity_pages", "state_used_slots",
                                               "state_capacity_slots")},
    **{f"ninfer_host_context_{g}_bytes": "gauge" for g in ("used", "reserved", "capacity", "peak")},
    **{f"ninfer_{h}_seconds": "histogram" for h in ("time_to_first_token", "request_duration", "request_queue")},
}


@pytest.fixture
def stderr_records():
    """The server's pretty stderr (``logs.setup``, as ``ninfer serve`` installs it) into a buffer;
    the loggers' previous wiring is restored afterwards."""
    names = ("ninfer", "hypercorn.error")
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in map(logging.getLogger, names)]
    stream = io.StringIO()
    logs.setup("info", stream)
    yield stream
    for lg, handlers, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


async def test_metrics_families_types_and_histogram_shape(start_server):
    srv = await start_server()
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 3})
        assert r.status_code == 200
        m = await c.get("/metrics")
    assert m.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    fams = {f.name: f for f in text_string_to_metric_families(m.text)}
    assert {name: fams[name].type for name in SPEC_FAMILIES if name in fams} == SPEC_FAMILIES
    for name in ("spec_decode_rounds", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
                 "spec_decode_fallback_steps"):  # no speculative backend in this engine: they read 0
        assert [s.value for s in fams[f"ninfer_{name}"].samples] == [0.0]
    for name in ("time_to_first_token", "request_duration", "request_queue"):
        samples = fams[f"ninfer_{name}_seconds"].samples
        buckets = [s for s in samples if s.name.endswith("_bucket")]
        count = next(s.value for s in samples if s.name.endswith("_count"))
        assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == count == 1
        assert [s.value for s in buckets] == sorted(s.value for s in buckets)  # cumulative
        assert any(s.name.endswith("_sum") for s in samples)
    # Bounded labels: no request id reaches a sample.
    assert r.headers["x-request-id"] not in m.text


async def test_stderr_records_never_carry_terminal_control_sequences(start_server, stderr_records):
    srv = await start_server()

    async def broken(ex):
        raise RuntimeError("invariant")

    srv.app.route("GET", "/v1/broken/{rest:path}", broken)
    async with httpx.AsyncClient(base_url=srv.url) as c:
        # The path a client sends reaches the internal-error record: ESC [2J clears a screen, and
        # U+009B is the one-character CSI.
        r = await c.get("/v1/broken/%1b[2J%c2%9b31mx")
    assert r.status_code == 500
    text = stderr_records.getvalue()
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text), ascii(text)
    record = next(line for line in text.splitlines() if "internal error on GET" in line)
    assert RECORD.match(record) and "/v1/broken/\\x1b[2J\\x9b31mx" in record


def test_a_record_is_one_line(stderr_records):
    """A newline or carriage return inside a message cannot forge or overwrite another record."""
    logging.getLogger("ninfer.server").warning("a %s b", "x\n2024-01-01 00:00:00.000 INFO forged\ry")
    lines = stderr_records.getvalue().splitlines()
    assert len(lines) == 1 and RECORD.match(lines[0]) and "\\n2024" in lines[0] and "\\x0dy" in lines[0]


async def test_throughput_rates_cover_the_fixed_interval(start_server, stderr_records):
    """An interval after idle ones reports its work over its own five seconds, not over the idle
    time since the engine last published a snapshot (ticks are given, so no test waits)."""
    srv = await start_server()
    reporter = ThroughputReporter(srv.state.engine, None, now=100.0)
    assert reporter.tick(105.0) is None  # fully idle: omitted
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 4})
    usage = r.json()["usage"]
    t = reporter.tick(110.0)
    assert t["interval_seconds"] == 5.0
    assert (t["prefill_tokens"], t["decode_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"] - 1)
    assert t["decode_tokens_per_second"] == t["decode_tokens"] / 5.0
    assert t["host_active_fraction"] == t["host_work_seconds"]["total"] / 5.0
    assert reporter.tick(115.0) is None
    lines = [line for line in stderr_records.getvalue().splitlines() if "throughput:" in line]
    assert len(lines) == 1 and RECORD.match(lines[0])
    assert f"decode {t['decode_tokens'] / 5.0:.1f} tok/s ({t['decode_tokens']})" in lines[0]
