"""The trio facade: reserve → submit → events, over the simulated runner on the worker thread."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from ninfer.engine import Engine, EngineConfig, GenerationRequest, SamplingOverrides, ThinkingControl
from ninfer.engine.errors import (ContextCostPresetsError, ContextLengthExceeded, EngineUnavailable, InvalidPrompt,
                                  Overloaded, QueueTimeout, ThinkingBudgetCapacityInsufficient)
from ninfer.engine.events import Finished, PromptProgress, TokenDelta
from ninfer.engine.simulated import SimulatedRunner
from ninfer.engine.worker import DELIVERY_INTERVAL

GREEDY = SamplingOverrides(temperature=0.0)


def config(**kw):
    base = dict(max_concurrency=2, max_context=256, kv_capacity=512, prefill_chunk=32)
    base.update(kw)
    return EngineConfig(**base)


def runner_for(cfg: EngineConfig, **kw) -> SimulatedRunner:
    return SimulatedRunner(page_size=cfg.page_size, num_pages=cfg.kv_pages, max_batch=cfg.max_concurrency,
                           vocab_size=256,
                           max_context=cfg.max_context, **kw)


class GatedRunner(SimulatedRunner):
    """Decode blocks until the test opens the gate: a resident request that cannot finish."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = threading.Event()

    def decode(self, batch):
        assert self.gate.wait(timeout=10)
        return super().decode(batch)


async def collect(handle):
    events = [ev async for ev in handle]
    return events


async def test_one_request_streams_progress_tokens_and_one_finished():
    cfg = config()
    async with Engine.open(runner_for(cfg), cfg) as engine:
        with engine.reserve() as ticket:
            events = await collect(ticket.submit(GenerationRequest(prompt=range(70), max_tokens=5, sampling=GREEDY)))
    progress = [e for e in events if isinstance(e, PromptProgress)]
    tokens = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    assert isinstance(events[-1], Finished) and sum(isinstance(e, Finished) for e in events) == 1
    assert progress[-1].processed == progress[-1].total == 70
    assert [p.processed for p in progress] == sorted(p.processed for p in progress)
    assert len(tokens) == 5 and events[-1].generated_token_ids == tuple(tokens)
    assert events[-1].reason == "length" and events[-1].detail == "max_tokens"
    assert events[-1].usage.completion_tokens == 5 and events[-1].usage.prompt_tokens == 70
    stats = engine.stats()
    assert stats.generation_tokens_total == 5 and stats.prompt_tokens_total == 70
    assert stats.requests_total == {"length": 1}


async def test_overload_counts_reserved_and_unreleased_tickets():
    cfg = config(max_concurrency=1, max_pending_requests=1)
    async with Engine.open(runner_for(cfg), cfg) as engine:
        t1 = engine.reserve()
        t2 = engine.reserve()
        with pytest.raises(Overloaded):
            engine.reserve()
        t1.release()
        t3 = engine.reserve()  # released capacity is reusable
        # A finished but unreleased result still holds its slot.
        with t2:
            events = await collect(t2.submit(GenerationRequest(prompt=[1, 2, 3], max_tokens=2, sampling=GREEDY)))
            assert isinstance(events[-1], Finished)
            with pytest.raises(Overloaded):
                engine.reserve()
        t3.release()
        engine.reserve().release()


async def test_queue_timeout_when_admission_does_not_happen_in_time():
    cfg = config(max_concurrency=1, pending_timeout_ms=50)
    runner = GatedRunner(page_size=16, num_pages=cfg.kv_pages, max_batch=1, max_context=256, vocab_size=256)
    async with Engine.open(runner, cfg) as engine:
        with engine.reserve() as long_ticket:
            long = long_ticket.submit(GenerationRequest(prompt=[1] * 10, max_tokens=20, sampling=GREEDY))
            with engine.reserve() as ticket:
                handle = ticket.submit(GenerationRequest(prompt=[2] * 10, max_tokens=5, sampling=GREEDY))
                with pytest.raises(QueueTimeout):
                    await collect(handle)
            runner.gate.set()
            assert (await collect(long))[-1].reason == "length"
        # Queue saturation does not make the engine unavailable.
        assert engine.ready
        assert engine.stats().requests_total == {"queue_timeout": 1, "length": 1}


