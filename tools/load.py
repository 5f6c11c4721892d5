"""Load a running `ninfer serve` with concurrent streaming Chat Completions clients.

    python tools/load.py http://127.0.0.1:8080 --clients 8 --requests 64

Prints one JSON report: requests/s, TTFT and inter-token p50/p99, completed and 429 counts, and
every incorrect answer (there should be none). Logic: ninfer/server/load.py.
"""

from __future__ import annotations

import argparse
import json
import sys

import trio

from ninfer.server.load import run_load


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-words", type=_ints, default=(8, 64, 200), help="comma-separated mix")
    p.add_argument("--max-tokens", type=_ints, default=(8, 32, 64), help="comma-separated mix")
    p.add_argument("--api-key")
    p.add_argument("--model")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    report = trio.run(lambda: run_load(a.url, model=a.model, clients=a.clients, requests=a.requests,
                                       prompt_words=a.prompt_words, max_tokens=a.max_tokens,
                                       api_key=a.api_key, seed=a.seed))
    print(json.dumps(report, indent=2))
    return 1 if report["incorrect"] else 0


if __name__ == "__main__":
    sys.exit(main())
