"""Serve options that change request behavior, observed over HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "random-tiny-qwen3"
HI = [{"role": "user", "content": "Hello there"}]


async def ask(c, **extra):
    body = {"model": MODEL, "messages": HI, "max_tokens": 6, **extra}
    r = await c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def text(r):
    m = r["choices"][0]["message"]
    return (m.get("reasoning_content") or "") + "|" + (m["content"] or "")


async def test_no_thinking_default_and_request_override(start_server):
    srv = await start_server("--no-thinking")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        off = await ask(c)
        on = await ask(c, enable_thinking=True)
        effort = await ask(c, reasoning_effort="high")  # an effort asks for thinking: the template's default
        none = await ask(c, reasoning_effort="none")
    assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert on["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0  # the request wins
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]  # the empty think block is rendered
    assert effort["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"]
    assert none["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]


def generated_ids(log) -> list[list[int]]:
    """Output token ids of each finished request, in order, from the JSONL request log."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r["result"]["generated_token_ids"] for r in records if r["event"] == "request_done"]


@pytest.mark.slow
async def test_greedy_and_process_seed(start_server, smollm2_artifact, tmp_path):
    """Sampler flags over the real SmolLM2 (the tiny random model's distribution is too peaked to
    show seed effects)."""
    smol = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 8, "temperature": 1.0}

    async def run(*flags, requests):
        log = tmp_path / f"log{len(list(tmp_path.iterdir()))}.jsonl"
        srv = await start_server("--max-context", "512", "--request-log-jsonl", str(log), *flags,
                                 artifact=smollm2_artifact)
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            for extra in requests:
                assert (await c.post("/v1/chat/completions", json={**smol, **extra})).status_code == 200
        return generated_ids(log)

    seeds = [{"seed": s} for s in (1, 2, 3)]
    varied = await run(requests=seeds)
    assert len({tuple(ids) for ids in varied}) > 1  # request seeds change the sample
    forced = await run("--greedy", requests=seeds + [{"temperature": 0}])
    assert len({tuple(ids) for ids in forced}) == 1  # --greedy forces argmax whatever the request asks
    fixed = await run("--seed", "7", requests=[{}, {}])
    assert fixed[0] == fixed[1]  # the process seed makes unseeded requests repeatable


async def test_chat_template_file(start_server, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\nCUSTOM {{ m.content }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    default = await start_server()
    custom = await start_server("--chat-template", str(template))
    async with httpx.AsyncClient(base_url=default.url) as c:
        d = await ask(c)
    async with httpx.AsyncClient(base_url=custom.url) as c:
        u = await ask(c)
    # No <think> opener in the custom template: the output is all answer, never reasoning.
    assert u["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert u["usage"]["prompt_tokens"] != d["usage"]["prompt_tokens"]
