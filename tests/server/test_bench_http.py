"""`ninfer bench http URL` end to end: the command (in a thread, as it runs its own trio loop) loads a
live server on loopback and checks every answer; a refused request must be a correct 429."""

from __future__ import annotations

import json

import trio

from ninfer.cli import main


async def _bench(capsys, *argv: str) -> tuple[int, dict]:
    code = await trio.to_thread.run_sync(main, ["bench", "http", *argv])
    return code, json.loads(capsys.readouterr().out)


async def test_bench_http_checks_every_answer(start_server, capsys):
    # Lifetime capacity 1 for 3 clients: most requests are refused with 429 at first, then retried.
    srv = await start_server("--max-concurrency", "1", "--max-pending-requests", "0", "--api-key", "k")
    code, report = await _bench(capsys, srv.url, "--clients", "3", "--requests", "6", "--prompt-words", "4,12",
                                "--max-tokens", "2,6", "--api-key", "k")
    assert code == 0 and report["incorrect"] == []
    assert report["clients"] == 3 and report["requests"] == report["completed"] == 6
    assert report["overloaded_429"] > 0 and report["requests_per_second"] > 0
    assert report["ttft_p50_ms"] is None or report["ttft_p50_ms"] > 0


async def test_bench_http_exits_1_on_a_wrong_answer(start_server, capsys):
    srv = await start_server("--api-key", "k")
    code, report = await _bench(capsys, srv.url, "--clients", "1", "--requests", "2", "--max-tokens", "2",
                                "--model", "random-tiny-qwen3", "--api-key", "wrong")
    assert code == 1 and report["completed"] == 0
    assert len(report["incorrect"]) == 2 and all(p.startswith("HTTP 401") for p in report["incorrect"])
