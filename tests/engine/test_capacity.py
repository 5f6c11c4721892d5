"""A KV pool that holds exactly one ``max_context`` sequence: retained prefixes, copy-on-write
sources and duplicate captures must never keep the lone resident from reaching the ceiling."""

from __future__ import annotations

from ninfer.engine import EngineConfig
from ninfer.engine.events import Finished, TokenDelta

from .conftest import CoreDriver


def cfg(**kw):
    # kv_capacity = max_context = 4 pages of 16 (`ninfer serve --max-context 64`).
    base = dict(max_concurrency=1, max_context=64, prefill_chunk=1024, page_size=16)
    base.update(kw)
    return EngineConfig(**base)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(j * 7 + salt) % 50 + 1 for j in range(n)]


def tokens(seq) -> list[int]:
    return [t for e in seq.outbox if isinstance(e, TokenDelta) for t in e.token_ids]


def finished(seq) -> Finished:
    ends = [e for e in seq.outbox if isinstance(e, Finished)]
    assert len(ends) == 1, f"{seq} ended {len(ends)} times"
    return ends[0]


def assert_no_leaks(d: CoreDriver) -> None:
    core = d.core
    assert core.slots.used == 0 and core.host.used == 0
    core.cache.clear()
    assert core.cache.nodes == 0 and core.pool.free_count == core.pool.capacity


def test_repeated_prompt_runs_to_the_context_limit_twice():
    # The reported crash: the second request reuses 30 tokens (a copy-on-write of the second
    # page) and must still grow to 64 tokens in a pool of exactly 64.
    d = CoreDriver(cfg())
    first = d.submit(prompt(31), 1000)
    d.run()
    second = d.submit(prompt(31), 1000)
    d.run()
    for seq in (first, second):
        assert (finished(seq).reason, finished(seq).detail) == ("length", "context")
        assert len(tokens(seq)) == 64 - 31
    assert finished(second).usage.cached_tokens == 30
    assert tokens(second) == tokens(first)
    assert_no_leaks(d)


def test_the_lone_resident_reclaims_every_page_no_resident_uses():
    # Captured nodes of a resident whose pages belong to an earlier, finished request are
    # locked by that resident; under pressure they are dropped instead of killing the engine.
    d = CoreDriver(cfg(max_concurrency=2))
    a = d.submit(prompt(40), 1, cache_boundaries=(32,))
    b = d.submit(prompt(40), 1000, cache_boundaries=(32,))
    d.run()
    assert finished(a).reason == "length"
    assert (finished(b).reason, finished(b).detail) == ("length", "context")
    assert len(tokens(b)) == 64 - 40
    alone = CoreDriver(cfg(prefix_reuse=False))
    ref = alone.submit(prompt(40), 1000)
    alone.run()
    assert tokens(b) == tokens(ref)
    assert_no_leaks(d)


async def test_the_engine_stays_ready_after_repeated_requests_to_the_ceiling(tmp_path):
    # The reported sequence end to end: an artifact on the reference backend, the worker thread,
    # two sequential requests with the same 31-token prompt that each run to max_context 64.
    from ninfer.convert.random_model import make_random_artifact
    from ninfer.engine import Engine, GenerationRequest

    path = tmp_path / "tiny.ninfer"
    make_random_artifact(path, "tiny-qwen3", seed=3)
    ids = [(j * 37) % 900 + 5 for j in range(31)]
    ends = []
    async with Engine.open(str(path), EngineConfig(max_context=64, greedy=True)) as engine:
        for _ in range(2):
            with engine.reserve() as ticket:
                # No stop ids: the random model must not end early by emitting its EOS.
                request = GenerationRequest(prompt=ids, max_tokens=1000)
                events = [e async for e in ticket.submit(request)]
            ends.append(events[-1])
        assert engine.ready
    assert [e.usage.cached_tokens for e in ends] == [0, 30]
    assert ends[1].generated_token_ids == ends[0].generated_token_ids
    assert all((e.reason, e.detail) == ("length", "context") for e in ends)


def test_edges_of_the_ceiling_finish_with_a_clear_outcome():
    from ninfer.engine import ThinkingControl

    d = CoreDriver(cfg(kv_capacity=48))  # the pool, not max_context, is the ceiling here
    assert d.core.limit == 48
    one = d.submit(prompt(47), 1000)
    full = d.submit(prompt(48, salt=1), 0)
    # The thinking budget's close suffix would cross the ceiling: it is cut by "context".
    think = ThinkingControl(starts_in_thinking=True, budget=2, close_ids=(61, 62, 63), end_think_id=63)
    cut = d.submit(prompt(45, salt=3), 1000, thinking=think)  # no early </think>
    d.run()
    assert (finished(one).detail, len(tokens(one))) == ("context", 1)
    assert (finished(full).detail, tokens(full)) == ("max_tokens", [])
    assert finished(cut).detail == "context" and tokens(cut)[2:] == [61, 62, 63]
    assert_no_leaks(d)


def test_an_admission_that_cannot_fit_keeps_the_retained_prefixes():
    # 7 pages: a finished request's retained prefix (2 pages) and a resident (4) leave 1 free; a
    # 60-token newcomer needs 4, more than evicting every retained node could free, so it waits for
    # the resident instead of flushing the cache on every refused attempt.
    d = CoreDriver(cfg(max_concurrency=2, kv_capacity=7 * 16))
    first = d.submit(prompt(20, salt=1), 1)
    d.run()
    retained = d.core.cache.nodes
    assert retained == 2 and finished(first).reason == "length"
    resident = d.submit(prompt(50, salt=2), 10)
    newcomer = d.submit(prompt(60, salt=3), 2)
    for _ in range(5):
        d.core.step()
    assert resident.lane is not None and newcomer.lane is None  # the newcomer is still waiting
    assert d.core.cache.nodes == retained
    d.run()
    assert finished(resident).reason == finished(newcomer).reason == "length"
    assert_no_leaks(d)
