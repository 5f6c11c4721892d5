"""EngineCore behaviour with the simulated runner: batching, pauses, reuse, stops, budgets.

The simulated runner derives every token from the KV it reads back through the page tables, so
"same tokens as alone" proves pages, copies, snapshots, replays and lane binds are right.
"""

from __future__ import annotations

import attrs
import pytest

from ninfer.engine import EngineConfig, SamplingOverrides, ThinkingControl
from ninfer.engine.events import Finished, PromptProgress, TokenDelta
from ninfer.engine.sequence import Phase
from ninfer.engine.simulated import SimulatedRunner
from ninfer.engine.stats import throughput

from .conftest import CoreDriver, pause_cycles


def cfg(**kw):
    base = dict(max_concurrency=8, max_context=256, kv_capacity=2048, prefill_chunk=32, page_size=16)
    base.update(kw)
    return EngineConfig(**base)


def prompt(i: int, n: int) -> list[int]:
    return [(i * 7 + j * 3) % 60 + 1 for j in range(n)]


def finished(seq) -> Finished:
    ends = [e for e in seq.outbox if isinstance(e, Finished)]
    assert len(ends) == 1, f"{seq} ended {len(ends)} times"
    return ends[0]


def tokens(seq) -> list[int]:
    return [t for e in seq.outbox if isinstance(e, TokenDelta) for t in e.token_ids]


def alone(p, max_tokens, **kw) -> list[int]:
    d = CoreDriver(cfg(max_concurrency=1, prefix_reuse=False))
    s = d.submit(p, max_tokens, **kw)
    d.run()
    return tokens(s)


def assert_no_leaks(d: CoreDriver):
    core = d.core
    assert core.slots.used == 0 and core.host.used == 0
    assert all(lane is None for lane in core.scheduler.lanes)
    if core.cache is not None:
        core.cache.clear()
    assert core.pool.free_count == core.pool.capacity


def test_batch_of_eight_gives_the_same_greedy_tokens_as_alone():
    d = CoreDriver(cfg())
    seqs = [d.submit(prompt(i, 20 + 9 * i), 30) for i in range(8)]
    d.run()
    for i, s in enumerate(seqs):
        assert tokens(s) == alone(prompt(i, 20 + 9 * i), 30)
        assert finished(s).reason == "length"
    assert d.core.counters.decode_row_rounds / d.core.counters.decode_rounds > 4  # really batched
    assert_no_leaks(d)


@pytest.mark.parametrize("host_mib, route", [(64, "snapshot"), (0, "replay")])
def test_pressure_pauses_the_youngest_and_restores_exactly(host_mib, route):
    # 12 pages of 16 tokens: three 60-token sequences cannot all grow to 100 tokens.
    d = CoreDriver(cfg(max_concurrency=3, kv_capacity=192, max_context=192, host_context_mib=host_mib,
                       prefix_reuse=False))
    seqs = [d.submit(prompt(i, 60), 40) for i in range(3)]
    d.run()
    for i, s in enumerate(seqs):
        assert tokens(s) == alone(prompt(i, 60), 40)
    sched = [finished(s).scheduling for s in seqs]
    assert sched[0].preemptions == 0  # the oldest always progresses
    assert sum(x.preemptions for x in sched) > 0
    if route == "snapshot":
        assert sum(x.snapshot_restores for x in sched) > 0
        assert d.core.counters.transfer_bytes[("main_kv", "device_to_host")] > 0
    else:
        assert sum(x.replay_restores for x in sched) > 0 and sum(x.replayed_tokens for x in sched) > 0
        assert d.core.counters.replayed_tokens == sum(x.replayed_tokens for x in sched)
    cycles = [c for s in seqs for c in pause_cycles(finished(s))]
    assert cycles and all(c[1].route == route for c in cycles)
    kinds = {t.kind for s in seqs for t in finished(s).scheduling.transitions}
    expected = {"pause_started", "paused", "restore_started", "restored", "recovery_complete", "terminal"}
    assert kinds == expected | ({"replay_complete"} if route == "replay" else set())
    assert_no_leaks(d)


