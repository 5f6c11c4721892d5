"""HTTP load generator for a running server: N concurrent streaming Chat Completions clients.

Each client sends requests of mixed prompt and output lengths (a request refused with 429 is
retried after a short pause until it is served) and checks every answer: a 200 stream must start
with the role chunk and end with a finish chunk, a usage chunk and ``[DONE]`` with no error frame;
a 429 must carry ``server_overloaded``. The report gives requests/s, time to first token and
inter-token gaps (p50/p99) and counts of each outcome.
``ninfer bench http URL`` is the command line (``tools/load.py`` is its alias).
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import attrs
import httpx
import trio

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega").split()


class LoadError(Exception):
    """The URL does not lead to a NInfer server's API (a base URL ending in /v1, another server)."""


@attrs.define
class Sample:
    status: int
    ok: bool  # the answer was checked and is correct (a correct 429 included)
    problem: str | None = None
    ttft: float | None = None
    gaps: list[float] = attrs.field(factory=list)
    completion_tokens: int = 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[k]


async def one_request(client: httpx.AsyncClient, model: str, prompt_words: int, max_tokens: int,
                      rng: random.Random) -> Sample:
    text = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            code = _error_code(await resp.aread())
            ok = resp.status_code == 429 and code == "server_overloaded"
            status = f"HTTP {resp.status_code}" + (f" {code}" if code else "")
            return Sample(resp.status_code, ok, None if ok else status)
        return await _check_stream(resp, t0)


def _error_code(body: bytes) -> str | None:
    """``error.code`` of an error answer; None when the body is not NInfer's error JSON."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    return error.get("code") if isinstance(error, dict) else None


async def _check_stream(resp: httpx.Response, t0: float) -> Sample:
    frames: list[Any] = []
    last = None
    sample = Sample(200, False)
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            frames.append(data)
            continue
        try:
            obj = json.loads(data)
            delta = obj["choices"][0]["delta"] if obj.get("choices") else {}
            text = delta.get("content") or delta.get("reasoning_content")
        except (ValueError, LookupError, TypeError, AttributeError):  # not a chunk: another server's stream
            sample.problem = f"stream frame is not a chat completion chunk: {data[:60]!r}"
            return sample
        frames.append(obj)
        if text:
            now = time.monotonic()
            if sample.ttft is None:
                sample.ttft = now - t0
            elif last is not None:
                sample.gaps.append(now - last)
            last = now
    try:
        sample.problem = _stream_problem(frames)
    except (LookupError, TypeError, AttributeError):  # chunks of another shape: not NInfer's stream
        sample.problem = "stream frames are not chat completion chunks"
    sample.ok = sample.problem is None
    if sample.ok:
        sample.completion_tokens = frames[-2]["usage"]["completion_tokens"]
    return sample


def _stream_problem(frames: list[Any]) -> str | None:
    # First: a stream that failed in-band ends with its error frame (and no [DONE]); name that.
    if any("error" in f for f in frames if isinstance(f, dict)):
        return "error frame in stream"
    if len(frames) < 4 or frames[-1] != "[DONE]":
        return "stream did not end with a usage chunk and [DONE]"
    if frames[0]["choices"][0]["delta"].get("role") != "assistant":
        return "stream did not start with the assistant role chunk"
    usage_chunk, finish = frames[-2], frames[-3]
    if usage_chunk.get("choices") != [] or "usage" not in usage_chunk:
        return "no final usage chunk"
    if not finish.get("choices") or finish["choices"][0].get("finish_reason") not in ("stop", "length", "tool_calls"):
        return "no finish_reason chunk"
    return None


async def run_load(url: str, *, model: str | None = None, clients: int = 4, requests: int = 16,
                   prompt_words: tuple[int, ...] = (8, 64, 200), max_tokens: tuple[int, ...] = (8, 32, 64),
                   api_key: str | None = None, seed: int = 0, timeout_s: float = 600.0,
                   retry_pause_s: float = 0.25) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s, limits=limits) as client:
        if model is None:
            model = await _served_model(client)
        samples: list[Sample] = []
        remaining = iter(range(requests))
        t0 = time.monotonic()

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            for _ in remaining:
                words, tokens = rng.choice(prompt_words), rng.choice(max_tokens)
                while True:  # a correct 429 is recorded, then the same request is retried after a pause
                    sample = await one_request(client, model, words, tokens, rng)
                    samples.append(sample)
                    if sample.status != 429 or not sample.ok:
                        break
                    await trio.sleep(retry_pause_s)

        async with trio.open_nursery() as nursery:
            for i in range(clients):
                nursery.start_soon(worker, i)
        wall = time.monotonic() - t0
    return summarize(samples, wall, clients)


async def _served_model(client: httpx.AsyncClient) -> str:
    """The first model id ``/v1/models`` lists; a LoadError when the answer is not that list."""
    resp = await client.get("/v1/models")
    try:
        model = resp.json()["data"][0]["id"] if resp.status_code == 200 else None
    except (ValueError, LookupError, TypeError):
        model = None
    if not isinstance(model, str):
        raise LoadError(f"GET {resp.url} answered HTTP {resp.status_code} without a model list: give the "
                        f"base URL of a running `ninfer serve` (without /v1) and its --api-key, or --model")
    return model


def summarize(samples: list[Sample], wall: float, clients: int) -> dict:
    done = [s for s in samples if s.status == 200 and s.ok]
    ttfts = [s.ttft for s in done if s.ttft is not None]
    gaps = [g for s in done for g in s.gaps]
    overloaded = sum(1 for s in samples if s.status == 429 and s.ok)  # retried: not separate requests
    return {
        "clients": clients,
        "requests": len(samples) - overloaded,
        "completed": len(done),
        "overloaded_429": overloaded,
        "incorrect": [s.problem for s in samples if not s.ok],
        "wall_seconds": wall,
        "requests_per_second": len(done) / wall if wall > 0 else 0.0,
        "output_tokens_per_second": sum(s.completion_tokens for s in done) / wall if wall > 0 else 0.0,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "inter_token_p50_ms": _ms(percentile(gaps, 50)),
        "inter_token_p99_ms": _ms(percentile(gaps, 99)),
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0
