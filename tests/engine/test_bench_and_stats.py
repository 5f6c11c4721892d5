"""`ninfer bench engine` runs end to end; stats snapshots give the throughput record's figures."""

from __future__ import annotations

import re

import trio

from ninfer.cli import main
from ninfer.engine import Engine, EngineConfig, GenerationRequest, SamplingOverrides
from ninfer.engine.simulated import SimulatedRunner
from ninfer.engine.stats import throughput


def test_bench_engine_reports_host_time_per_step(capsys):
    assert main(["bench", "engine", "--lanes", "4", "--steps", "60", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("run ") == 2 and "average batch" in out
    median = float(re.search(r"median ([0-9.]+) us over 2 runs", out).group(1))
    assert median > 0


async def test_throughput_interval_from_two_snapshots():
    cfg = EngineConfig(max_concurrency=4, max_context=128, kv_capacity=512)
    runner = SimulatedRunner(page_size=16, num_pages=cfg.kv_pages, max_batch=4, max_context=128, vocab_size=256)
    async with Engine.open(runner, cfg) as engine:
        before = engine.stats()

        async def one(i):
            with engine.reserve() as ticket:
                async for _ in ticket.submit(GenerationRequest(prompt=[i + 1] * 20, max_tokens=10,
                                                               sampling=SamplingOverrides(temperature=0.0))):
                    pass

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        after = engine.stats()
    figures = throughput(before, after)
    assert figures["generation_tokens"] == 40 and figures["decode_tokens"] == 36  # first tokens come from prefill
    assert figures["prefill_tokens"] == 80 and 1 <= figures["average_batch"] <= 4
    assert after.device_kv_capacity_pages == cfg.kv_pages and after.requests_running == 0
    assert after.request_duration_seconds.count == 4 and after.time_to_first_token_seconds.count == 4
    assert set(figures["host_work_seconds"]) >= {"engine_boundary", "program_submit", "program_post",
                                                 "engine_commit_output", "engine_maintenance", "total"}
