"""Exactness on the reference backend (tiny random Qwen3): the Engine's batching, pauses and
prefix reuse never change greedy tokens, and seeded sampling is reproducible."""

from __future__ import annotations

import attrs
import pytest

from ninfer.backends.reference import ReferenceRunner
from ninfer.convert.random_model import make_random_artifact
from ninfer.engine import EngineConfig, SamplingOverrides
from ninfer.engine.events import TokenDelta

from .conftest import CoreDriver, end, out


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny.ninfer"
    make_random_artifact(path, "tiny-qwen3", seed=11)
    return str(path)


def driver(artifact, **kw) -> CoreDriver:
    base = dict(max_concurrency=8, max_context=160, kv_capacity=2048, prefill_chunk=24, page_size=16)
    base.update(kw)
    cfg = EngineConfig(**base)
    runner = ReferenceRunner(artifact, page_size=cfg.page_size, num_pages=cfg.kv_pages,
                             max_batch=cfg.max_concurrency, max_context=cfg.max_context)
    return CoreDriver(cfg, runner=runner)


def prompt(i: int, n: int) -> list[int]:
    return [(i * 131 + j * 37) % 1000 + 3 for j in range(n)]


@pytest.fixture(scope="module")
def alone(artifact):
    memo = {}

    def run(p, n, **kw):
        key = (tuple(p), n, repr(kw))
        if key not in memo:
            d = driver(artifact, max_concurrency=1, prefix_reuse=False)
            s = d.submit(p, n, **kw)
            d.run()
            memo[key] = out(s)
        return memo[key]

    return run


def test_batch_of_eight_matches_alone(artifact, alone):
    d = driver(artifact)
    seqs = [d.submit(prompt(i, 10 + 7 * i), 12) for i in range(8)]
    d.run()
    for i, s in enumerate(seqs):
        assert out(s) == alone(prompt(i, 10 + 7 * i), 12)
    assert d.core.counters.decode_row_rounds >= 8 * 6


@pytest.mark.parametrize("host_mib, route", [(16, "snapshot"), (0, "replay")])
def test_pause_and_restore_match_alone(artifact, alone, host_mib, route):
    # 6 pages of 16 tokens: two requests growing to 70 tokens cannot both stay resident.
    d = driver(artifact, max_concurrency=2, kv_capacity=96, max_context=96, host_context_mib=host_mib,
               prefix_reuse=False)
    seqs = [d.submit(prompt(i, 40), 30) for i in range(2)]
    d.run()
    for i, s in enumerate(seqs):
        assert out(s) == alone(prompt(i, 40), 30)
    young = end(seqs[1]).scheduling
    assert young.preemptions >= 1
    assert (young.snapshot_restores if route == "snapshot" else young.replay_restores) >= 1


def test_reused_prefix_matches_alone(artifact, alone):
    d = driver(artifact, max_concurrency=1)
    first = d.submit(prompt(3, 45), 8)
    d.run()
    cont = prompt(3, 45) + out(first)[:-1] + [7, 8, 9]
    second = d.submit(cont, 8)
    partial = d.submit(prompt(3, 45)[:30] + [5, 6], 8)  # reuse ends inside a page: copy-on-write
    d.run()
    assert end(second).usage.cached_tokens == 52 and end(partial).usage.cached_tokens == 30
    assert out(second) == alone(cont, 8)
    assert out(partial) == alone(prompt(3, 45)[:30] + [5, 6], 8)


def test_seeded_sampling_is_reproducible_across_batches(artifact, alone):
    sampled = SamplingOverrides(temperature=0.9, top_k=10, top_p=0.9, seed=-42, frequency_penalty=0.3)
    d = driver(artifact, max_concurrency=4)
    mates = [d.submit(prompt(i, 12), 10, sampling=SamplingOverrides(temperature=1.0, seed=i)) for i in range(3)]
    s = d.submit(prompt(5, 20), 10, sampling=sampled)
    d.run()
    assert out(s) == alone(prompt(5, 20), 10, sampling=sampled)
    assert all(end(m).reason == "length" for m in mates)


async def test_engine_opens_an_artifact_path_on_the_reference_backend(artifact, alone):
    from ninfer.artifact import open_artifact
    from ninfer.engine import Engine, GenerationRequest

    art = open_artifact(artifact, components=("text",))
    eos = art.special_tokens["eos_token_ids"]
    cfg = EngineConfig(max_concurrency=2, max_context=160, prefill_chunk=24, greedy=True)
    async with Engine.open(artifact, cfg) as engine:
        assert engine.info.backend == "reference" and engine.max_context == 160
        with engine.reserve() as ticket:
            events = [e async for e in ticket.submit(GenerationRequest(prompt=prompt(6, 20), max_tokens=12))]
    ids = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    expected = alone(prompt(6, 20), 12)
    # --greedy forces argmax whatever the artifact's presets say; the artifact's EOS ends it.
    cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
    assert ids == expected[:cut]
    assert events[-1].reason == ("stop" if cut < len(expected) else "length")


