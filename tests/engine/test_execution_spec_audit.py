"""Spec "Execution behavior" cases the other engine tests do not reach (simulated runners, driven
step by step): each one failed before its fix."""

from __future__ import annotations

import pytest

from ninfer.engine import EngineConfig
from ninfer.engine.events import Finished, TokenDelta
from ninfer.engine.scheduler import MAX_BYPASS
from ninfer.engine.sequence import Phase
from ninfer.engine.simulated import SimulatedHybridRunner

from .conftest import CoreDriver, pause_cycles


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(j * 7 + salt) % 50 + 1 for j in range(n)]


def finished(seq) -> Finished:
    ends = [e for e in seq.outbox if isinstance(e, Finished)]
    assert len(ends) == 1, f"{seq} ended {len(ends)} times"
    return ends[0]


@pytest.mark.parametrize("recurrent", [False, True])
def test_a_replayed_prompt_that_fills_the_ceiling_is_restored(recurrent):
    # "Restoration ... reserves enough space to rebuild the saved frontier and complete one new
    # execution unit": a max_tokens=0 prompt of exactly max_context tokens, in a pool of exactly
    # one such sequence, is paused mid-prompt without Host backing (replay). Its restore once
    # reserved one position past the prompt — a page the pool does not have — so it stayed paused
    # forever once the older request had finished.
    cfg = EngineConfig(max_concurrency=2, max_context=64, page_size=16, prefill_chunk=16, host_context_mib=0,
                       prefix_reuse=False)
    runner = None
    if recurrent:
        runner = SimulatedHybridRunner(page_size=16, num_pages=cfg.kv_pages, max_batch=2, max_context=64,
                                       state_slots=cfg.state_slots - cfg.max_concurrency)
    d = CoreDriver(cfg, runner=runner)
    older = d.submit(prompt(20), 1000)  # grows to the ceiling, pushing the younger one out
    full = d.submit(prompt(64, salt=3), 0)
    for _ in range(200):
        if full.phase is Phase.PAUSED:
            break
        d.core.step()
    assert full.phase is Phase.PAUSED and full.route == "replay" and 0 < full.prompt_high < 64
    d.run(max_steps=500)
    assert not d.core.has_work(), "the paused request was never restored"
    f = finished(full)
    assert (f.reason, f.detail) == ("length", "max_tokens") and f.usage.completion_tokens == 0
    assert not [e for e in full.outbox if isinstance(e, TokenDelta)]
    assert f.scheduling.replay_restores >= 1
    pause_cycles(f)
    assert finished(older).detail == "context"
    core = d.core
    assert core.slots.used == 0 and core.host.used == 0
    assert core.pool.free_count == core.pool.capacity


def _driver() -> CoreDriver:
    # A 6-page pool and no Host backing (pauses replay); requests grow up to 60 tokens (4 pages).
    return CoreDriver(EngineConfig(max_concurrency=4, max_context=64, kv_capacity=6 * 16, prefill_chunk=1024,
                                   page_size=16, host_context_mib=0))


def _step_until(d: CoreDriver, done) -> None:
    for _ in range(1000):
        if done():
            return
        d.core.step()
    raise AssertionError("the engine did not get there")


def test_a_paused_request_does_not_hold_back_fresh_requests_that_fit():
    d = _driver()
    older, younger = d.submit(prompt(20, 1), 40), d.submit(prompt(20, 2), 40)
    _step_until(d, lambda: younger.phase is Phase.PAUSED)  # it cannot restore while the older one runs
    small = [d.submit([5, 6, 7], 1) for _ in range(MAX_BYPASS + 3)]  # a page each, finished by their prefill
    _step_until(d, lambda: older.phase is Phase.DONE or all(s.phase is Phase.DONE for s in small))
    assert older.phase is not Phase.DONE and younger.phase is Phase.PAUSED  # more than MAX_BYPASS went past
    d.run()
    assert finished(younger).reason == finished(older).reason == "length"


def test_paused_requests_restore_in_request_order():
    d = _driver()
    a, b, c = d.submit(prompt(20, 1), 40), d.submit(prompt(20, 2), 40), d.submit(prompt(4, 3), 40)
    _step_until(d, lambda: b.phase is Phase.PAUSED and c.phase is Phase.PAUSED)
    # c (paused first, two pages to restore) would fit the free pages; b (four) waits for a: c waits too.
    assert d.core.pool.free_count >= 2
    _step_until(d, lambda: a.phase is Phase.DONE or c.phase is not Phase.PAUSED)
    assert a.phase is Phase.DONE and c.phase is Phase.PAUSED
    _step_until(d, lambda: b.phase is not Phase.PAUSED or c.phase is not Phase.PAUSED)
    assert b.phase is not Phase.PAUSED and c.phase is Phase.PAUSED
    d.run()
    assert [finished(s).reason for s in (a, b, c)] == ["length"] * 3
