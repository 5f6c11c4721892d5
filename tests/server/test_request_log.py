"""The JSONL request log against the spec's event contents (Structured request log), on the live server."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import httpx
import pytest
import trio

from ninfer.artifact import open_artifact
from ninfer.backends.reference import ReferenceRunner
from ninfer.engine.events import EngineTiming, Finished, SchedulingCounters, Timings, TokenDelta, Usage
from ninfer.engine.signature import model_signature
from ninfer.observability.request_log import COMMON_FIELDS, EVENT_FIELDS, RequestLog
from ninfer.server.generation import GenerationSession
from ninfer.text.output import OutputStats

MODEL = "random-tiny-qwen3"
HI = [{"role": "user", "content": "Hello there"}]


def read_log(path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for rec in records:
        missing = [k for k in COMMON_FIELDS + EVENT_FIELDS[rec["event"]] if k not in rec]
        assert not missing, (rec["event"], missing)
    return records


def only(records: list[dict], event: str) -> dict:
    found = [r for r in records if r["event"] == event]
    assert len(found) == 1, (event, len(found))
    return found[0]


async def test_the_stderr_completion_record_shows_the_cache_share_and_path(start_server, caplog):
    caplog.set_level(logging.INFO, logger="ninfer")
    srv = await start_server()
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        for _ in range(2):  # the second finds the first one's prompt retained
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2})
    cached, prompt = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.json()["usage"]["prompt_tokens"]
    done = [rec.getMessage() for rec in caplog.records if " done: " in rec.getMessage()]
    assert "(cache 0 (0%, no reuse))" in done[0] and cached > 0
    assert f"(cache {cached} ({100 * cached / prompt:.0f}%, reused checkpoint))" in done[1]


async def test_request_done_has_first_output_timing_and_speculative(start_server, tmp_path):
    """Spec: request_done.first_output_timing (null only without output) and the speculative
    object of timings_seconds; engine_timing's nested decode and units objects."""
    path = tmp_path / "log.jsonl"
    srv = await start_server("--request-log-jsonl", str(path))
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 4})
    assert r.status_code == 200
    done = only(read_log(path), "request_done")
    first, timings = done["first_output_timing"], done["timings_seconds"]
    assert first is not None
    assert set(first) >= {"elapsed_seconds", "queue_seconds", "paused_seconds", "resident_seconds",
                          "host_exposed_seconds", "device_wait_exposed_seconds", "prefill_tokens", "replayed_tokens"}
    assert first["queue_seconds"] == timings["queue"] and first["elapsed_seconds"] == timings["ttft"]
    assert first["prefill_tokens"] == done["result"]["computed_prefill_tokens"]
    # frozen as the step that made the first token commits it: that step's prefill is in it
    assert first["device_wait_exposed_seconds"] > 0 and first["host_exposed_seconds"] > 0
    assert "speculative" in timings and timings["speculative"] is None  # no speculative backend in this build
    # work: the reference backend has no device to time; the context copies are scheduling's
    assert done["work"] == {"gpu_seconds": None,
                            "context_transfers": done["generation"]["scheduling"]["context_transfers"]}
    et = done["engine_timing"]
    assert et["units"] == {"prefill": et["prefill_units"], "control": et["control_units"]}
    assert et["decode"]["rounds"] == et["decode_rounds"] == 3  # four outputs: the first comes from prefill
    # Host exposure: the five worker phases (maintenance runs between steps: nobody's) and their sum.
    host = et["host_exposed_seconds"]
    assert set(host) == {"engine_boundary", "program_submit", "program_post", "engine_commit_output",
                         "engine_maintenance", "total"}
    assert host["engine_maintenance"] == 0.0 and host["engine_boundary"] > 0 and host["program_post"] > 0
    assert host["total"] == sum(v for k, v in host.items() if k != "total")
    decode = et["decode"]
    assert 0 < decode["host_exposed_seconds"] < host["total"]  # the prefill unit's step is not decode
    assert 0 < decode["device_wait_exposed_seconds"] < et["device_wait_exposed_seconds"]