def test_transfers_and_the_host_budget_count_the_runners_page_size():
    # The simulated runner's Host pages hold 16 token ids (128 bytes), but it reports 1 MiB pages as
    # a model's KV pool would: counters, request tallies and the Host budget use the reported size.
    mib = 1 << 20

    def run(host_mib):
        d = CoreDriver(cfg(max_concurrency=3, kv_capacity=192, max_context=192, host_context_mib=host_mib,
                           prefix_reuse=False), page_bytes=mib)
        seqs = [d.submit(prompt(i, 60), 40) for i in range(3)]
        seen = []  # stats published between a step's planning and its runner calls, as the worker does
        while d.core.has_work():
            d.core.step(before_run=lambda: seen.append(d.core.snapshot(True)))
            d.now += 0.001
        for i, s in enumerate(seqs):
            assert tokens(s) == alone(prompt(i, 60), 40)
        return d, seqs, seen

    d, seqs, seen = run(64)
    moved = [finished(s).scheduling.context_transfers["main_kv"] for s in seqs]
    out = sum(m["device_to_host"] for m in moved)
    assert out > 0 and out % mib == 0 and out == sum(m["host_to_device"] for m in moved)
    assert d.core.counters.transfer_bytes[("main_kv", "device_to_host")] == out
    # A pause reserves its snapshot's Host bytes before the read runs; a restore is materializing.
    reserved = [x.host_context_reserved_bytes for x in seen if x.host_context_reserved_bytes]
    assert reserved and all(r % mib == 0 for r in reserved)
    assert all(x.host_context_reserved_bytes <= x.host_context_used_bytes for x in seen)
    assert max(x.requests_materializing for x in seen) >= 1
    last = d.core.snapshot(True)
    assert last.host_context_reserved_bytes == 0 and last.requests_materializing == 0
    # Every snapshot holds at least two pages: 1 MiB of Host backing (enough for 128-byte pages)
    # holds none, so every pause replays.
    d, seqs, _ = run(1)
    assert d.core.counters.preemptions and not d.core.counters.snapshot_restores
    assert d.core.counters.transfer_bytes[("main_kv", "device_to_host")] == 0 == d.core.host.peak


def test_a_tail_page_copy_is_the_requests_transfer_and_the_last_selection():
    d = CoreDriver(cfg(max_concurrency=1), page_bytes=1000)
    d.submit(prompt(1, 50), 10)
    d.run()
    start = d.core.snapshot(True)
    assert start.last_selection == {"path": "root", "prompt_tokens": 50, "reused_tokens": 0, "state": None}
    s = d.submit(prompt(1, 50)[:37] + [9, 9, 9, 9], 10)
    seen = []
    d.core.step(before_run=lambda: seen.append(d.core.snapshot(True)))
    assert seen[0].requests_materializing == 1  # its tail-page copy is planned, not yet run
    d.run()
    f = finished(s)
    assert f.usage.cached_tokens == 37 and f.scheduling.transfer_bytes == 1000
    assert f.scheduling.context_transfers == {
        "main_kv": {"device_to_host": 0, "host_to_device": 0, "device_to_device": 1000},
        "state": {"device_to_host": 0, "host_to_device": 0, "device_to_device": 0}}
    cache = throughput(start, d.core.snapshot(True))["context_cache"]
    assert cache["tail_page_cow"] == 1 and cache["transfer_bytes"]["main_kv.device_to_device"] == 1000
    assert cache["last_selection"] == {"path": "checkpoint", "prompt_tokens": 41, "reused_tokens": 37, "state": None}


def test_replay_does_not_republish_tokens():
    d = CoreDriver(cfg(max_concurrency=2, kv_capacity=128, max_context=128, host_context_mib=0, prefix_reuse=False))
    seqs = [d.submit(prompt(i, 40), 40) for i in range(2)]
    d.run()
    for s in seqs:
        f = finished(s)
        assert tokens(s) == list(f.generated_token_ids) and len(tokens(s)) == f.usage.completion_tokens


