"""The trio facade: reserve → submit → events, over the simulated runner on the worker thread."""

from __future__ import annotations

import pytest
import trio

from ninfer.engine import Engine, EngineConfig, GenerationRequest, SamplingOverrides
from ninfer.engine.events import Finished, PromptProgress, TokenDelta
from ninfer.engine.simulated import SimulatedRunner

GREEDY = SamplingOverrides(temperature=0.0)


def config(**kw):
    base = dict(max_concurrency=2, max_context=256, kv_capacity=512, prefill_chunk=32)
    base.update(kw)
    return EngineConfig(**base)


def runner_for(cfg: EngineConfig, **kw) -> SimulatedRunner:
    return SimulatedRunner(page_size=cfg.page_size, num_pages=cfg.kv_pages, max_batch=cfg.max_concurrency, vocab_size=256,
                           max_context=cfg.max_context, **kw)


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