async def test_request_error_carries_the_resolved_configuration(start_server, tmp_path):
    """Spec: request_error contains the resolved request configuration and the terminal message."""
    path = tmp_path / "log.jsonl"
    srv = await start_server("--request-log-jsonl", str(path), scripted=True)
    runner = start_server.runner
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        runner.gate.clear()  # hold the worker so the client leaves before the outcome
        req = c.build_request("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": HI, "max_tokens": 50, "stream": True, "temperature": 0.5, "seed": 7})
        resp = await c.send(req, stream=True)
        lines = resp.aiter_lines()
        await anext(lines)
        await resp.aclose()
        runner.gate.set()
        with trio.fail_after(10):
            while srv.state.engine.stats().requests_total.get("cancelled", 0) == 0:
                await trio.sleep(0.01)
    await trio.sleep(0.1)
    records = read_log(path)
    start, error = only(records, "request_start"), only(records, "request_error")
    assert error["phase"] == "cancelled"
    for key in ("stream", "shape", "sampling", "max_tokens", "requested_reasoning_effort", "enable_thinking",
                "preserve_thinking", "thinking_budget", "prompt_tokens", "stop_strings", "cache_boundaries"):
        assert error[key] == start[key], key
    assert error["sampling"]["temperature"] == 0.5 and error["sampling"]["seed"] == 7 and error["max_tokens"] == 50


async def test_server_start_records_the_sampler_defaults(start_server, tmp_path):
    """Spec: server_start has the thinking/non-thinking sampler defaults plus the process overrides;
    a request that sets nothing is sampled with its mode's default and the process flags."""
    path = tmp_path / "log.jsonl"
    srv = await start_server("--request-log-jsonl", str(path), "--top-k", "5")
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 1})
    assert r.status_code == 200
    records = read_log(path)
    server, start = only(records, "server_start"), only(records, "request_start")
    defaults = server["sampling_defaults"]
    assert set(defaults) == {"thinking", "non_thinking"}
    assert server["sampling_overrides"]["top_k"] == 5
    mode = "thinking" if start["enable_thinking"] else "non_thinking"
    expected = {**defaults[mode], "top_k": 5}
    assert {k: v for k, v in start["sampling"].items() if k != "seed"} == expected


async def test_throughput_uses_the_spec_names(start_server, tmp_path):
    """Spec: JSONL average_size = decode row-rounds / decode rounds; the scheduler snapshot names
    capture_pending and terminal_pending; the separate scheduling object; host_work names its
    work-class and detail members."""
    path = tmp_path / "tp.jsonl"
    srv = await start_server("--log-stats-interval-ms", "50", "--request-log-jsonl", str(path), scripted=True)
    start_server.runner.delay = 0.01
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 30})
    assert r.status_code == 200
    await trio.sleep(0.2)
    tp = [rec for rec in read_log(path) if rec["event"] == "throughput"]
    assert tp and sum(t["decode_rounds"] for t in tp) == 29
    for t in tp:
        rounds, rows = t["decode_rounds"], t["decode_row_rounds"]
        assert t["average_size"] == (rows / rounds if rounds else None)
        assert {"capture_pending", "terminal_pending"} <= set(t["scheduler"])
        assert t["scheduling"] == {k: t[k] for k in ("preemptions", "snapshot_restores", "replay_restores",
                                                      "replayed_tokens")}
        assert {"work_class_seconds", "detail_subset_seconds", "detail_invocations"} <= set(t["host_work"])
    # Stats publication is detail inside the Host phases: counted, and never more than they hold.
    published = sum(t["host_work"]["detail_invocations"]["stats_publication"] for t in tp)
    seconds = sum(t["host_work"]["detail_subset_seconds"]["stats_publication"] for t in tp)
    phases = sum(t["host_work"]["elapsed_seconds"]["engine_commit_output"]
                 + t["host_work"]["elapsed_seconds"]["engine_maintenance"] for t in tp)
    assert published >= 1 and 0 < seconds <= phases
    # The work classes partition the Host phases' total and the Device wait; this run decoded and prefilled.
    for t in tp:
        classes, work = t["host_work"]["work_class_seconds"], t["host_work"]
        assert set(classes) == {"decode", "prefill", "control"}
        assert sum(v["host"] for v in classes.values()) == pytest.approx(work["elapsed_seconds"]["total"], abs=1e-9)
        assert sum(v["device_wait"] for v in classes.values()) == pytest.approx(work["device_wait_seconds"], abs=1e-9)
    assert sum(t["host_work"]["work_class_seconds"]["decode"]["device_wait"] for t in tp) > 0
    assert sum(t["host_work"]["work_class_seconds"]["prefill"]["device_wait"] for t in tp) > 0


