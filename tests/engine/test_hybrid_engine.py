"""The Engine on a hybrid model (reference HybridRunner, the tiny ``qwen3_next`` fixture): lanes
carry real StateImages, reuse lands only on checkpoints, pauses keep or rebuild the state, and
greedy tokens never change."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer.artifact import open_artifact
from ninfer.backends.reference import HybridRunner, ReferenceRunner
from ninfer.convert.hf import convert_hf
from ninfer.engine import EngineConfig
from ninfer.engine.events import TokenDelta
from ninfer.engine.stats import throughput
from ninfer.models.hybrid import HybridConfig

from .conftest import CoreDriver, end, out, pause_cycles

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hybrid" / "qwen3_next"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_engine") / "m.ninfer"
    convert_hf(FIXTURE, path)
    return str(path)


def driver(artifact, **kw) -> CoreDriver:
    base = dict(max_concurrency=4, max_context=160, kv_capacity=1024, prefill_chunk=24, page_size=16)
    base.update(kw)
    cfg = EngineConfig(**base)
    runner = ReferenceRunner(artifact, page_size=cfg.page_size, num_pages=cfg.kv_pages, max_batch=cfg.max_concurrency,
                             max_context=cfg.max_context, state_slots=cfg.state_slots - cfg.max_concurrency)
    assert isinstance(runner, HybridRunner)
    return CoreDriver(cfg, runner=runner)


def prompt(i: int, n: int) -> list[int]:
    return [(i * 31 + j * 17) % 250 + 3 for j in range(n)]


@pytest.fixture(scope="module")
def alone(artifact):
    memo = {}

    def run(p, n):
        key = (tuple(p), n)
        if key not in memo:
            d = driver(artifact, max_concurrency=1, prefix_reuse=False, prefill_chunk=1024)
            s = d.submit(p, n)
            d.run()
            memo[key] = out(s)
        return memo[key]

    return run


def no_leaks(d: CoreDriver) -> None:
    core = d.core
    spilled = core.cache.spilled if core.cache is not None else 0
    # Only spilled checkpoints hold Host bytes once every request is done.
    assert core.slots.used == 0 and core.host.used == spilled * core.state_bytes
    if core.cache is not None:
        core.cache.clear()
        assert core.cache.nodes == 0 and core.cache.spilled == 0
    assert core.slots.occupied == 0 and core.pool.free_count == core.pool.capacity and core.host.used == 0


def test_batch_matches_alone_and_lanes_hold_state_slots(artifact, alone):
    d = driver(artifact, prefix_reuse=False)
    seqs = [d.submit(prompt(i, 9 + 13 * i), 10) for i in range(4)]
    d.core.step()
    assert d.core.snapshot(True).device_state_used_slots == 1  # the first admitted request
    d.run()
    for i, s in enumerate(seqs):
        assert out(s) == alone(prompt(i, 9 + 13 * i), 10)
    snap = d.core.snapshot(True)
    assert snap.device_state_capacity_slots == 8 and snap.device_state_used_slots == 0
    # The default Host budget is 8192 MiB plus eight StateImages.
    assert snap.host_context_capacity_bytes == 8192 * 2**20 + 8 * 4 * d.runner.state_floats
    no_leaks(d)


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("host_mib, route", [(16, "snapshot"), (0, "replay")])
def test_pause_and_restore_match_alone(artifact, alone, host_mib, route, reuse):
    # 6 pages of 16 tokens: two requests growing to 70 tokens cannot both stay resident. With
    # reuse, each prompt keeps checkpoints at its chunk ends (16, 32: whole pages, which a bind
    # attempt holds while it makes room), where a replay resumes.
    d = driver(artifact, max_concurrency=2, kv_capacity=96, max_context=96, host_context_mib=host_mib,
               prefix_reuse=reuse, **(dict(device_state_slots=4, prefill_chunk=16) if reuse else {}))
    seqs = [d.submit(prompt(i, 40), 30) for i in range(2)]
    d.run()
    for i, s in enumerate(seqs):
        assert out(s) == alone(prompt(i, 40), 30)
    young = end(seqs[1]).scheduling
    assert young.preemptions >= 1
    assert {c[1].route for c in pause_cycles(end(seqs[1]))} == {route}
    snap = d.core.snapshot(True)
    ops, moved = snap.state_image_operations_total, young.context_transfers["state"]
    state_bytes = d.runner.state_floats * 4
    if route == "snapshot":
        assert young.snapshot_restores >= 1 and ops["snapshot"] >= 1 and ops["restore"] >= 1
        assert moved["device_to_host"] == moved["host_to_device"] == young.snapshot_restores * state_bytes
        assert snap.context_transfer_bytes_total[("state", "device_to_host")] >= state_bytes
    else:
        assert young.replay_restores >= 1 and ops["snapshot"] == 0
        # A replay lands on its own chunk checkpoint instead of the root.
        assert (ops["reuse"] >= 1) == reuse and moved["device_to_device"] == ops["reuse"] * state_bytes
    no_leaks(d)


def test_reuse_lands_only_on_checkpointed_boundaries(artifact, alone):
    d = driver(artifact, max_concurrency=1, device_state_slots=4)
    base = prompt(3, 45)
    first = d.submit(base, 6, cache_boundaries=(21,))  # 21 and 45 are not chunk (24) ends
    d.run()
    # KV-only reuse would take 44 tokens here; the state exists at 21 (hint) and at the endpoint.
    inside = d.submit(base[:44] + [9, 9], 6)
    d.run()
    assert end(inside).usage.cached_tokens == 21
    assert out(inside) == alone(base[:44] + [9, 9], 6)
    cont = base + out(first)[:-1] + [7, 8]
    second = d.submit(cont, 6)
    d.run()
    assert end(second).usage.cached_tokens == 45 + 5 and end(second).prefix_reuse_path == "checkpoint"
    assert out(second) == alone(cont, 6)
    ops = d.core.snapshot(True).state_image_operations_total
    assert ops["reuse"] == 2 and ops["capture"] >= 3
    no_leaks(d)


def test_a_multi_turn_chat_reuses_its_previous_turn(artifact, alone):
    d = driver(artifact, max_concurrency=2, prefill_chunk=16)
    turn1 = prompt(5, 30)
    a = d.submit(turn1, 8, input_checkpoint=27)
    d.run()
    answer = out(a)
    d.submit(prompt(6, 12), 4)  # another conversation uses the lane in between
    d.run()
    turn2 = turn1 + answer + [11, 12, 13, 14]
    b = d.submit(turn2, 8, input_checkpoint=len(turn1) + len(answer))
    d.run()
    assert end(b).usage.cached_tokens == len(turn1) + len(answer) - 1
    assert out(b) == alone(turn2, 8)
    no_leaks(d)


def test_a_turn_that_stops_with_a_step_launched_ahead_resumes_exactly(artifact, alone):
    """Pipelined decode: the step after a stop token is launched before that token is read, so it
    runs for the finished lane too. The turn's endpoint checkpoint is still the state at its end (the
    runner's two images a lane), so the next turn resumes from it exactly."""
    d = driver(artifact, max_concurrency=2, prefill_chunk=16)
    follows = []
    launch = d.core.runner.launch_decode
    d.core.runner.launch_decode = lambda batch, follow=False: (follows.append(follow), launch(batch, follow))[1]
    turn1 = prompt(5, 30)
    free = alone(turn1, 8)
    stop = free[4]
    a = d.submit(turn1, 8, stop_ids={stop})
    d.run()
    answer = out(a)
    assert answer == free[: free.index(stop) + 1] and end(a).reason == "stop"
    assert follows[-1]  # the last step was launched ahead of the stop token
    turn2 = turn1 + answer + [11, 12, 13, 14]
    b = d.submit(turn2, 8)
    d.run()
    assert end(b).usage.cached_tokens == len(turn1) + len(answer) - 1
    assert out(b) == alone(turn2, 8)
    no_leaks(d)


