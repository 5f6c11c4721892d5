"""Helpers for engine tests: a simulated runner and a synchronous core driver."""

from __future__ import annotations

import itertools

import pytest

from ninfer.engine import EngineConfig, GenerationRequest, sampling
from ninfer.engine.context_cost import load
from ninfer.engine.events import Finished, TokenDelta
from ninfer.engine.core import EngineCore
from ninfer.engine.sequence import Sequence
from ninfer.engine.simulated import SimulatedRunner


class CoreDriver:
    """Drives an EngineCore step by step on the test thread (no worker, no trio)."""

    def __init__(self, config: EngineConfig, num_pages: int | None = None, vocab_size: int = 64, runner=None,
                 **runner_kw):
        self.config = config
        self.runner = runner or SimulatedRunner(
            page_size=config.page_size, num_pages=num_pages or config.kv_pages, max_batch=config.max_concurrency,
            max_context=config.max_context, vocab_size=vocab_size, **runner_kw)
        self.now = 0.0
        self.core = EngineCore(self.runner, config, load(None, "simulated", ""), clock=lambda: self.now)
        self._rids = itertools.count()

    def submit(self, prompt, max_tokens, stop_ids=(), timeout=1e9, **fields) -> Sequence:
        request = GenerationRequest(prompt=prompt, max_tokens=max_tokens, **fields)
        preset = dict(sampling.GENERIC_PRESET, temperature=0.0)
        row = sampling.resolve(preset, self.config, request.sampling)
        seq = Sequence(next(self._rids), request, row, frozenset(stop_ids) | frozenset(request.stop_token_ids),
                       self.core.limit, self.now + timeout, self.now)
        self.core.add(seq)
        return seq

    def run(self, max_steps: int = 100000) -> int:
        steps = 0
        while self.core.has_work() and steps < max_steps:
            self.core.step()
            self.now += 0.001
            steps += 1
        return steps


def out(seq: Sequence) -> list[int]:
    """Every output token id a driven sequence published."""
    return [t for e in seq.outbox if isinstance(e, TokenDelta) for t in e.token_ids]


def end(seq: Sequence) -> Finished:
    """The driven sequence's one terminal event."""
    ends = [e for e in seq.outbox if isinstance(e, Finished)]
    assert len(ends) == 1
    return ends[0]


@pytest.fixture
def driver_factory():
    return CoreDriver
