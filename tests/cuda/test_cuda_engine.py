"""The Engine over a CudaRunner (GPU only): pauses and prefix reuse leave greedy tokens unchanged.

Each case runs through ``ninfer.Engine`` (worker thread, trio handles) on a small random Qwen3 with
the CUDA kernels' head_dim 128, and compares every request's tokens with the same request run
alone on an undisturbed engine over the same runner: a pause restored from a Host snapshot, a
pause restored by replay (the prompt and the tokens so far prefilled again), and a reused prefix
(whole pages shared, and a partial page copied on write) must not change a single token. The KV
pool is bf16 (the default) and f32; a snapshot is exact in both (bf16 widens to fp32 and back
without loss); a replay re-creates the KV by prefill instead of decode.
"""

from __future__ import annotations

import pytest
import trio

pytestmark = pytest.mark.cuda

from ninfer.convert.random_model import make_random_artifact  # noqa: E402
from ninfer.engine import EngineConfig, GenerationRequest  # noqa: E402
from ninfer.engine.api import Engine  # noqa: E402
from ninfer.engine.events import Finished, TokenDelta  # noqa: E402
from ninfer.models.dense import DenseConfig  # noqa: E402

QWEN3 = DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=2048, hidden_size=256, intermediate_size=384,
                    num_layers=3, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, qk_norm=True)
PAGE, MAX_CTX = 16, 160


@pytest.fixture(scope="module", params=["bf16", "f32"])
def runner(request, tmp_path_factory):
    from ninfer.backends.cuda import CudaRunner

    path = tmp_path_factory.mktemp("engine") / "qwen3.ninfer"
    make_random_artifact(path, QWEN3, seed=11)
    r = CudaRunner(str(path), page_size=PAGE, num_pages=64, max_batch=2, max_context=MAX_CTX,
                   kv_dtype=request.param, max_prefill_rows=64)
    yield r
    r.close()


def prompt(i: int, n: int) -> list[int]:
    return [(i * 131 + j * 37) % 1000 + 3 for j in range(n)]


async def run(runner, requests, concurrent=True, **config) -> list[tuple[list[int], Finished]]:
    """(tokens, Finished) of each request on a fresh greedy Engine over ``runner``."""
    cfg = EngineConfig(**{**dict(max_concurrency=1, max_context=MAX_CTX, kv_capacity=1024, prefill_chunk=24,
                                 page_size=PAGE, greedy=True), **config})
    results: list = [None] * len(requests)

    async def one(engine, i, req):
        with engine.reserve() as ticket:
            tokens, finished = [], None
            async for ev in ticket.submit(req):
                if isinstance(ev, TokenDelta):
                    tokens += ev.token_ids
                elif isinstance(ev, Finished):
                    finished = ev
            results[i] = (tokens, finished)

    with trio.fail_after(120):
        async with Engine.open(runner, cfg) as engine:
            if concurrent:
                async with trio.open_nursery() as n:
                    for i, req in enumerate(requests):
                        n.start_soon(one, engine, i, req)
            else:
                for i, req in enumerate(requests):
                    await one(engine, i, req)
    return results


async def alone(runner, tokens: list[int], n: int) -> list[int]:
    [(out, _)] = await run(runner, [GenerationRequest(prompt=tokens, max_tokens=n)], prefix_reuse=False)
    return out


@pytest.mark.parametrize("host_mib, route", [(16, "snapshot"), (0, "replay")])
def test_pause_and_restore_match_alone(runner, host_mib, route):
    trio.run(pause_and_restore_match_alone, runner, host_mib, route)


def test_reused_prefix_matches_alone(runner):
    trio.run(reused_prefix_matches_alone, runner)


# The cases run under trio.run, so they need no async pytest plugin on the GPU host.
async def pause_and_restore_match_alone(runner, host_mib, route):
    # 6 pages of 16 tokens: two requests growing to 70 tokens cannot both stay resident.
    requests = [GenerationRequest(prompt=prompt(i, 40), max_tokens=30) for i in range(2)]
    results = await run(runner, requests, max_concurrency=2, kv_capacity=96, max_context=96,
                        host_context_mib=host_mib, prefix_reuse=False)
    for i, (tokens, finished) in enumerate(results):
        assert finished.reason == "length"
        assert tokens == await alone(runner, prompt(i, 40), 30), f"request {i} ({route})"
    counters = [finished.scheduling for _, finished in results]
    assert sum(c.preemptions for c in counters) >= 1
    restores = sum(c.snapshot_restores if route == "snapshot" else c.replay_restores for c in counters)
    assert restores >= 1, counters


async def reused_prefix_matches_alone(runner):
    [(first, _)] = await run(runner, [GenerationRequest(prompt=prompt(3, 45), max_tokens=8)])
    cont = prompt(3, 45) + first[:-1] + [7, 8, 9]
    partial = prompt(3, 45)[:30] + [5, 6]  # reuse ends inside a page: copy-on-write
    requests = [GenerationRequest(prompt=p, max_tokens=8) for p in (prompt(3, 45), cont, partial)]
    results = await run(runner, requests, concurrent=False)
    (again, _), (second, second_end), (part, part_end) = results
    assert again == first
    assert second_end.usage.cached_tokens == 52 and part_end.usage.cached_tokens == 30
    assert second == await alone(runner, cont, 8)
    assert part == await alone(runner, partial, 8)