@pytest.mark.parametrize("host_mib", [0, None])
def test_checkpoints_are_reclaimed_lru_when_slots_run_out(artifact, alone, host_mib):
    # host_context_mib 0: an evicted checkpoint is dropped; the default budget spills it.
    d = driver(artifact, max_concurrency=1, device_state_slots=1, host_context_mib=host_mib)
    p0, p1 = prompt(7, 20), prompt(8, 20)
    firsts = []
    for p in (p0, p1):
        firsts.append(d.submit(p, 3))
        d.run()
    assert d.core.slots.checkpoints == 1  # p1's endpoint took p0's slot
    c1 = p1 + out(firsts[1])[:2] + [4]
    c0 = p0 + out(firsts[0])[:2] + [4]
    again1 = d.submit(c1, 3)  # admitted first: its checkpoint is still there
    again0 = d.submit(c0, 3)
    d.run()
    assert end(again1).usage.cached_tokens == 20 + 2
    ops = d.core.snapshot(True).state_image_operations_total
    if host_mib == 0:
        assert end(again0).usage.cached_tokens == 0
        assert ops["spill"] == 0 and ops["restore_from_host"] == 0
    else:  # p0's endpoint was spilled to the Host and written back into the lane
        assert end(again0).usage.cached_tokens == 20 + 2 and end(again0).prefix_reuse_path == "checkpoint"
        assert ops["spill"] >= 1 and ops["restore_from_host"] == 1
    assert out(again1) == alone(c1, 3) and out(again0) == alone(c0, 3)
    assert d.core.cache.checkpoint_evictions >= 2
    no_leaks(d)