def test_prefix_reuse_reports_cached_tokens_and_keeps_tokens_exact():
    d = CoreDriver(cfg(max_concurrency=1))
    first = d.submit(prompt(1, 50), 10)
    d.run()
    # A continuation: the first request's endpoint plus new user tokens.
    cont = list(prompt(1, 50)) + tokens(first)[:-1] + [5, 6, 7]
    second = d.submit(cont, 10)
    d.run()
    f = finished(second)
    assert f.usage.cached_tokens == 50 + 9 and f.prefix_reuse_path == "checkpoint"
    assert tokens(second) == alone(cont, 10)
    # A partial-page match is copied before it is written (copy-on-write).
    third = d.submit(prompt(1, 50)[:37] + [9, 9, 9, 9], 10)
    d.run()
    assert finished(third).usage.cached_tokens == 37
    assert d.core.counters.cow_copies >= 1
    assert tokens(third) == alone(prompt(1, 50)[:37] + [9, 9, 9, 9], 10)
    progress = [e for e in second.outbox if isinstance(e, PromptProgress)]
    assert progress[0].processed == progress[0].cache == 59 and progress[-1].processed == len(cont)
    assert_no_leaks(d)


def test_input_checkpoint_and_cache_hints_are_retained():
    d = CoreDriver(cfg(max_concurrency=1))
    p = prompt(2, 80)
    d.submit(p, 4, input_checkpoint=70, cache_boundaries=(33,), capture_endpoint=False)
    d.run()
    s = d.submit(p[:70] + [1, 2, 3], 4)
    d.run()
    assert finished(s).usage.cached_tokens == 70
    s = d.submit(p[:33] + [4], 4)
    d.run()
    assert finished(s).usage.cached_tokens == 33


def test_no_prefix_reuse_reuses_nothing():
    d = CoreDriver(cfg(max_concurrency=1, prefix_reuse=False))
    d.submit(prompt(3, 40), 4)
    d.run()
    s = d.submit(prompt(3, 40), 4)
    d.run()
    assert finished(s).usage.cached_tokens == 0 and finished(s).prefix_reuse_path == "root"


def test_cache_is_reclaimed_under_pressure():
    d = CoreDriver(cfg(max_concurrency=1, kv_capacity=128, max_context=128))
    for i in range(6):  # every endpoint is retained until the pool needs its pages
        s = d.submit(prompt(i + 10, 60), 20)
        d.run()
        assert finished(s).reason == "length"
    assert d.core.cache.evictions > 0
    assert_no_leaks(d)


def test_stop_token_max_tokens_and_context_finishes():
    base = alone(prompt(4, 30), 20)
    d = CoreDriver(cfg(max_concurrency=3, max_context=48))
    eos = d.submit(prompt(4, 30), 20, stop_ids=(base[5],))
    cap = d.submit(prompt(5, 30), 3)
    ctx = d.submit(prompt(6, 40), 100)
    d.run()
    f = finished(eos)
    assert (f.reason, f.detail) == ("stop", "eos")
    assert tokens(eos) == base[: base.index(base[5]) + 1]  # the stop token itself is committed
    assert (finished(cap).reason, finished(cap).detail) == ("length", "max_tokens")
    assert (finished(ctx).reason, finished(ctx).detail) == ("length", "context")
    assert 40 + len(tokens(ctx)) == 48


def test_first_output_timing_freezes_at_the_first_token():
    d = CoreDriver(cfg(max_concurrency=1, prefill_chunk=16))
    s = d.submit(prompt(7, 40), 5)
    d.now = 0.5  # queued half a second before admission
    d.run()
    first = finished(s).first_output
    assert first.queue_seconds == pytest.approx(0.5) and first.prefill_tokens == 40
    assert first.elapsed_seconds == pytest.approx(first.queue_seconds + first.resident_seconds)
    assert first.elapsed_seconds < finished(s).timings.total
    empty = d.submit(prompt(8, 10), 0)
    d.run()
    assert finished(empty).first_output is None


def test_zero_max_tokens_processes_the_prompt_only():
    d = CoreDriver(cfg(max_concurrency=1))
    s = d.submit(prompt(7, 70), 0)
    d.run()
    f = finished(s)
    assert f.reason == "length" and f.usage.completion_tokens == 0 and tokens(s) == []
    assert [e for e in s.outbox if isinstance(e, PromptProgress)][-1].processed == 70


