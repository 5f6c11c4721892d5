"""Property tests of the scheduler and pools under random arrivals, lengths, cancellations and
KV pressure (simulated runner, driven step by step)."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ninfer.engine import EngineConfig, ThinkingControl
from ninfer.engine.events import Finished
from ninfer.engine.scheduler import MAX_BYPASS
from ninfer.engine.sequence import Phase
from ninfer.engine.simulated import SimulatedHybridRunner
from ninfer.engine.stats import TRANSFERS

from .conftest import CoreDriver, pause_cycles
from .conftest import out as outputs

request_st = st.tuples(
    st.integers(0, 12),  # arrival step
    st.integers(1, 70),  # prompt length
    st.one_of(st.integers(0, 40), st.just(1000)),  # max tokens (1000: run to the context limit)
    st.integers(0, 3),  # prompt family (shared prefixes)
    st.one_of(st.none(), st.integers(0, 60)),  # cancel this many steps after arrival
    st.one_of(st.none(), st.integers(1, 12)),  # thinking budget (the request starts thinking)
)
CLOSE = (61, 62)


def prompt(family: int, n: int) -> list[int]:
    return [(family * 13 + j * 5) % 50 + 1 for j in range(n)]


_alone_cache: dict = {}


def thinking(budget):
    if budget is None:
        return ThinkingControl()
    return ThinkingControl(starts_in_thinking=True, budget=budget, close_ids=CLOSE, end_think_id=63)


def driver(cfg: EngineConfig, recurrent: bool) -> CoreDriver:
    if not recurrent:
        return CoreDriver(cfg)
    runner = SimulatedHybridRunner(page_size=cfg.page_size, num_pages=cfg.kv_pages, max_batch=cfg.max_concurrency,
                                   max_context=cfg.max_context, state_slots=cfg.state_slots - cfg.max_concurrency)
    return CoreDriver(cfg, runner=runner)


def alone(p: tuple, max_tokens: int, budget=None, context: int = 128, recurrent: bool = False) -> list[int]:
    key = (p, max_tokens, budget, context, recurrent)
    if key not in _alone_cache:
        d = driver(EngineConfig(max_concurrency=1, max_context=context, kv_capacity=context, page_size=8,
                                prefix_reuse=False, prefill_chunk=16), recurrent)
        s = d.submit(list(p), max_tokens, thinking=thinking(budget))
        d.run()
        _alone_cache[key] = outputs(s)
    return _alone_cache[key]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request_st, min_size=1, max_size=10),
       lanes=st.integers(1, 4), context=st.sampled_from([48, 128]),
       # Extra pages beyond one max_context sequence; 0 (a pool of exactly one sequence) is the
       # tightest legal pool and is drawn often.
       extra_pages=st.one_of(st.just(0), st.integers(0, 24)), host_mib=st.sampled_from([0, 1]),
       reuse=st.booleans(), chunk=st.sampled_from([8, 16, 64]),
       # A recurrent (hybrid-like) runner with this many checkpoint slots, or None: dense.
       state_slots=st.one_of(st.none(), st.integers(0, 3)))
def test_random_workloads_end_once_without_leaks(requests, lanes, context, extra_pages, host_mib, reuse, chunk,
                                                 state_slots):
    recurrent = state_slots is not None
    cfg = EngineConfig(max_concurrency=lanes, max_context=context, kv_capacity=context + extra_pages * 8,
                       page_size=8, prefix_reuse=reuse, host_context_mib=host_mib, prefill_chunk=chunk,
                       device_state_slots=state_slots)
    d = driver(cfg, recurrent)
    core, sched = d.core, d.core.scheduler
    arrivals = sorted(enumerate(requests), key=lambda x: (x[1][0], x[0]))
    seqs, admitted_order, budgets = {}, [], {}
    step = 0
    while step < 5000:
        for i, (at, n, mt, fam, _, budget) in arrivals:
            if at == step and i not in seqs:
                n = min(n, core.limit - 1)
                capacity = min(mt, core.limit - n)
                if budget is not None and budget < capacity < budget + len(CLOSE) + 1:
                    budget = None  # preparation would reject it (tested elsewhere)
                budgets[i] = budget
                # Every other request names a cache hint (a checkpoint boundary for recurrent runs).
                hints = (n // 2,) if i % 2 and n > 1 else ()
                seqs[i] = d.submit(prompt(fam, n), mt, thinking=thinking(budget), cache_boundaries=hints)
        for i, s in seqs.items():
            cancel_after = requests[i][4]
            if cancel_after is not None and step == requests[i][0] + cancel_after:
                core.cancel(s)
        if not core.has_work() and len(seqs) == len(requests):
            break
        residents = sched.residents()
        waiting_before = list(sched.waiting)
        if core.has_work():
            plan = sched.schedule()
            assert not plan.empty, "a step with work planned nothing"
            # The oldest resident is never paused; the oldest resident after admission (a
            # restored older request takes that place) advances in this step.
            if residents:
                assert all(p.seq is not residents[0] for p in plan.pauses)
                oldest = sched.residents()[0]
                assert oldest in plan.decode or (plan.prompt and plan.prompt.seq is oldest)
            # Fresh admissions follow FIFO up to the bypass allowance.
            for s in plan.admitted:
                if s in waiting_before:
                    admitted_order.append(s.rid)
            for s in list(sched.waiting) + sched.paused:
                assert s.bypassed <= MAX_BYPASS
            device = core._execute(plan)
            core._postprocess(plan)
            assert device >= 0
        step += 1
        d.now += 0.001
    assert len(seqs) == len(requests)
    owned = dict.fromkeys(TRANSFERS, 0)
    for i, s in seqs.items():
        ends = [e for e in s.outbox if isinstance(e, Finished)]
        assert len(ends) == 1 and s.phase is Phase.DONE
        f = ends[0]
        assert list(f.generated_token_ids) == outputs(s)
        pause_cycles(f)
        for resource, moved in f.scheduling.context_transfers.items():
            for direction, nbytes in moved.items():
                owned[(resource, direction)] += nbytes
        if f.reason != "cancelled":
            # Whatever happened around it, greedy output equals the request run alone.
            expected = alone(tuple(s.request.prompt), s.request.max_tokens, budgets[i], context, recurrent)
            assert outputs(s) == expected
    # Requests own every Main KV copy and every StateImage written into a lane; captures into
    # checkpoint slots and spills to the Host are the prefix cache's.
    total, ops = core.counters.transfer_bytes, core.counters.state_ops
    assert all(owned[("main_kv", d)] == total[("main_kv", d)] for d in ("device_to_host", "host_to_device",
                                                                         "device_to_device"))
    assert owned[("state", "host_to_device")] == total[("state", "host_to_device")]
    assert owned[("state", "device_to_device")] == ops["reuse"] * core.state_bytes
    assert owned[("state", "device_to_host")] == ops["snapshot"] * core.state_bytes
    event(f"preemptions>0: {core.counters.preemptions > 0}")
    event(f"snapshot restores>0: {core.counters.snapshot_restores > 0}")
    event(f"prefix hits>0: {core.counters.prefix_hits > 0}")
    event(f"thinking budget applied: {core.counters.thinking_budget_applied > 0}")
    event(f"recurrent, checkpoint reused: {recurrent and core.counters.state_ops['reuse'] > 0}")
    event(f"recurrent, spilled checkpoint reused: {recurrent and core.counters.state_ops['restore_from_host'] > 0}")
    event(f"reached the context limit: {any(s.finish == ('length', 'context') for s in seqs.values())}")
    # Every page, slot and Host byte is back once the retained prefixes are dropped.
    spilled = core.cache.spilled if core.cache is not None else 0
    assert core.slots.used == 0 and core.host.used == spilled * core.state_bytes
    if core.cache is not None:
        core.cache.clear()
        assert core.cache.nodes == 0 and core.cache.spilled == 0
    assert core.slots.occupied == 0 and core.host.used == 0
    assert core.pool.free_count == core.pool.capacity
