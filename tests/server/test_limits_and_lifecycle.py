"""Capacity errors, disconnects, keep-alive, metrics and the JSONL log on the live server.

The scripted runner's gate holds the engine worker inside a decode step, so "a request is busy"
is a state the test controls instead of a race against generation speed.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from ninfer.observability.request_log import COMMON_FIELDS, EVENT_FIELDS, SCHEMA, SCHEMA_VERSION

MODEL = "random-tiny-qwen3"
HI = [{"role": "user", "content": "Hello there"}]
LONG = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 40}]


async def wait_for(predicate, timeout=10.0):
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def open_stream(c: httpx.AsyncClient, max_tokens=200, **extra):
    """Start a streaming request; return (response, line iterator, first line) once the role chunk
    arrived. Keep the iterator referenced: when it is garbage-collected httpx closes the response."""
    req = c.build_request("POST", "/v1/chat/completions", json={
        "model": MODEL, "messages": HI, "max_tokens": max_tokens, "stream": True, **extra})
    resp = await c.send(req, stream=True)
    lines = resp.aiter_lines()
    first = await anext(lines)
    return resp, lines, first


async def test_overload_is_429_and_queue_timeout_is_503(start_server):
    srv = await start_server("--max-concurrency", "1", "--max-pending-requests", "1", "--pending-timeout-ms", "300",
                             scripted=True)
    runner = start_server.runner
    runner.delay = 0.05  # 200 tokens keep the one lane busy for ~10 s; the worker still checks deadlines
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        busy, busy_lines, first = await open_stream(c)
        assert first.startswith("data: ")
        results = []

        async def post():
            results.append(await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI}))

        # One pending slot for two newcomers: whichever reserves second is overloaded at once, the
        # other waits in the queue until the 300 ms admission deadline passes.
        async with trio.open_nursery() as n:
            n.start_soon(post)
            n.start_soon(post)
        overloaded, timed_out = sorted(results, key=lambda r: r.status_code)
        assert overloaded.status_code == 429 and overloaded.json()["error"]["code"] == "server_overloaded"
        assert overloaded.headers["x-request-id"]
        assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "request_queue_timeout"
        assert (await c.get("/health")).status_code == 200  # saturation is not unavailability
        # A stream starts only once admitted: one never admitted gets the same 503, in each family
        # (Anthropic's is its 504 timeout_error), and no stream failure is counted.
        for path, status, kind in (("/v1/chat/completions", 503, "server_error"), ("/v1/responses", 503, "server_error"),
                                   ("/v1/messages", 504, "timeout_error")):
            body = {"model": MODEL, "stream": True, "max_tokens": 4, "messages": HI}
            if path == "/v1/responses":
                body = {"model": MODEL, "stream": True, "input": "Hello there"}
            r = await c.post(path, json=body)
            assert (r.status_code, r.json()["error"]["type"]) == (status, kind), (path, r.text)
            assert r.headers["content-type"].startswith("application/json")
        metrics = (await c.get("/metrics")).text
        assert "ninfer_response_failures_total 0.0" in metrics
        # The 429 entered preparation: a rejected generation attempt (the timeouts are queue_timeout).
        assert 'ninfer_requests_total{outcome="rejected"} 1.0' in metrics
        await busy.aclose()


async def test_request_bodies_in_memory_are_bounded(start_server):
    # Lifetime capacity 1: at most two bodies in flight; a third upload is refused before it is read.
    srv = await start_server("--max-concurrency", "1", "--max-pending-requests", "0")
    release = trio.Event()
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 2}).encode()

    async def slow_body():
        yield body[:10]
        await release.wait()
        yield body[10:]

    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        results = []

        async def upload():
            results.append(await c.post("/v1/chat/completions", content=slow_body(),
                                        headers={"content-type": "application/json"}))

        async with trio.open_nursery() as n:
            n.start_soon(upload)
            n.start_soon(upload)
            await wait_for(lambda: srv.app.bodies == 2)
            third = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
            assert third.status_code == 429 and third.json()["error"]["code"] == "server_overloaded"
            release.set()
        # Once their bodies arrived, the Engine's own capacity decides: one runs, one is refused.
        assert sorted(r.status_code for r in results) == [200, 429]
        await wait_for(lambda: srv.app.bodies == 0)  # a handler may finish just after its response


async def test_context_and_thinking_budget_rejections(start_server):
    srv = await start_server("--default-thinking-budget", "4")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": LONG})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded"
        assert err["max_context_tokens"] == 256 and err["prompt_tokens"] > 256
        assert str(err["prompt_tokens"]) in err["message"]
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 6})
        assert r.status_code == 400 and r.json()["error"]["code"] == "thinking_budget_capacity_insufficient"
        # Thinking off: no cap, so the same budget is fine.
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 6,
                                                       "reasoning_effort": "none"})
        assert r.status_code == 200


def test_a_prompt_that_fills_the_ceiling_is_told_it_leaves_no_output_room():
    from types import SimpleNamespace

    from ninfer.engine.errors import ContextLengthExceeded
    from ninfer.server.generation import GenerationSession

    def message(protocol, prompt_tokens):
        return GenerationSession._too_long(SimpleNamespace(protocol=protocol), ContextLengthExceeded(prompt_tokens, 256))
    assert "no room for an output token" in message("openai_chat", 256)
    assert message("openai_chat", 300) == "The prompt has 300 tokens; the context ceiling is 256 tokens."
    assert message("anthropic_messages", 256) == "prompt is too long: 256 tokens > 255 maximum"


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_cancels_and_frees_pages(start_server, stream):
    srv = await start_server("--no-prefix-reuse", scripted=True)
    runner, engine = start_server.runner, srv.state.engine
    runner.gate.clear()
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        if stream:
            resp, _, _ = await open_stream(c)
            await resp.aclose()
        else:
            with trio.move_on_after(0.3):
                await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 200})
            await c.aclose()
    runner.gate.set()
    await wait_for(lambda: engine.stats().requests_total.get("cancelled", 0) == 1)
    await wait_for(lambda: engine.stats().requests_running == 0 and engine.stats().device_kv_used_pages == 0)


async def test_keepalive_comment_while_busy(start_server):
    srv = await start_server(keepalive_s=0.05, scripted=True)
    runner = start_server.runner
    runner.gate.clear()
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        resp, lines, _ = await open_stream(c, max_tokens=3)
        seen = []
        with trio.fail_after(10):
            async for line in lines:
                seen.append(line)
                if line == ": keep-alive":
                    break
        runner.gate.set()
        rest = [line async for line in lines]
        assert rest[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in rest
        await resp.aclose()


async def test_metrics_and_engine_failure(start_server, caplog):
    srv = await start_server(scripted=True)
    runner = start_server.runner
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 4})
        usage = r.json()["usage"]
        text = (await c.get("/metrics")).text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("ninfer_model_info", "ninfer_engine_ready", "ninfer_max_concurrency", "ninfer_max_context_tokens",
                     "ninfer_requests_running", "ninfer_requests_waiting", "ninfer_prompt_tokens",
                     "ninfer_generation_tokens", "ninfer_decode_tokens", "ninfer_device_kv_used_pages",
                     "ninfer_host_work_seconds", "ninfer_requests", "ninfer_time_to_first_token_seconds",
                     "ninfer_request_duration_seconds", "ninfer_request_queue_seconds", "ninfer_response_failures",
                     "ninfer_context_transfer_bytes", "ninfer_spec_decode_rounds", "ninfer_state_image_operations",
                     "ninfer_device_state_used_slots", "ninfer_host_context_used_bytes"):
            assert name in fams, name

        def value(fam, sample_name, **labels):
            return next(s.value for s in fams[fam].samples if s.name == sample_name and
                        all(s.labels.get(k) == v for k, v in labels.items()))

        assert value("ninfer_engine_ready", "ninfer_engine_ready") == 1
        assert value("ninfer_generation_tokens", "ninfer_generation_tokens_total") == usage["completion_tokens"]
        assert value("ninfer_prompt_tokens", "ninfer_prompt_tokens_total") == usage["prompt_tokens"]
        assert value("ninfer_time_to_first_token_seconds", "ninfer_time_to_first_token_seconds_count") == 1
        assert value("ninfer_max_context_tokens", "ninfer_max_context_tokens") == 256

        runner.fail = True
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        r = await c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "unavailable"})
        fams = {f.name: f for f in text_string_to_metric_families((await c.get("/metrics")).text)}
        assert value("ninfer_engine_ready", "ninfer_engine_ready") == 0
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
        assert r.status_code == 503


async def test_internal_error_is_500_and_logged(start_server, caplog):
    srv = await start_server()

    async def broken(ex):
        raise KeyError("invariant")

    srv.app.route("GET", "/v1/broken", broken)
    caplog.set_level(logging.ERROR, logger="ninfer")
    logging.getLogger("ninfer").addHandler(caplog.handler)
    try:
        async with httpx.AsyncClient(base_url=srv.url) as c:
            r = await c.get("/v1/broken")
    finally:
        logging.getLogger("ninfer").removeHandler(caplog.handler)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "invariant" not in r.text
    assert any("internal error" in rec.getMessage() and rec.exc_info for rec in caplog.records)


async def test_request_log_jsonl(start_server, tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("")  # append mode keeps earlier campaigns
    srv = await start_server("--request-log-jsonl", str(path), "--api-key", "topsecret", "--no-prefix-reuse",
                             scripted=True)
    runner = start_server.runner
    secret_prompt = "zebra quokka"
    auth = {"Authorization": "Bearer topsecret"}
    async with httpx.AsyncClient(base_url=srv.url, headers=auth, timeout=30) as c:
        ok = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3, "messages": [
            {"role": "user", "content": secret_prompt}]})
        assert ok.status_code == 200
        bad = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": LONG})
        assert bad.status_code == 400
        runner.gate.clear()
        resp, _, _ = await open_stream(c)
        await resp.aclose()
        runner.gate.set()
        await wait_for(lambda: srv.state.engine.stats().requests_total.get("cancelled", 0) == 1)
    await trio.sleep(0.1)
    raw = path.read_text()
    assert secret_prompt not in raw and "topsecret" not in raw
    records = [json.loads(line) for line in raw.splitlines()]
    for rec in records:
        assert rec["schema"] == SCHEMA and rec["schema_version"] == SCHEMA_VERSION == 24
        missing = [k for k in COMMON_FIELDS + EVENT_FIELDS[rec["event"]] if k not in rec]
        assert not missing, (rec["event"], missing)
    events = [r["event"] for r in records]
    assert events[0] == "server_start" and "<redacted>" in records[0]["argv"]
    assert events.count("request_start") == 2 and events.count("request_done") == 1
    assert events.count("request_rejected") == 1 and events.count("request_error") == 1
    done = next(r for r in records if r["event"] == "request_done")
    assert done["result"]["completion_tokens"] == 3 and len(done["result"]["generated_token_ids"]) == 3
    rejected = next(r for r in records if r["event"] == "request_rejected")
    assert (rejected["status"], rejected["code"], rejected["phase"]) == (400, "context_length_exceeded", "prepare")
    seqs = [r["request_seq"] for r in records if r["event"] == "request_start"]
    assert seqs == sorted(seqs) and len({r["server_instance_id"] for r in records}) == 1


async def test_kv_pressure_pause_is_logged_and_output_unchanged(start_server, tmp_path):
    """Two requests that cannot both fit the KV pool: one pauses and resumes; both finish intact."""
    path = tmp_path / "log.jsonl"
    srv = await start_server("--kv-capacity", "256", "--max-concurrency", "2", "--no-prefix-reuse",
                             "--request-log-jsonl", str(path))
    body = {"model": MODEL, "messages": HI, "max_tokens": 200, "temperature": 0}
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        alone = (await c.post("/v1/chat/completions", json=body)).json()
        results = []

        async def one():
            results.append((await c.post("/v1/chat/completions", json=body)).json())

        async with trio.open_nursery() as n:
            n.start_soon(one)
            n.start_soon(one)
    for r in results:  # greedy output is the same whether or not the request was paused
        assert r["choices"][0]["message"] == alone["choices"][0]["message"]
        assert r["usage"]["completion_tokens"] == 200
    records = [json.loads(line) for line in path.read_text().splitlines()]
    scheduling = [r for r in records if r["event"] == "request_scheduling"]
    kinds = [r["transition"]["kind"] for r in scheduling]
    assert "paused" in kinds and "restored" in kinds
    for r in scheduling:  # cumulative work: the engine's includes the request's own
        engine, own = r["progress"]["global"], r["progress"]["request"]
        assert set(engine) == set(own) == {"prefill_tokens", "decode_tokens", "replayed_tokens"}
        assert all(engine[k] >= own[k] for k in engine) and engine["prefill_tokens"] > 0
    done = [r for r in records if r["event"] == "request_done" and r["generation"]["scheduling"]["preemptions"]]
    assert done and all(t["progress"]["global"]["decode_tokens"] >= 0 and "kind" in t["transition"]
                        for r in done for t in r["generation"]["scheduling"]["transitions"])
    for r in records:
        assert not [k for k in COMMON_FIELDS + EVENT_FIELDS[r["event"]] if k not in r]


async def test_a_paused_request_whose_client_leaves_still_logs_its_pause(start_server, tmp_path):
    """The request_scheduling records of a paused request come with its request_error too (written
    when its client leaves, before the Engine's cancelled outcome): the boundaries so far."""
    path = tmp_path / "log.jsonl"
    srv = await start_server("--kv-capacity", "256", "--max-concurrency", "2", "--no-prefix-reuse",
                             "--request-log-jsonl", str(path), scripted=True)
    start_server.runner.delay = 0.01  # 200 tokens: the first request holds its pages for 2 s or more
    engine = srv.state.engine
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
        streams = [await open_stream(c), await open_stream(c)]
        await wait_for(lambda: engine.stats().preemptions_total >= 1)
        for response, _, _ in streams:
            await response.aclose()
        await wait_for(lambda: engine.stats().requests_total.get("cancelled", 0) == 2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    errors = {r["request_id"] for r in records if r["event"] == "request_error"}
    kinds = [r["transition"]["kind"] for r in records if r["event"] == "request_scheduling" and r["request_id"] in errors]
    assert len(errors) == 2 and kinds[:2] == ["pause_started", "paused"], kinds
    for r in records:
        assert not [k for k in COMMON_FIELDS + EVENT_FIELDS[r["event"]] if k not in r]


async def test_disconnect_while_waiting_cancels_and_frees_the_slot(start_server):
    srv = await start_server("--max-concurrency", "1", "--max-pending-requests", "1", scripted=True)
    runner, engine = start_server.runner, srv.state.engine
    runner.delay = 0.02  # the resident request stays busy; the worker keeps scheduling
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        # Keep the line iterators referenced: a collected iterator closes its response.
        busy, busy_lines, _ = await open_stream(c)
        # Queued behind the busy lane: a stream starts only once admitted, so the client gives up
        # before any response arrives.
        with trio.CancelScope() as waiting:
            async with trio.open_nursery() as n:
                n.start_soon(open_stream, c)
                await wait_for(lambda: engine.stats().requests_waiting == 1)
                waiting.cancel()
        await wait_for(lambda: engine.stats().requests_total.get("cancelled", 0) == 1)
        assert engine.stats().requests_waiting == 0
        # Its pending slot is free again: a newcomer queues instead of getting 429.
        with trio.move_on_after(0.5) as scope:
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 1})
        assert scope.cancelled_caught or r.status_code == 200
        await busy.aclose()


