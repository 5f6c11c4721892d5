"""Helpers for engine tests: a simulated runner and a synchronous core driver."""

from __future__ import annotations

import itertools
import re

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


# One pause cycle's boundaries (spec request_scheduling); a cycle may end early, paused again or
# cancelled. replay_complete may also close a rebuild an earlier replay cycle left unfinished.
CYCLE = re.compile(r"pause_started paused( restore_started restored( replay_complete)?( recovery_complete)?)?")


def pause_cycles(f: Finished) -> list[list]:
    """``f``'s transitions, one list per pause cycle, after checking their order and routes: a
    preempted request ends with terminal, and a normal finish follows a finished recovery."""
    ts, n = list(f.scheduling.transitions), f.scheduling.preemptions
    if not n:
        assert not ts
        return []
    assert ts[-1].kind == "terminal" and ts[-1].preemption_index == n
    assert [t.steady_ns for t in ts] == sorted(t.steady_ns for t in ts)
    cycles = [[t for t in ts[:-1] if t.preemption_index == k] for k in range(1, n + 1)]
    assert [t for c in cycles for t in c] == ts[:-1]
    for cycle in cycles:
        kinds = [t.kind for t in cycle]
        assert CYCLE.fullmatch(" ".join(kinds)), kinds
        route = cycle[1].route
        assert cycle[0].route is None and route in ("snapshot", "replay")
        assert all(t.route == ("replay" if t.kind == "replay_complete" else route) for t in cycle[1:])
        if kinds[-1] == "recovery_complete":  # at the first fresh unit: at most one decode round on
            assert cycle[-1].request_progress.decode_tokens - cycle[3].request_progress.decode_tokens <= 1
    last = [t.kind for t in cycles[-1]]
    if f.reason != "cancelled":
        assert last[-1] == "recovery_complete" and ("replay_complete" in last or cycles[-1][1].route == "snapshot")
    assert ts[-1].route == cycles[-1][1].route
    return cycles