def test_a_multi_turn_chat_reuses_its_spilled_previous_turn(artifact, alone):
    # One checkpoint slot, two interleaved chats: each turn's endpoint evicts the other chat's,
    # which lives on in the Host budget and is written back into the lane for its next turn.
    d = driver(artifact, max_concurrency=1, prefill_chunk=16, device_state_slots=1, host_context_mib=1)
    chats = {0: prompt(10, 22), 1: prompt(11, 19)}
    for turn in range(3):
        for k in (0, 1):
            history = chats[k]
            s = d.submit(history, 5, input_checkpoint=len(history))
            d.run()
            assert out(s) == alone(history, 5)
            if turn:  # the previous turn: its prompt + answer but the last token (3 tokens were added)
                assert end(s).usage.cached_tokens == len(history) - 3 - 1
            chats[k] = history + out(s) + [30 + turn, 40 + k, 50]
    snap = d.core.snapshot(True)
    ops = snap.state_image_operations_total
    image = d.core.state_bytes
    assert ops["restore_from_host"] == 4 and ops["spill"] >= 4 and ops["reuse"] == 0
    assert snap.context_transfer_bytes_total[("state", "host_to_device")] == 4 * image
    assert snap.context_transfer_bytes_total[("state", "device_to_host")] == ops["spill"] * image
    assert snap.host_context_used_bytes == d.core.cache.spilled * image > 0
    assert snap.last_selection["path"] == "checkpoint" and snap.last_selection["state"] == "host"
    no_leaks(d)


async def test_engine_opens_a_hybrid_artifact_with_checkpoint_slots(artifact, alone):
    from ninfer.engine import Engine, GenerationRequest

    cfg = EngineConfig(max_concurrency=2, max_context=160, prefill_chunk=16, device_state_slots=3, greedy=True)
    turn1 = prompt(9, 26)
    async with Engine.open(artifact, cfg) as engine:
        start = engine.stats()
        assert start.device_state_capacity_slots == 5
        with engine.reserve() as ticket:
            first = [e async for e in ticket.submit(GenerationRequest(prompt=turn1, max_tokens=5))]
        answer = [t for e in first if isinstance(e, TokenDelta) for t in e.token_ids]
        turn2 = turn1 + answer + [21, 22, 23]
        with engine.reserve() as ticket:
            second = [e async for e in ticket.submit(GenerationRequest(prompt=turn2, max_tokens=5))]
        stats = engine.stats()
    assert first[-1].reason == "length"  # the fixture's EOS did not end turn one early
    # Context-cost presets would be matched against the hybrid's signature (layer kinds included).
    assert "model Qwen3NextForCausalLM-h" in stats.context_cost_source
    assert second[-1].usage.cached_tokens == len(turn1) + len(answer) - 1
    assert list(second[-1].generated_token_ids) == alone(turn2, 5)
    assert stats.state_image_operations_total["reuse"] == 1
    cache = throughput(start, stats)["context_cache"]
    assert cache["state_image_operations"]["reuse"] == 1 and cache["selections"] == 1
    assert cache["last_selection"] == {"path": "checkpoint", "prompt_tokens": len(turn2),
                                       "reused_tokens": len(turn1) + len(answer) - 1, "state": "device"}
    assert cache["state_image_operations"]["capture"] >= 2  # both endpoints
    image = 4 * HybridConfig.from_json(open_artifact(artifact).config).state_floats
    ops = cache["state_image_operations"]
    assert cache["transfer_bytes"]["state.device_to_device"] == (ops["capture"] + ops["reuse"]) * image


def test_a_long_prefill_keeps_chunk_checkpoints_while_slots_are_free(artifact, alone):
    d = driver(artifact, max_concurrency=1, prefill_chunk=16, device_state_slots=3)
    long = prompt(4, 60)
    d.submit(long, 2)
    d.run()
    # Checkpoints at 16 and 32 (chunk ends) and 61 (the endpoint); 48 found no free slot.
    branch = long[:40] + [5, 5, 5]
    s = d.submit(branch, 4)
    d.run()
    assert end(s).usage.cached_tokens == 32
    assert out(s) == alone(branch, 4)
    no_leaks(d)