def test_seeded_sampling_is_reproducible_in_any_batch():
    sampled = SamplingOverrides(temperature=0.8, seed=1234, presence_penalty=0.5)
    d1 = CoreDriver(cfg(max_concurrency=1))
    a = d1.submit(prompt(8, 30), 25, sampling=sampled)
    d1.run()
    d2 = CoreDriver(cfg(max_concurrency=4))
    others = [d2.submit(prompt(i, 25), 25, sampling=SamplingOverrides(temperature=1.0, seed=i)) for i in range(3)]
    b = d2.submit(prompt(8, 30), 25, sampling=sampled)
    d2.run()
    assert tokens(a) == tokens(b)
    assert tokens(a) != alone(prompt(8, 30), 25)  # sampling really changed something
    assert all(finished(o).seed == i for i, o in enumerate(others))


def test_thinking_budget_forces_the_close_suffix():
    close = (11, 12, 13)
    think = ThinkingControl(starts_in_thinking=True, budget=5, close_ids=close, end_think_id=13)
    d = CoreDriver(cfg(max_concurrency=1))
    s = d.submit(prompt(9, 20), 12, thinking=think)
    d.run()
    out = tokens(s)
    base = alone(prompt(9, 20), 12)
    assert out[:5] == base[:5] and tuple(out[5:8]) == close and len(out) == 12
    f = finished(s)
    assert f.scheduling.thinking_budget_applied == 1 and f.scheduling.forced_tokens == 3
    assert f.usage.completion_tokens == 12
    # The suffix is committed at once (one delta) and its KV written by one control unit.
    assert (11, 12, 13) in [e.token_ids for e in s.outbox if isinstance(e, TokenDelta)]
    assert f.engine_timing.control_units == 1 and f.engine_timing.decode_rounds == 12 - 1 - 3 - 1 + 1
    # generation = every committed id; decode = all but the first (forced control ids included).
    assert d.core.counters.generation_tokens == 12 and d.core.counters.decode_tokens == 11
    # After the suffix the model continues from the context that now holds it.
    assert out[8:] == alone(prompt(9, 20) + out[:8], 4)


def test_a_paused_requests_progress_counts_its_forced_ids_as_decode_control_work():
    """request_scheduling progress: the request's decode/control counter is the global counter's
    share of it, forced close ids included, so at its terminal boundary it holds every output the
    request committed after the one its prefill sampled."""
    think = ThinkingControl(starts_in_thinking=True, budget=5, close_ids=(11, 12, 13), end_think_id=13)
    d = CoreDriver(cfg(max_concurrency=3, kv_capacity=192, max_context=192, prefix_reuse=False))
    seqs = [d.submit(prompt(i, 60), 40, thinking=think) for i in range(3)]
    d.run()
    paused = [finished(s) for s in seqs if finished(s).scheduling.preemptions]
    assert paused and all(f.scheduling.forced_tokens == 3 for f in map(finished, seqs))
    for f in paused:
        terminal = f.scheduling.transitions[-1]
        assert terminal.request_progress.decode_tokens == f.usage.completion_tokens - 1
    assert d.core.counters.decode_tokens == sum(finished(s).usage.completion_tokens - 1 for s in seqs)


def test_natural_end_of_thinking_cancels_the_budget():
    base = alone(prompt(9, 20), 12)
    think = ThinkingControl(starts_in_thinking=True, budget=5, close_ids=(11, 12), end_think_id=base[2])
    d = CoreDriver(cfg(max_concurrency=1))
    s = d.submit(prompt(9, 20), 12, thinking=think)
    d.run()
    assert tokens(s) == base and finished(s).scheduling.thinking_budget_applied == 0


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "paused"])
def test_cancellation_at_every_stage_frees_everything(stage):
    d = CoreDriver(cfg(max_concurrency=2, kv_capacity=128, max_context=128, prefill_chunk=16, host_context_mib=16))
    a = d.submit(prompt(1, 60), 60)
    b = d.submit(prompt(2, 60), 60)
    c = d.submit(prompt(3, 20), 5)
    target = {"waiting": c, "prefilling": b, "decoding": a, "paused": b}[stage]

    def reached():
        if stage == "waiting":
            return target.phase is Phase.WAITING
        if stage == "prefilling":
            return target.phase is Phase.RESIDENT and target.needs_prompt_work and target.computed > 0
        if stage == "decoding":
            return target.phase is Phase.RESIDENT and target.n_output > 2
        return target.phase is Phase.PAUSED

    for _ in range(500):
        if reached():
            break
        d.core.step()
    assert reached(), stage
    d.core.cancel(target)
    d.run()
    f = finished(target)
    assert f.reason == "cancelled"
    pause_cycles(f)
    if stage == "paused":  # cancellation ends the cycle without a restore or recovery
        assert [t.kind for t in f.scheduling.transitions][-3:] == ["pause_started", "paused", "terminal"]
    for s in (a, b, c):
        assert sum(isinstance(e, Finished) for e in s.outbox) == 1
    # Every settled request is in both histograms, the one cancelled in the queue too.
    assert d.core.counters.queue.count == d.core.counters.duration.count == 3
    assert_no_leaks(d)


