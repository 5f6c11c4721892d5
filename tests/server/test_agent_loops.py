"""Agent loops end to end: call → client executes → result → answer, with prefix reuse on turn two.

Turn one is scripted to emit a tool call through the real Engine and parsers; the client (the
official SDK, as Codex or Claude Code would) sends the result back, chained by
previous_response_id, by replaying the full history, or as an Anthropic tool_result. The second
turn must reuse the first turn's prompt from the engine's prefix cache.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from server.scripted import script, tool_call
from server.test_responses_e2e import FN, MODEL, NS

FINAL = ("It is sunny in Paris.",)


def final(tok):
    return script(tok, ("</think>",), "\n\nIt is sunny in Paris.", ("<|im_end|>",))


async def _responses_turn_one(client, srv, runner, tools, name, **kw):
    runner.scripts.append(tool_call(srv.state.prompts.tokenizer, name))
    r1 = await client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                       max_output_tokens=200, **kw)
    calls = [i for i in r1.output if i.type == "function_call"]
    assert len(calls) == 1 and r1.status == "completed"
    return r1, calls[0]


async def test_responses_loop_chained_by_previous_response_id(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)
    runner = start_server.runner
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    r1, fc = await _responses_turn_one(client, srv, runner, [FN, NS], "mcp__wx__get_weather")
    assert (fc.name, fc.namespace) == ("get_weather", "mcp__wx")
    assert fc.id.startswith("fc_") and fc.call_id.startswith("call_")
    args = json.loads(fc.arguments)
    assert args == {"city": "Paris", "days": 3}

    runner.scripts.append(final(srv.state.prompts.tokenizer))
    r2 = await client.responses.create(
        model=MODEL, previous_response_id=r1.id, tools=[FN, NS], max_output_tokens=200,
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21 C"}])
    assert r2.output_text == FINAL[0] and r2.previous_response_id == r1.id
    assert r2.usage.input_tokens_details.cached_tokens > 0
    assert r2.usage.input_tokens > r1.usage.input_tokens
    items = await client.responses.input_items.list(r2.id)
    assert [i.type for i in items.data] == ["function_call_output"]
    await client.close()


async def test_responses_loop_by_full_history_replay(start_server):
    """Codex style: store:false and the whole conversation sent again on every turn."""
    srv = await start_server("--max-context", "1024", scripted=True)
    runner = start_server.runner
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    r1, fc = await _responses_turn_one(client, srv, runner, [FN], "get_weather", store=False)
    history = [{"type": "message", "role": "user", "content": "What is the weather in Paris?"}]
    history += [item.model_dump(exclude_none=True) for item in r1.output]
    history.append({"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21 C"})

    runner.scripts.append(final(srv.state.prompts.tokenizer))
    r2 = await client.responses.create(model=MODEL, input=history, tools=[FN], store=False, max_output_tokens=200)
    assert r2.output_text == FINAL[0]
    assert r2.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r2.id)
    await client.close()


async def test_messages_tool_use_loop(start_server):
    srv = await start_server("--max-context", "1024", scripted=True)
    runner = start_server.runner
    tok = srv.state.prompts.tokenizer
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x")
    tools = [{"name": "get_weather", "description": "Weather by city",
              "input_schema": FN["parameters"]}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    runner.scripts.append(tool_call(tok))
    m1 = await client.messages.create(model="claude-local", max_tokens=200, tools=tools, messages=messages)
    assert m1.stop_reason == "tool_use"
    (use,) = [b for b in m1.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}

    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "sunny, 21 C"}]}]
    runner.scripts.append(final(tok))
    async with client.messages.stream(model="claude-local", max_tokens=200, tools=tools,
                                      messages=messages) as stream:
        m2 = await stream.get_final_message()
    assert m2.stop_reason == "end_turn" and m2.content[-1].text == FINAL[0]
    assert m2.usage.cache_read_input_tokens > 0
    await client.close()


@pytest.fixture(scope="module")
def demo_artifact(tmp_path_factory):
    from ninfer.convert.gguf import convert_gguf
    from ninfer.demo import MODEL_NAME, DemoModelMissing, demo_gguf

    try:
        gguf = demo_gguf()
    except DemoModelMissing as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("demo") / "smollm2.ninfer"
    convert_gguf(gguf, out, name=MODEL_NAME)
    return str(out)


@pytest.mark.slow
async def test_demo_model_multi_turn_reuses_prefix(start_server, demo_artifact):
    """The real SmolLM2 model and its own chat template: turn two reads turn one from the cache."""
    srv = await start_server("--max-context", "512", artifact=demo_artifact)
    model = srv.state.model_id
    oai = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    r1 = await oai.responses.create(model=model, input="Name a color.", max_output_tokens=4, temperature=0)
    r2 = await oai.responses.create(model=model, input="And another?", previous_response_id=r1.id,
                                    max_output_tokens=4, temperature=0)
    assert r2.usage.input_tokens > r1.usage.input_tokens
    assert r2.usage.input_tokens_details.cached_tokens > 0
    await oai.close()

    ant = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x")
    turn = [{"role": "user", "content": "Name a fruit."}]
    m1 = await ant.messages.create(model="local", max_tokens=4, messages=turn)
    turn += [{"role": "assistant", "content": m1.content[0].text if m1.content else ""},
             {"role": "user", "content": "And another?"}]
    m2 = await ant.messages.create(model="local", max_tokens=4, messages=turn)
    assert m2.usage.cache_read_input_tokens > 0
    await ant.close()


async def test_messages_thinking_history_reuses_the_input_checkpoint(start_server):
    """Turn two replays turn one's thinking; the template drops closed reasoning, so reuse comes from
    the input checkpoint captured before turn one's assistant turn."""
    srv = await start_server("--max-context", "1024", scripted=True)
    tok = srv.state.prompts.tokenizer
    client = anthropic.AsyncAnthropic(base_url=srv.url, api_key="x")
    thinking = {"type": "enabled", "budget_tokens": 1024}
    messages = [{"role": "user", "content": "Capital of France?"}]
    start_server.runner.scripts.append(script(tok, "Recall.", ("</think>",), "\n\nParis.", ("<|im_end|>",)))
    m1 = await client.messages.create(model="m", max_tokens=2000, thinking=thinking, messages=messages)
    assert [b.type for b in m1.content] == ["thinking", "text"]
    messages += [{"role": "assistant", "content": [b.model_dump() for b in m1.content]},
                 {"role": "user", "content": "And of Spain?"}]
    start_server.runner.scripts.append(script(tok, "Recall.", ("</think>",), "\n\nMadrid.", ("<|im_end|>",)))
    m2 = await client.messages.create(model="m", max_tokens=2000, thinking=thinking, messages=messages)
    assert m2.content[-1].text == "Madrid."
    first_prompt = m1.usage.input_tokens + m1.usage.cache_read_input_tokens
    assert 0 < m2.usage.cache_read_input_tokens <= first_prompt
    await client.close()


async def test_request_log_names_each_protocol(start_server, tmp_path):
    path = tmp_path / "log.jsonl"
    srv = await start_server("--request-log-jsonl", str(path))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/responses", json={"model": MODEL, "input": "Hello", "max_output_tokens": 2})
        rid = r.headers["x-request-id"]
        m = await c.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": "Hello"}]})
        mid = m.headers["request-id"]
        await c.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "Hello"})
        await c.post("/v1/messages/count_tokens", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    starts = [(r["protocol"], r["request_id"]) for r in records if r["event"] == "request_start"]
    dones = [(r["protocol"], r["request_id"]) for r in records if r["event"] == "request_done"]
    # One start and one terminal per generation; token counting is not a measured request.
    assert starts == dones == [("openai_responses", rid), ("anthropic_messages", mid)]