def test_named_boundaries_take_chunk_checkpoint_slots_first(artifact, alone):
    d = driver(artifact, max_concurrency=1, prefill_chunk=16, device_state_slots=3)
    long = prompt(4, 60)
    first = d.submit(long, 2)
    d.run()
    d.submit(long[:40] + [5], 2, capture_endpoint=False)  # reuses 32: the chunk checkpoints are now the recent ones
    d.run()
    other = prompt(2, 30)
    d.submit(other, 2, cache_boundaries=(25,))  # its hint and endpoint take the chunk checkpoints' slots
    d.run()
    cont = long + out(first)[:1] + [7]
    again = d.submit(cont, 2, capture_endpoint=False)  # (their own endpoints would take slots)
    hinted = d.submit(other[:25] + [1], 2, capture_endpoint=False)
    d.run()
    assert end(again).usage.cached_tokens == 61 and end(hinted).usage.cached_tokens == 25
    assert out(again) == alone(cont, 2) and out(hinted) == alone(other[:25] + [1], 2)
    no_leaks(d)


def test_a_runner_without_the_checkpoint_slots_is_refused(artifact):
    from ninfer.engine.context_cost import load
    from ninfer.engine.core import EngineCore

    cfg = EngineConfig(max_concurrency=2, max_context=64, device_state_slots=3)
    runner = ReferenceRunner(artifact, page_size=16, num_pages=cfg.kv_pages, max_batch=2, max_context=64,
                             state_slots=2)
    with pytest.raises(ValueError, match="device_state_slots 3 need 5"):
        EngineCore(runner, cfg, load(None, "reference", ""))


def test_a_pause_snapshot_takes_the_host_room_of_spilled_checkpoints():
    # A pause happens under KV pressure, which first reclaims unlocked prefixes (and their spilled
    # images); spilled images still compete with the snapshot when residents lock their nodes.
    from ninfer.engine.simulated import SimulatedHybridRunner

    def run(tight: int | None = None):
        cfg = EngineConfig(max_concurrency=2, max_context=96, kv_capacity=96, prefill_chunk=24, page_size=16,
                           device_state_slots=1, host_context_mib=1)
        runner = SimulatedHybridRunner(page_size=16, num_pages=cfg.kv_pages, max_batch=2, max_context=96,
                                       state_slots=1)
        d = CoreDriver(cfg, runner=runner)
        firsts = []
        for i in range(3):  # three endpoints, one slot: the first two are spilled
            firsts.append(d.submit(prompt(20 + i, 15), 2))  # endpoint: one full page (16), locked when reused
            d.run()
        assert d.core.cache.spilled == 2
        if tight is not None:  # room for the snapshot once one spilled image is dropped
            d.core.host.capacity = d.core.host.used - d.core.state_bytes + tight
        # Both continue a spilled endpoint (locking its node) and cannot both stay resident.
        seqs = [d.submit(prompt(20 + i, 15) + out(firsts[i])[:1] + prompt(i, 24), 30) for i in range(2)]
        d.run()
        assert [end(s).usage.cached_tokens for s in seqs] == [16, 16]
        assert d.core.counters.state_ops["restore_from_host"] == 2
        return d, seqs

    roomy, seqs = run()
    young = end(seqs[1]).scheduling
    assert young.snapshot_restores == young.preemptions == 1
    moved, image = young.context_transfers, roomy.core.state_bytes
    snapshot = moved["main_kv"]["device_to_host"] + moved["state"]["device_to_host"]
    # Its own copies: the snapshot out and back, and the spilled checkpoint it continued (whole pages).
    assert moved["state"] == {"device_to_host": image, "host_to_device": 2 * image, "device_to_device": 0}
    assert moved["main_kv"]["host_to_device"] == moved["main_kv"]["device_to_host"] > 0
    assert young.transfer_bytes == 2 * snapshot + image
    tight, tight_seqs = run(tight=snapshot)
    # Without dropping a spilled image the snapshot would not fit and the pause would replay.
    assert end(tight_seqs[1]).scheduling.snapshot_restores == 1
    assert tight.core.host.peak == tight.core.host.capacity
    assert [out(s) for s in tight_seqs] == [out(s) for s in seqs]
    no_leaks(roomy)
    no_leaks(tight)