async def test_cancelling_the_consuming_task_cancels_the_request_and_frees_pages():
    cfg = config(max_concurrency=1)
    runner = GatedRunner(page_size=16, num_pages=cfg.kv_pages, max_batch=1, max_context=256, vocab_size=256)
    async with Engine.open(runner, cfg) as engine:
        with engine.reserve() as ticket:
            handle = ticket.submit(GenerationRequest(prompt=[3] * 40, max_tokens=200, sampling=GREEDY))
            with trio.move_on_after(0.1):
                async for _ in handle:
                    pass
        runner.gate.set()
        for _ in range(200):
            stats = engine.stats()
            if stats.requests_total.get("cancelled"):
                break
            await trio.sleep(0.01)
        assert stats.requests_total == {"cancelled": 1}
        assert stats.requests_running == 0 and stats.device_state_used_slots == 0
        # Only the retained prefix cache holds pages now, and nothing is locked.
        assert engine._core.cache.reclaim(10**6) == stats.device_kv_used_pages


async def test_leaving_the_ticket_block_early_cancels():
    cfg = config(max_concurrency=1)
    runner = GatedRunner(page_size=16, num_pages=cfg.kv_pages, max_batch=1, max_context=256, vocab_size=256)
    async with Engine.open(runner, cfg) as engine:
        with engine.reserve() as ticket:
            handle = ticket.submit(GenerationRequest(prompt=[3] * 40, max_tokens=200, sampling=GREEDY))
            async for event in handle:
                if isinstance(event, TokenDelta):  # the first token comes from prefill, ungated
                    break
        runner.gate.set()  # the worker was held in the next decode: the cancel is already posted
        with engine.reserve() as ticket:  # the next one runs: the lane was freed
            events = await collect(ticket.submit(GenerationRequest(prompt=[4] * 5, max_tokens=3, sampling=GREEDY)))
        assert events[-1].reason == "length"
        assert engine.stats().requests_total == {"cancelled": 1, "length": 1}


async def test_stop_finishes_with_stop_string():
    cfg = config(max_concurrency=1)
    runner = GatedRunner(page_size=16, num_pages=cfg.kv_pages, max_batch=1, max_context=256, vocab_size=256)
    async with Engine.open(runner, cfg) as engine:
        with engine.reserve() as ticket:
            handle = ticket.submit(GenerationRequest(prompt=[5] * 8, max_tokens=200, sampling=GREEDY))
            events = []
            async for event in handle:
                events.append(event)
                if isinstance(event, TokenDelta) and not runner.gate.is_set():
                    handle.stop()  # posted while the worker is held in the next decode
                    runner.gate.set()
    assert (events[-1].reason, events[-1].detail) == ("stop", "stop_string")
    # The worker committed one more token before it saw the stop: it is not output.
    received = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    assert events[-1].usage.completion_tokens == len(received) == 1
    assert events[-1].generated_token_ids == tuple(received)
    assert engine.stats().generation_tokens_total == 2


class HoldsAfter(SimulatedRunner):
    """Decodes ``free`` steps, then blocks each one until the test opens the gate. The last free
    step outlasts the worker's delivery interval, so the next step's delivery (which runs before
    its decode) wakes the consumer with every token so far instead of coalescing them behind the
    held decode."""

    def __init__(self, free: int, **kw):
        super().__init__(**kw)
        self.free = free
        self.gate = threading.Event()

    def decode(self, batch):
        self.free -= 1
        if self.free == 0:
            time.sleep(10 * DELIVERY_INTERVAL)
        elif self.free < 0:
            assert self.gate.wait(timeout=10)
        return super().decode(batch)