def test_fifo_with_a_bounded_bypass():
    from ninfer.engine.scheduler import MAX_BYPASS

    # 8 pages of 16 tokens. A holds most of them; B's first chunk (3 pages) cannot fit until A
    # ends, while each small C (1 page) can: at most MAX_BYPASS of them pass B.
    d = CoreDriver(cfg(max_concurrency=2, kv_capacity=128, max_context=128, prefill_chunk=48, prefix_reuse=False))
    a = d.submit(prompt(1, 90), 30)
    b = d.submit(prompt(2, 60), 2)
    cs = [d.submit(prompt(10 + i, 10), 1) for i in range(MAX_BYPASS + 2)]
    order = []
    while d.core.has_work():
        plan = d.core.scheduler.schedule()
        order.extend(s.rid for s in plan.admitted)
        d.core._execute(plan)
        d.core._postprocess(plan)
    rid = {s.rid: name for name, s in [("a", a), ("b", b)] + [(f"c{i}", c) for i, c in enumerate(cs)]}
    names = [rid[r] for r in order]
    assert names[:1 + MAX_BYPASS] == ["a"] + [f"c{i}" for i in range(MAX_BYPASS)]
    assert names[1 + MAX_BYPASS] == "b" and b.bypassed == MAX_BYPASS
    assert all(finished(s).reason == "length" for s in [a, b, *cs])


class _Interval:
    def __init__(self, seconds):
        self.value, self.read = seconds, 0

    def seconds(self):
        self.read += 1
        return self.value


class _TimedRunner(SimulatedRunner):
    """A device-timing runner: each prefill's interval lasts a millisecond a token (None: unreadable)."""

    unreadable = False

    def __init__(self, **kw):
        super().__init__(**kw)
        self.info = attrs.evolve(self.info, times_device=True)
        self.intervals = []

    def prefill(self, chunk):
        interval = _Interval(None if self.unreadable else 1e-3 * len(chunk.tokens))
        self.intervals.append(interval)
        return attrs.evolve(super().prefill(chunk), device_interval=interval)


@pytest.mark.parametrize("unreadable", [False, True])
def test_gpu_seconds_add_up_the_request_prefill_intervals(unreadable):
    """request_done work.gpu_seconds: each prefill unit's device interval, read once at the finish;
    None where one cannot be read, and on a runner without device timing."""
    c = cfg(max_concurrency=2, prefill_chunk=16)
    runner = _TimedRunner(page_size=c.page_size, num_pages=c.kv_pages, max_batch=2, max_context=c.max_context)
    runner.unreadable = unreadable
    d = CoreDriver(c, runner=runner)
    a, b = d.submit(prompt(0, 40), 5), d.submit(prompt(1, 20), 5)  # units of 16, 16, 8 and 16, 4
    d.run()
    assert [i.read for i in runner.intervals] == [1] * 5
    if unreadable:
        assert finished(a).gpu_seconds is None and finished(b).gpu_seconds is None
    else:
        assert finished(a).gpu_seconds == pytest.approx(0.040) and finished(b).gpu_seconds == pytest.approx(0.020)
    plain = CoreDriver(cfg())
    s = plain.submit(prompt(0, 40), 5)
    plain.run()
    assert finished(s).gpu_seconds is None