async def test_request_start_records_payload_acquisition_tokenizer_and_media(start_server, tmp_path):
    """Spec: request_start carries request-scoped acquisition, media-preprocessing wall/work,
    tokenizer, cache and payload-size fields — here for each API family, from its own request."""
    path = tmp_path / "log.jsonl"
    srv = await start_server("--request-log-jsonl", str(path))
    bodies = {  # the exact bytes sent: payload_bytes must be their length
        "/v1/chat/completions": {"model": MODEL, "messages": HI, "max_tokens": 2},
        "/v1/responses": {"model": MODEL, "input": "Hello there, a longer input", "max_output_tokens": 2},
        "/v1/messages": {"model": MODEL, "messages": HI, "max_tokens": 2, "system": "Be brief."},
    }
    sent = {}
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        for route, obj in bodies.items():
            raw = json.dumps(obj, indent=1).encode()  # whitespace a re-serialization would not keep
            r = await c.post(route, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            sent[route] = len(raw)
    records = read_log(path)
    starts = [r for r in records if r["event"] == "request_start"]
    done = {r["request_seq"]: r for r in records if r["event"] == "request_done"}
    assert [s["payload_bytes"] for s in starts] == list(sent.values())
    assert [s["protocol"] for s in starts] == ["openai_chat", "openai_responses", "anthropic_messages"]
    for start in starts:
        prepare = done[start["request_seq"]]["timings_seconds"]["prepare"]
        assert isinstance(start["acquisition_seconds"], float) and 0 <= start["acquisition_seconds"] <= prepare
        tok = start["tokenizer"]
        assert set(tok) == {"seconds", "tokens", "cache_hint_seconds", "cache"}
        assert tok["tokens"] == start["prompt_tokens"] == done[start["request_seq"]]["result"]["prompt_tokens"]
        assert 0 < tok["seconds"] <= prepare and 0 <= tok["cache_hint_seconds"] <= tok["seconds"]
        assert tok["cache"] is None  # the prompt builder keeps no prompt cache
        # No Vision in this build: media requests are refused before preparation.
        assert start["media"] == {"items": 0, "wall_seconds": None, "work_seconds": None, "cache": None}
    error_fields = EVENT_FIELDS["request_error"]
    assert not {"payload_bytes", "acquisition_seconds", "tokenizer", "media"} & set(error_fields)


async def test_server_start_records_formats_and_model_signature(start_server, tiny_artifact, tmp_path):
    """Spec: server_start has the actual formats and the prefill signature: the Engine's model
    signature equals ``model_signature`` of a reference runner over the same artifact."""
    path = tmp_path / "log.jsonl"
    srv = await start_server("--request-log-jsonl", str(path))
    server = only(read_log(path), "server_start")
    assert server["model_signature"] == srv.state.engine.signature
    with open_artifact(tiny_artifact) as art:
        runner = ReferenceRunner(art, page_size=16, num_pages=2, max_batch=1, max_context=32)
        try:
            expected = model_signature(runner)
        finally:
            runner.close()
        dtypes = sorted(art.tensor_info(name).dtype for name in art.tensor_names())
    assert expected is not None and expected.startswith(server["architecture"]) and "-float32-" in expected
    assert server["model_signature"] == expected
    formats = server["formats"]
    assert formats["weights"] == "f32" and formats["kv"] == "f32"  # the reference backend upcasts
    assert formats["artifact"] == {d: dtypes.count(d) for d in sorted(set(dtypes))}
    assert sum(formats["artifact"].values()) > 0


class _Handle:
    """An engine handle that has already returned its outcome."""

    def __init__(self, events):
        self._events = events

    async def _iterate(self):
        for ev in self._events:
            yield ev

    def __aiter__(self):
        return self._iterate()

    def stop(self):
        pass

    async def aclose(self):
        pass


class _Decoder:
    """An output decoder holding back text until finish (a partial stop-string prefix, say)."""

    stopped = None

    def push(self, token_ids):
        return []

    def finish(self):
        return ["held-back text"]

    @property
    def stats(self):
        return OutputStats(0, 1, {"fallback_reason": "none"})


async def test_request_done_is_written_when_the_outcome_arrives(tmp_path):
    """Spec: request_done is written when the Engine returns its outcome. A client that leaves while
    the decoder's trailing output is being sent must not leave the started request without a terminal."""
    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path))
    finished = Finished(
        reason="stop", detail="eos", usage=Usage(prompt_tokens=4, cached_tokens=0, completion_tokens=1),
        timings=Timings(queue=0.0, prompt=0.1, generation=0.0, total=0.1, ttft=0.1),
        scheduling=SchedulingCounters(),
        engine_timing=EngineTiming(queue_wait_seconds=0.0, host_exposed_seconds=0.0, device_wait_exposed_seconds=0.0,
                                   decode_rounds=0, prefill_units=1, control_units=0),
        prefix_reuse_path="root", generated_token_ids=(5,), seed=1)
    session = GenerationSession(SimpleNamespace(request_log=log), "req-1", protocol="openai_chat", stream=True)
    session.handle, session.decoder = _Handle([TokenDelta((5,)), finished]), _Decoder()
    events = session.events()
    assert await anext(events) == "held-back text"
    await events.aclose()  # the client is gone: the family stops consuming
    log.close()
    records = read_log(path)
    assert [r["event"] for r in records] == ["request_done"]
    assert records[0]["first_output_timing"] is None  # no first output was frozen