async def test_stop_keeps_the_tokens_up_to_the_match():
    # The text layer may match a stop inside a delta: the output ends where it says, not at the delta's end.
    # The worker is held after four decode steps until the stop is posted, so the request cannot
    # reach max_tokens first, however the two threads are scheduled.
    cfg = config(max_concurrency=1)
    runner = HoldsAfter(4, page_size=16, num_pages=cfg.kv_pages, max_batch=1, max_context=256, vocab_size=256)
    async with Engine.open(runner, cfg) as engine:
        with engine.reserve() as ticket:
            handle = ticket.submit(GenerationRequest(prompt=[5] * 8, max_tokens=200, sampling=GREEDY))
            received, finished, stopped = [], None, False
            async for event in handle:
                if isinstance(event, TokenDelta):
                    received += event.token_ids
                    if len(received) >= 3 and not stopped:
                        handle.stop(len(received) - 1)
                        stopped = True
                        runner.gate.set()
                elif isinstance(event, Finished):
                    finished = event
    assert (finished.reason, finished.detail) == ("stop", "stop_string")
    assert finished.usage.completion_tokens == len(received) - 1
    assert finished.generated_token_ids == tuple(received[:-1])


async def test_preparation_rejections_are_typed():
    cfg = config(max_context=64)
    async with Engine.open(runner_for(cfg), cfg) as engine:
        with engine.reserve() as ticket:
            with pytest.raises(ContextLengthExceeded) as exc:
                ticket.submit(GenerationRequest(prompt=[1] * 64, max_tokens=1))
            assert exc.value.limit == 64
        with engine.reserve() as ticket:
            think = ThinkingControl(starts_in_thinking=True, budget=10, close_ids=(7, 8, 9), end_think_id=9)
            with pytest.raises(ThinkingBudgetCapacityInsufficient):
                ticket.submit(GenerationRequest(prompt=[1] * 4, max_tokens=13, thinking=think))
            # Capacity that ends at the cap, or fits suffix + 1, is fine.
            ticket.submit(GenerationRequest(prompt=[1] * 4, max_tokens=10, thinking=think)).stop()
        with engine.reserve() as ticket:
            with pytest.raises(ValueError, match="top_k") as exc:
                ticket.submit(GenerationRequest(prompt=[1], max_tokens=1, sampling=SamplingOverrides(top_k=21)))
            assert not isinstance(exc.value, InvalidPrompt)  # the caller's bug, not the prompt's
            with pytest.raises(InvalidPrompt, match="prompt token ids"):
                ticket.submit(GenerationRequest(prompt=[9999], max_tokens=1))
            with pytest.raises(InvalidPrompt, match="at least one token"):
                ticket.submit(GenerationRequest(prompt=[], max_tokens=1))


class ExplodingRunner(SimulatedRunner):
    def decode(self, batch):
        raise RuntimeError("device lost")


async def test_engine_failure_makes_it_unavailable():
    cfg = config(max_concurrency=1)
    async with Engine.open(ExplodingRunner(page_size=16, num_pages=cfg.kv_pages, max_batch=1, max_context=256,
                                           vocab_size=256), cfg) as engine:
        with engine.reserve() as ticket:
            with pytest.raises(EngineUnavailable, match="device lost"):
                await collect(ticket.submit(GenerationRequest(prompt=[1, 2], max_tokens=5)))
        assert not engine.ready and not engine.stats().ready
        with pytest.raises(EngineUnavailable):
            engine.reserve()


class SlowClosingRunner(SimulatedRunner):
    """A runner whose close takes a while, as freeing a GPU's memory does."""

    closed = False

    def close(self):
        time.sleep(0.05)
        self.closed = True