async def test_throughput_records_only_for_busy_intervals(start_server, tmp_path):
    path = tmp_path / "tp.jsonl"
    srv = await start_server("--log-stats-interval-ms", "50", "--request-log-jsonl", str(path), scripted=True)
    start_server.runner.delay = 0.01
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 30})
    await trio.sleep(0.5)  # several idle intervals: they add nothing
    records = [json.loads(line) for line in path.read_text().splitlines()]
    tp = [r for r in records if r["event"] == "throughput"]
    assert tp and all(not [k for k in COMMON_FIELDS + EVENT_FIELDS["throughput"] if k not in t] for t in tp)
    assert sum(t["generation_tokens"] for t in tp) == r.json()["usage"]["completion_tokens"]
    assert sum(t["decode_tokens"] for t in tp) == r.json()["usage"]["completion_tokens"] - 1  # first is prefill's
    n = len(tp)
    await trio.sleep(0.3)
    assert len([line for line in path.read_text().splitlines() if '"throughput"' in line]) == n


async def test_a_finished_result_holds_its_slot_until_the_reply_is_written(start_server, monkeypatch):
    # Lifetime capacity 1: while the first reply is still being written (its send held open here),
    # the Engine has finished it, but the slot stays taken, so a newcomer is refused.
    from ninfer.server.app import Exchange

    srv = await start_server("--max-concurrency", "1", "--max-pending-requests", "0")
    writing, release = trio.Event(), trio.Event()
    send_json = Exchange.send_json

    async def held_send(self, status, obj):
        if status == 200 and not release.is_set():
            writing.set()
            await release.wait()
        await send_json(self, status, obj)

    monkeypatch.setattr(Exchange, "send_json", held_send)
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        first = []
        async with trio.open_nursery() as n:
            n.start_soon(lambda: _append(first, c.post("/v1/chat/completions", json=body)))
            await writing.wait()
            refused = await c.post("/v1/chat/completions", json=body)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "server_overloaded"
            release.set()
        assert first[0].status_code == 200
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200  # the slot came back