async def test_request_start_flags_a_responses_semantic_branch(start_server, tmp_path):
    """Spec: request_start carries the Responses semantic-change flag: a child that sets
    preserve_thinking unlike its parent starts a new semantic branch; inheriting or repeating it does not."""
    path = tmp_path / "log.jsonl"
    srv = await start_server("--request-log-jsonl", str(path))
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        async def create(**kw):
            body = {"model": MODEL, "input": "Hello there", "max_output_tokens": 2, **kw}
            r = await c.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            return r.json()["id"]

        root = await create(preserve_thinking=True)
        for kw in ({}, {"preserve_thinking": True}, {"preserve_thinking": False}):
            await create(previous_response_id=root, **kw)
    starts = [r for r in read_log(path) if r["event"] == "request_start"]
    assert [r["shape"]["semantic_change"] for r in starts] == [False, False, False, True]
    # The explicit option, null when the request left it to the chain (the child still inherits it).
    assert [r["preserve_thinking"] for r in starts] == [True, None, True, False]


async def test_a_responses_parent_that_cannot_be_continued_is_a_rejected_preparation(start_server, tmp_path):
    """Spec: a preparation failure produces request_rejected without a matching start. Resolving a
    Responses request's stored parent is preparation: an unknown id, or an input Item the chain
    already holds, is logged with the status, code and parameter the client gets."""
    path = tmp_path / "log.jsonl"
    srv = await start_server("--request-log-jsonl", str(path))
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
        missing = await c.post("/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": "resp_x",
                                                      "reasoning": {"effort": "low"}})
        root = (await c.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 1, "input": [
            {"type": "message", "id": "msg_1", "role": "user", "content": "Hi"}]})).json()["id"]
        again = await c.post("/v1/responses", json={"model": MODEL, "previous_response_id": root, "input": [
            {"type": "message", "id": "msg_1", "role": "user", "content": "Hi"}]})
    assert missing.status_code == 404 and again.status_code == 400
    records = read_log(path)
    rejected = [r for r in records if r["event"] == "request_rejected"]
    assert [(r["status"], r["code"], r["param"]) for r in rejected] == [
        (404, "response_not_found", "previous_response_id"), (400, "invalid_value", "input[0].id")]
    assert rejected[0]["requested_reasoning_effort"] == "low" and rejected[0]["shape"]["previous_response_id"]
    assert [r["event"] for r in records if r["event"].startswith("request_")].count("request_start") == 1  # the root's
    assert {r["request_id"] for r in rejected} == {missing.headers["x-request-id"], again.headers["x-request-id"]}