async def test_an_engine_cancelled_from_outside_has_closed_its_runner_when_it_returns():
    """A server stops by cancelling its scope: the engine still waits for its worker to close the
    runner it owns, so the device memory is back before the caller goes on."""
    cfg = config()
    runner = SlowClosingRunner(page_size=16, num_pages=cfg.kv_pages, max_batch=2, max_context=256, vocab_size=256)
    with trio.CancelScope() as scope:
        async with Engine.open(runner, cfg, close_runner=True):
            scope.cancel()
            await trio.sleep_forever()
    assert runner.closed


async def test_malformed_context_cost_presets_abort_startup(tmp_path):
    bad = tmp_path / "presets.json"
    bad.write_text('{"transfer": [{"hardware": "simulated", "seconds_per_byte": -1}]}')
    cfg = config(context_cost_presets=str(bad))
    with pytest.raises(ContextCostPresetsError, match="seconds_per_byte"):
        async with Engine.open(runner_for(cfg), cfg):
            pass
    good = tmp_path / "good.json"
    good.write_text('{"prefill": [{"hardware": "*", "seconds_per_token": 1e-3},'
                    ' {"hardware": "simulated", "seconds_per_token": 2e-3}]}')
    cfg = config(context_cost_presets=str(good))
    async with Engine.open(runner_for(cfg), cfg) as engine:
        source = engine.stats().context_cost_source
        assert "prefill[1]" in source and "model signature unknown" in source  # a runner without a config


async def test_many_concurrent_requests_with_cancels_and_stops_end_cleanly():
    """Worker/trio races: 40 requests over 4 lanes and a small KV pool, some cancelled
    mid-stream, some stopped, some timing out; every handle ends once and nothing leaks."""
    cfg = config(max_concurrency=4, max_pending_requests=40, kv_capacity=256, max_context=128,
                 prefill_chunk=16, host_context_mib=1, pending_timeout_ms=20000)
    runner = runner_for(cfg)
    outcomes = []

    async def one(i: int):
        with engine.reserve() as ticket:
            handle = ticket.submit(GenerationRequest(prompt=[(i % 7) + 1] * (10 + i % 30), max_tokens=20 + i % 25,
                                                     sampling=GREEDY))
            seen = 0
            with trio.move_on_after(0.002 * (i % 5)) if i % 3 == 0 else _null():
                async for event in handle:
                    if isinstance(event, TokenDelta):
                        seen += len(event.token_ids)
                        if i % 4 == 1 and seen >= 3:
                            handle.stop()
                    if isinstance(event, Finished):
                        outcomes.append(event.reason)
                        return
            outcomes.append("left")

    async with Engine.open(runner, cfg) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(40):
                nursery.start_soon(one, i)
        for _ in range(200):
            stats = engine.stats()
            if sum(stats.requests_total.values()) == 40 and stats.requests_running == 0:
                break
            await trio.sleep(0.01)
        assert sum(stats.requests_total.values()) == 40
        assert stats.device_state_used_slots == 0 and stats.host_context_used_bytes == 0
        assert engine._core.cache.reclaim(10**6) == stats.device_kv_used_pages
    assert len(outcomes) == 40 and set(outcomes) <= {"stop", "length", "cancelled", "left"}
    # A consumer may leave after the engine already finished its request: that one is not "cancelled".
    assert 0 < stats.requests_total.get("cancelled", 0) <= outcomes.count("left")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


async def test_a_slow_consumer_still_sees_the_initial_progress_event():
    # The spec's first prompt_progress has processed == cache; coalescing must not merge it away.
    cfg = config()
    async with Engine.open(runner_for(cfg), cfg) as engine:
        with engine.reserve() as ticket:
            handle = ticket.submit(GenerationRequest(prompt=range(70), max_tokens=3, sampling=GREEDY))
            await trio.sleep(0.2)  # let the worker queue every progress event before we read
            events = await collect(handle)
    progress = [e for e in events if isinstance(e, PromptProgress)]
    assert progress[0].processed == progress[0].cache == 0
    assert progress[-1].processed == progress[-1].total == 70