async def _append(out: list, request) -> None:
    out.append(await request)


async def test_a_rejection_is_logged_with_the_status_its_family_sent(start_server, tmp_path):
    path = tmp_path / "log.jsonl"
    srv = await start_server("--max-concurrency", "1", "--max-pending-requests", "0", "--request-log-jsonl",
                             str(path), scripted=True)
    runner = start_server.runner
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        runner.gate.clear()
        busy, busy_lines, _ = await open_stream(c)  # holds the one slot (the lines keep it open)
        r = await c.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": HI})
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI})
        assert r.status_code == 429
        await busy.aclose()
        runner.gate.set()
    rejected = [json.loads(line) for line in path.read_text().splitlines()]
    rejected = [(r["protocol"], r["status"], r["type"]) for r in rejected if r["event"] == "request_rejected"]
    assert rejected == [("anthropic_messages", 529, "overloaded_error"), ("openai_chat", 429, "server_error")]


async def test_a_kv_pool_below_the_max_context_lowers_the_ceiling_with_a_warning(start_server, caplog):
    caplog.set_level(logging.WARNING, logger="ninfer")
    srv = await start_server("--kv-capacity", "128")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        assert (await c.get("/v1/models")).json()["data"][0]["max_model_len"] == 128
    assert any("the context ceiling is 128 tokens, below --max-context 256" in r.getMessage() for r in caplog.records)