def test_penalties_and_thinking_budget_survive_a_replay_pause(artifact, alone):
    from ninfer.engine import ThinkingControl

    sampled = SamplingOverrides(temperature=0.8, seed=7, presence_penalty=1.0, frequency_penalty=0.5)
    think = ThinkingControl(starts_in_thinking=True, budget=6, close_ids=(900, 901, 902), end_think_id=902)
    d = driver(artifact, max_concurrency=2, kv_capacity=96, max_context=96, host_context_mib=0, prefix_reuse=False)
    older = d.submit(prompt(8, 40), 30)
    young = d.submit(prompt(9, 40), 30, sampling=sampled, thinking=think)
    d.run()
    assert end(young).scheduling.replay_restores >= 1
    assert out(older) == alone(prompt(8, 40), 30)
    expected = alone(prompt(9, 40), 30, sampling=sampled, thinking=think)
    assert out(young) == expected and tuple(expected[6:9]) == (900, 901, 902)


class Pipelining:
    """The reference runner with decode pipelining on or off, counting the steps launched ahead."""

    def __init__(self, inner: ReferenceRunner, pipelined: bool):
        self._inner = inner
        self.info = attrs.evolve(inner.info, pipelined_decode=pipelined)
        self.follows = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def launch_decode(self, batch, follow=False):
        self.follows += follow
        self._inner.launch_decode(batch, follow)


def test_decode_launched_ahead_matches_step_by_step(artifact):
    """The engine's pipelined decode (the next step queued before this one's tokens are read)
    yields exactly the tokens of one step at a time: greedy and seeded sampling with penalties,
    rows ending on a stop id, at max_tokens, at the context limit, on a thinking budget, a stop
    from outside while a step is in flight, and a request arriving mid-run; every page comes back."""
    from ninfer.engine import ThinkingControl

    sampled = SamplingOverrides(temperature=0.9, seed=5, presence_penalty=0.8, frequency_penalty=0.4)
    think = ThinkingControl(starts_in_thinking=True, budget=9, close_ids=(900, 901, 902), end_think_id=902)

    def run(pipelined: bool, stop_id: int | None):
        d = driver(artifact, max_concurrency=4, max_context=96, prefix_reuse=False)
        d.runner = d.core.runner = Pipelining(d.core.runner, pipelined)
        d.core.pipelined = pipelined
        seqs = [d.submit(prompt(0, 20), 40), d.submit(prompt(1, 14), 30, sampling=sampled),
                d.submit(prompt(2, 30), 40, stop_ids=() if stop_id is None else (stop_id,)),
                d.submit(prompt(3, 80), 40)]  # 96 - 80: ends at the context limit
        for step in range(400):
            if not d.core.has_work():
                break
            if step == 12:
                seqs.append(d.submit(prompt(4, 25), 20, sampling=sampled, thinking=think))
            if step == 20:
                d.core.stop(seqs[0])
            d.core.step()
            d.now += 0.001
        assert d.core.pool.free_count == d.config.kv_pages
        return [out(s) for s in seqs], d.runner.follows

    reference, _ = run(False, None)
    stop_id = reference[2][6]
    stepwise, none_ahead = run(False, stop_id)
    ahead, follows = run(True, stop_id)
    assert none_ahead == 0 and follows > 10
    assert ahead == stepwise
    assert stepwise[2][-1] == stop_id and len(stepwise[2]) < 40
    assert len(stepwise[3]) == 96 - 80 - 1 + 1 and 0 < len(stepwise[0]) < 40
    assert tuple(stepwise[4][9:12]) == (900, 901, 902)


def test_prefixes_retained_with_a_step_in_flight_are_reused_exactly(artifact):
    """A request stopped while the step after its last token is in flight (that step writes the next
    position's KV into its last page) leaves its endpoint retained; a follow-up that reuses it gets
    the tokens of one step at a time."""
    def run(pipelined: bool):
        d = driver(artifact, max_concurrency=2, max_context=128)
        d.runner = d.core.runner = Pipelining(d.core.runner, pipelined)
        d.core.pipelined = pipelined
        first = d.submit(prompt(6, 21), 40)
        mate = d.submit(prompt(7, 9), 60)
        while first.n_output < 10:
            d.core.step()
        in_flight = d.core.has_work() and d.core._ahead is not None
        d.core.stop(first)  # a stop string, as the text layer reports one
        d.run()
        follow = d.submit(prompt(6, 21) + out(first) + [11, 12], 10)
        d.run()
        return (out(first), out(mate), out(follow), end(follow).usage.cached_tokens), in_flight

    stepwise, _ = run(False)
    ahead, in_flight = run(True)
    assert in_flight and ahead == stepwise
    assert len(stepwise[0]) == 10 and stepwise[3] > 21  # the follow-up reused the stopped endpoint
