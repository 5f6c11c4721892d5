"""Server chaos: a seeded mix of clients over all three APIs, then nothing may be left over.

Four lanes over a KV pool smaller than their demand and a short queue make requests pause and
restore (by snapshot, or by replay with --host-context-mib 0), wait, time out and overload, while
clients complete, disconnect before the first byte, mid-stream or right after the last frame, give
up on aggregate responses, and chain Responses by previous_response_id. Afterwards, once the server
is idle: /health is 200; no lane, KV page, StateImage slot, Host byte, capacity slot or request
body is held beyond what the prefix cache retains; every request the engine was given ended
once, with one terminal log record; the lifetime capacity is whole; and every response a client
read to the end says what the same request says alone on a cold server without prefix reuse
(greedy with a frequency penalty, so the random model's text depends on its prompt).

A thin runner wrapper (``Gated``) holds the engine worker inside a decode step while its gate is
closed, so "lanes busy, queue full" and "requests admitted together" are states the test sets
instead of races against generation speed. Which client reads what is seeded; only when a
disconnect lands relative to the engine varies, and every invariant holds whatever it is.
"""

from __future__ import annotations

import collections
import json
import logging
import pathlib
import random
import threading
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing

from ninfer.convert.random_model import make_random_artifact
from ninfer.engine.api import _load_reference
from ninfer.server.app import App
from ninfer.server.main import run_server
from server.conftest import serve_args
from server.scripted import sse_events

SEED = 7
CALLS = 48
CLIENTS = 10  # concurrent clients in the mix: more than the lifetime capacity (8)
SERVE = ("--max-concurrency", "4", "--max-pending-requests", "4", "--pending-timeout-ms", "1500",
         "--max-context", "512", "--kv-capacity", "512", "--prefill-chunk", "64",
         "--greedy", "--frequency-penalty", "1.5")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
REFUSED = (429, 529)  # server_overloaded; Anthropic's overloaded_error is 529
TIMED_OUT = ("request_queue_timeout", "timeout_error")  # Anthropic's is a 504 timeout_error
TERMINAL = {"chat": "data: [DONE]", "responses": ("event: response.completed", "event: response.incomplete"),
            "messages": "event: message_stop"}
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
TEXTS = ["Hello there", "What is the weather in Paris?", "Tell me a story about a fox and a crow.",
         "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 6, "Count to ten.",
         "Why is the sky blue? Answer in one paragraph, then list three sources."]
STOPS = ["um", "est", " re", "\n\n\n", "zzq", "ent"]  # pieces of the tiny model's output, and one never seen


# --- the server under test ---------------------------------------------------------------------

class Gated:
    """The engine's runner with a gate in front of decode (the worker waits there while it is
    closed); everything else is the wrapped runner's, a hybrid's StateImage methods included."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.gate = threading.Event()
        self.gate.set()
        self.holding = threading.Event()  # the worker has waited at the closed gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _wait(self) -> None:
        if not self.gate.is_set():
            self.holding.set()
        if not self.gate.wait(timeout=60):
            raise RuntimeError("chaos: the test never reopened the gate")

    def decode(self, batch):
        self._wait()
        return self._inner.decode(batch)

    def launch_decode(self, batch, follow=False):
        self._wait()
        self._inner.launch_decode(batch, follow)


class Handlers:
    """The HTTP exchanges the app is running, and the client addresses it has seen."""

    def __init__(self) -> None:
        self.active = 0
        self.seen: collections.Counter = collections.Counter()


@attrs.define
class Served:
    srv: Any
    runner: Gated
    log: pathlib.Path  # the JSONL request log
    handlers: Handlers

    @property
    def engine(self):
        return self.srv.state.engine

    @property
    def url(self) -> str:
        return self.srv.url

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def started(self) -> int:
        return sum(r["event"] == "request_start" for r in self.records())


# The dense model, and the hybrid one (recurrent state: StateImages, checkpoints, spills). Weight
# seeds whose greedy text runs long: the pressure phase needs outputs that outgrow the pool.
@pytest.fixture(scope="module", params=[("tiny-qwen3", 3), ("tiny-qwen3-next", 6)], ids=["dense", "hybrid"])
def artifact(request, tmp_path_factory):
    preset, seed = request.param
    path = tmp_path_factory.mktemp("chaos") / f"{preset}.ninfer"
    make_random_artifact(path, preset, seed=seed)
    return str(path)


@pytest.fixture
def handlers(monkeypatch):
    watch = Handlers()
    call = App.__call__

    async def watched(self, scope, receive, send):
        if scope["type"] != "http":
            return await call(self, scope, receive, send)
        watch.active += 1
        watch.seen[tuple(scope["client"])] += 1
        try:
            await call(self, scope, receive, send)
        finally:
            watch.active -= 1

    monkeypatch.setattr(App, "__call__", watched)
    return watch


@pytest.fixture
def serve(nursery, artifact, handlers, tmp_path):
    """``await serve(*cli_args)`` → Served: the real server over a gated reference runner."""

    async def start(*extra: str) -> Served:
        log = tmp_path / f"requests{len(list(tmp_path.iterdir()))}.jsonl"
        args = serve_args(artifact, *SERVE, "--request-log-jsonl", str(log), *extra)
        made = []

        def factory(art, config):
            made.append(Gated(_load_reference(artifact, config)[0]))
            return made[0]

        srv = await nursery.start(lambda task_status: run_server(
            args, ["serve"], runner_factory=factory, task_status=task_status))
        return Served(srv, made[0], log, handlers)

    return start


@pytest.fixture
def server_errors():
    """Error records the server logged (its own and hypercorn's)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("ninfer", "hypercorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    yield records
    for lg in loggers:
        lg.removeHandler(handler)


async def wait_for(predicate, timeout=20.0):
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


# --- calls -------------------------------------------------------------------------------------

@attrs.define
class Call:
    api: str  # "chat" | "responses" | "messages"
    body: dict
    drop: str | None = None  # "before" | "mid" | "after" | "gone" | "waiting"; None: read to the end
    at: int = 0  # SSE lines read before a mid-stream drop
    parent: Call | None = None  # the call whose stored Response this one continues
    status: int | None = None
    error: str | None = None
    said: Any = None  # what a response read to the end said, for the determinism check
    response_id: str | None = None
    leave: Any = None  # the event a "waiting" stream leaves on
    ended: bool = False  # its client is done with it


def _conversation(rng: random.Random, api: str, text: str, tools: bool) -> dict:
    if api == "chat":
        msgs = [{"role": "user", "content": text}]
        body = {"messages": msgs}
        if tools:
            body["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
            call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
            msgs += [{"role": "assistant", "content": None,
                      "tool_calls": [{"id": "call_1", "type": "function", "function": call}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
        elif rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": "You are terse."})
        return body
    if api == "responses":
        if not tools:
            return {"input": text}
        return {"tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
                "input": [{"type": "message", "role": "user", "content": text},
                          {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                           "arguments": '{"city": "Paris"}'},
                          {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]}
    msgs = [{"role": "user", "content": text}]
    if not tools:
        return {"messages": msgs}
    msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    return {"tools": [{"name": "get_weather", "input_schema": PARAMS}], "messages": msgs}


def plain_call(api: str, stream: bool, max_tokens: int, text: str = TEXTS[1], drop: str | None = None) -> Call:
    limit = "max_output_tokens" if api == "responses" else "max_tokens"
    body = {**_conversation(random.Random(0), api, text, False), "stream": stream, limit: max_tokens}
    return Call(api, body, drop)


def random_call(rng: random.Random, api: str | None = None) -> Call:
    api = api or rng.choice(list(PATHS))
    body = {**_conversation(rng, api, rng.choice(TEXTS), rng.random() < 0.3),
            "stream": rng.random() < 0.6}
    body["max_output_tokens" if api == "responses" else "max_tokens"] = rng.choice(
        [0, 1, rng.randint(2, 12), rng.randint(40, 120)])
    if api != "responses" and rng.random() < 0.4:  # Responses has no stop strings
        body["stop" if api == "chat" else "stop_sequences"] = rng.sample(STOPS, rng.randint(1, 2))
    if api == "chat" and body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if api == "responses":
        body["store"] = rng.random() < 0.7
    if rng.random() < 0.3:  # thinking off (the template starts in thinking otherwise)
        off = {"chat": ("reasoning_effort", "none"), "responses": ("reasoning", {"effort": "none"}),
               "messages": ("thinking", {"type": "disabled"})}
        body.update([off[api]])
    roll = rng.random()
    drop = (None if roll < 0.55 else "before" if roll < 0.65 else "gone" if roll < 0.75
            else ("mid" if body["stream"] else "gone") if roll < 0.9 else "after")
    return Call(api, body, drop, at=rng.randint(1, 12))


def make_mix(seed: int) -> list[list[Call]]:
    """CLIENTS lists of calls, each run in order; a call may continue its client's previous stored
    Response by previous_response_id (that parent is then read to the end)."""
    rng = random.Random(seed)
    clients: list[list[Call]] = [[] for _ in range(CLIENTS)]
    for i in range(CALLS):
        calls = clients[i % CLIENTS]
        prev = calls[-1] if calls else None
        if prev is not None and prev.api == "responses" and prev.body["store"] and rng.random() < 0.6:
            prev.drop = None
            call = random_call(rng, "responses")
            call.parent = prev
            call.body["input"] = rng.choice(["And tomorrow?", "Say more."])
            call.body.pop("tools", None)
        else:
            call = random_call(rng)
        calls.append(call)
    return clients


# --- clients -----------------------------------------------------------------------------------

async def run_call(s: Served, c: httpx.AsyncClient, call: Call) -> None:
    try:
        await _run_call(s, c, call)
    finally:
        call.ended = True


async def _run_call(s: Served, c: httpx.AsyncClient, call: Call) -> None:
    call.body["model"] = s.srv.state.model_id
    if call.parent is not None:
        if call.parent.response_id is None:
            return  # the parent was refused: there is nothing to continue
        call.body["previous_response_id"] = call.parent.response_id
    if call.drop == "before":
        await _drop_before_response(s, call)
    elif call.drop == "gone":
        with trio.move_on_after(call.at * 0.02):  # a client that gives up while it waits
            await _complete(c, call)
    else:
        await _complete(c, call)


async def _drop_before_response(s: Served, call: Call) -> None:
    """Send the request (all of it, or half of its body) on a raw socket; close it once the server
    has begun the exchange (so the test knows it exists), before reading anything."""
    host, port = s.url.removeprefix("http://").rsplit(":", 1)
    raw = json.dumps(call.body).encode()
    head = (f"POST {PATHS[call.api]} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n\r\n").encode()
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(head + (raw[: len(raw) // 2] if call.at % 2 else raw))
        me = tuple(stream.socket.getsockname())
        await wait_for(lambda: s.handlers.seen[me])


async def _complete(c: httpx.AsyncClient, call: Call) -> None:
    async with c.stream("POST", PATHS[call.api], json=call.body) as r:
        call.status = r.status_code
        if r.status_code != 200:
            call.error = _error_code(json.loads(await r.aread()))
        elif call.body["stream"]:
            await _read_stream(r, call)
        elif call.drop != "after":  # "after": the headers arrived; the body is never read
            data = json.loads(await r.aread())
            call.said = canonical(call.api, data)
            call.response_id = data.get("id")


async def _read_stream(r: httpx.Response, call: Call) -> None:
    lines = []
    async for line in r.aiter_lines():
        lines.append(line)
        if call.drop == "mid" and len(lines) >= call.at:
            return
        if call.drop == "after" and line.startswith(TERMINAL[call.api]):
            return
        if call.drop == "waiting" and len(lines) == 1:
            await call.leave.wait()
            return
    events = sse_events("\n".join(lines))
    name, last = events[-1]
    if "error" in last or name == "response.failed":  # an in-band failure (a queue timeout)
        call.error = _error_code(last)
        return
    assert any(line.startswith(TERMINAL[call.api]) for line in lines), lines[-5:]
    call.said = stream_said(call.api, events)
    if call.api == "responses":
        call.response_id = last["response"]["id"]


def _error_code(data: dict) -> str:
    if data.get("type") == "response.failed":
        return data["response"]["error"]["code"]
    return data["error"].get("code") or data["error"]["type"]


# --- what a response said ----------------------------------------------------------------------

VOLATILE = {"id", "created", "created_at", "completed_at", "timings", "usage", "call_id", "item_id",
            "sequence_number", "previous_response_id"}


def canonical(api: str, body: dict) -> Any:
    """A whole JSON response without what differs between two runs of one request (ids, clocks,
    prefix-reuse usage), with its output token count."""
    usage = body.get("usage") or {}
    return _strip(body), usage.get("completion_tokens", usage.get("output_tokens"))


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def stream_said(api: str, events: list) -> Any:
    """What a whole SSE body said: its deltas joined (how tokens group into deltas is timing)."""
    if api == "responses":  # the terminal event carries the whole Response
        return canonical(api, events[-1][1]["response"])
    joined: dict[str, str] = collections.defaultdict(str)
    ends = []
    for name, data in events:
        if api == "chat":
            for choice in data.get("choices", []):
                for key, val in choice["delta"].items():
                    for tc in val if key == "tool_calls" else ():
                        for k, v in tc.get("function", {}).items():
                            joined[f"tool{tc['index']}.{k}"] += v
                    if isinstance(val, str):
                        joined[key] += val
                ends.append(choice["finish_reason"])
            ends.append((data.get("usage") or {}).get("completion_tokens"))
        elif name == "content_block_start":
            joined[f"{data['index']}.start"] = json.dumps(_strip(data["content_block"]))
        elif name == "content_block_delta":
            delta = data["delta"]
            joined[f"{data['index']}.{delta['type']}"] += next(v for k, v in delta.items() if k != "type")
        elif name == "message_delta":
            ends.append((data["delta"], data["usage"]["output_tokens"]))
    return dict(joined), [e for e in ends if e is not None]


# --- phases ------------------------------------------------------------------------------------

async def run_all(s: Served, calls: list[Call]) -> None:
    """Every call on its own connection, all at once."""
    async def one(call: Call) -> None:
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            await run_call(s, c, call)

    async with trio.open_nursery() as n:
        for call in calls:
            n.start_soon(one, call)


async def overload_and_time_out(s: Served) -> list[Call]:
    """With the worker held in a decode step, the lifetime capacity fills: the two requests past it
    are refused at once, the queued ones time out (503, or an in-band error once a stream began),
    and two streams leave while they wait."""
    capacity = s.engine.config.lifetime_capacity
    apis = list(PATHS) * capacity
    # Calls 0 and 4 are a Chat and a Responses stream, whose first frame comes before admission.
    calls = [plain_call(apis[i], i % 2 == 0, 8, drop="waiting" if i in (0, 4) else None)
             for i in range(capacity + 2)]
    leave = trio.Event()
    for call in calls:
        call.leave = leave
    started = s.started()
    s.runner.gate.clear()
    async with trio.open_nursery() as n:
        n.start_soon(run_all, s, calls)
        # Every call was queued or refused (two are, unless a queued one already timed out).
        await wait_for(lambda: s.started() - started + sum(call.status in REFUSED for call in calls) == len(calls))
        leave.set()
        # At most two were admitted (one prefilled before the held decode, one with it); the rest
        # time out in the queue while the gate stays closed.
        await wait_for(lambda: sum(call.ended for call in calls) >= len(calls) - 2)
        s.runner.gate.set()
    outcomes = [(call.status, call.error) for call in calls]
    assert sum(call.status in REFUSED for call in calls) >= 1, outcomes
    assert sum(call.error in TIMED_OUT for call in calls) >= capacity - 4, outcomes
    return calls


async def pause_under_pressure(s: Served) -> list[Call]:
    """A lane's worth of long requests admitted together outgrow the KV pool: some must pause."""
    before = s.engine.stats().preemptions_total
    n = s.engine.config.max_concurrency
    apis = list(PATHS) * n
    calls = [plain_call(apis[i], i % 2 == 0, 150, TEXTS[3 + 2 * (i % 2)]) for i in range(n)]
    started = s.started()
    s.runner.gate.clear()  # the first one decodes no further until every one is queued
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_all, s, calls)
        await wait_for(lambda: s.started() == started + n)
        s.runner.gate.set()
    await settle(s)
    assert s.engine.stats().preemptions_total > before, "nothing paused: the KV pool outgrew the test"
    return calls


async def run_mix(s: Served, clients: list[list[Call]]) -> None:
    async def client(calls: list[Call]) -> None:
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            for call in calls:
                await run_call(s, c, call)

    async with trio.open_nursery() as n:
        for calls in clients:
            n.start_soon(client, calls)


# --- what must hold afterwards -----------------------------------------------------------------

async def settle(s: Served) -> None:
    """Wait until every request is gone: no handler running, no capacity slot or request body held,
    and a published snapshot with no resident, waiting or paused request that counts one outcome
    for each request the engine was given. Every finish publishes a snapshot, so this is the
    worker's state after its last command, not an older one; a lost request never gets here."""
    engine, app = s.engine, s.srv.app

    def idle() -> bool:
        if s.handlers.active or engine._outstanding or app.bodies:
            return False
        st = engine.stats()
        return (st.requests_running == st.requests_waiting == st.requests_paused == 0
                and sum(st.requests_total.values()) == s.started())

    await wait_for(idle)


def retained(cache) -> tuple[collections.Counter, int, int]:
    """(page → nodes retaining it, nodes holding a device checkpoint, spilled checkpoints) of the
    prefix cache; no node may be locked once no request runs."""
    pages: collections.Counter = collections.Counter()
    slots = spilled = 0
    stack = list(cache.root.children.values()) if cache is not None else []
    while stack:
        node = stack.pop()
        assert node.locks == 0, f"a finished request still locks a prefix node: {node.tokens}"
        pages[node.page] += 1
        slots += node.state is not None
        spilled += node.host is not None
        stack.extend(node.children.values())
    return pages, slots, spilled


async def assert_nothing_held(s: Served, c: httpx.AsyncClient) -> None:
    await settle(s)
    core, st = s.engine._core, s.engine.stats()
    assert (await c.get("/health")).status_code == 200
    assert all(lane is None for lane in core.scheduler.lanes) and core.scheduler.owner is None
    pages, slots, spilled = retained(core.cache)
    assert st.device_kv_used_pages == core.pool.used_count == len(pages)
    for page, holders in pages.items():
        assert core.pool.refcount(page) == holders, f"page {page} is referenced beyond the prefix cache"
    assert core.slots.used == 0 and st.device_state_used_slots == slots
    assert st.host_context_used_bytes == spilled * core.state_bytes
    metrics = (await c.get("/metrics")).text
    for gauge in ("requests_running", "requests_waiting", "requests_paused"):
        assert f"ninfer_{gauge} 0.0" in metrics, gauge
    records = s.records()
    started = [r["request_id"] for r in records if r["event"] == "request_start"]
    ended = collections.Counter(r["request_id"] for r in records if r["event"] in ("request_done", "request_error"))
    assert len(set(started)) == len(started)
    assert [rid for rid in started if ended[rid] != 1] == [], "requests without exactly one terminal record"


async def assert_capacity_whole(s: Served, c: httpx.AsyncClient) -> None:
    """With the worker held, exactly the lifetime capacity is accepted; one more is refused."""
    capacity = s.engine.config.lifetime_capacity
    calls = [plain_call("chat", False, 2) for _ in range(capacity)]
    s.runner.gate.clear()
    async with trio.open_nursery() as n:
        n.start_soon(run_all, s, calls)
        await wait_for(lambda: s.engine._outstanding == capacity)
        extra = await c.post(PATHS["chat"], json={**calls[0].body, "model": s.srv.state.model_id})
        s.runner.gate.set()
    assert extra.status_code == 429, extra.text
    assert [call.status for call in calls] == [200] * capacity


async def assert_same_alone(s: Served, calls: list[Call]) -> None:
    """Every response read to the end says what the same request says alone on a cold server
    without prefix reuse; a chained call continues the oracle's own run of its parent."""
    ids: dict[int, str | None] = {}
    async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
        for call in calls:
            if call.said is None:
                continue
            body = dict(call.body)
            if call.parent is not None:
                body["previous_response_id"] = ids[id(call.parent)]
            alone = Call(call.api, body)
            await run_call(s, c, alone)
            ids[id(call)] = alone.response_id
            assert alone.said == call.said, (call.api, call.body)


# --- the test ----------------------------------------------------------------------------------

@pytest.mark.parametrize("host_mib", [None, "0"], ids=["snapshot", "replay"])
async def test_chaos_leaves_nothing_behind(serve, server_errors, host_mib):
    s = await serve(*(("--host-context-mib", host_mib) if host_mib else ()))
    calls = await overload_and_time_out(s)
    calls += await pause_under_pressure(s)
    clients = make_mix(SEED)
    await run_mix(s, clients)
    calls += [call for client in clients for call in client]
    async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
        await assert_nothing_held(s, c)
        await assert_capacity_whole(s, c)
        await assert_nothing_held(s, c)
    assert not [call for call in calls if call.status == 500 or call.error == "internal_error"]
    assert sum(call.said is not None for call in calls) >= len(calls) // 3
    await assert_same_alone(await serve("--no-prefix-reuse"), calls)
    assert not server_errors, [r.getMessage() for r in server_errors]


# --- regressions ---------------------------------------------------------------------------------

LEFT_EARLY = "the client went away before the response started"


async def asgi_stream(s: Served, body: dict, gone: trio.Event, stall_at: int, stalled: trio.Event) -> None:
    """One Chat Completions stream straight into the app (no socket, so no race): the body, then a
    disconnect once ``gone`` is set. The app's send number ``stall_at`` (1: the response start,
    2: the role chunk) sets ``stalled`` and returns only once the app has seen the
    disconnect: a client that stopped reading and then left."""
    raw = json.dumps({**body, "model": s.srv.state.model_id}).encode()
    scope = {"type": "http", "method": "POST", "path": PATHS["chat"], "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1)}
    incoming = [{"type": "http.request", "body": raw, "more_body": False}]
    seen = trio.Event()
    sends = 0

    async def receive() -> dict:
        if incoming:
            return incoming.pop()
        await gone.wait()
        seen.set()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal sends
        sends += 1
        if sends == stall_at:
            stalled.set()
            await seen.wait()
        await trio.lowlevel.checkpoint()

    await s.srv.app(scope, receive, send)


def terminal_records(s: Served) -> list[dict]:
    records = s.records()
    assert [r["event"] for r in records if r["event"] == "request_start"] == ["request_start"]
    return [r for r in records if r["event"] in ("request_done", "request_error")]


DENSE = pytest.mark.parametrize("artifact", [("tiny-qwen3", 3)], indirect=True, ids=["dense"])


@DENSE
async def test_stream_gone_before_its_first_frame_has_one_terminal_record(serve):
    # The response start finds the client gone: the stream's producer never reaches the engine's
    # events, which used to write the request's only terminal record.
    s = await serve()
    gone, stalled = trio.Event(), trio.Event()
    gone.set()
    await asgi_stream(s, plain_call("chat", True, 8).body, gone, 1, stalled)
    (record,) = terminal_records(s)
    assert (record["event"], record["phase"], record["message"]) == ("request_error", "cancelled", LEFT_EARLY)
    async with httpx.AsyncClient(base_url=s.url) as c:
        await assert_nothing_held(s, c)


@DENSE
async def test_stream_gone_while_its_frames_wait_has_one_terminal_record(serve):
    # The client stops reading at the role chunk while the producer holds the next frame (prompt
    # progress: the engine's events are being consumed) and the worker is held in decode. When the
    # client leaves, the frames generator is closed at once, so the record is the stream's own (it
    # had started), written once: not respond's fallback, then another when it is collected.
    s = await serve()
    gone, stalled = trio.Event(), trio.Event()
    s.runner.gate.clear()
    async with trio.open_nursery() as n:
        body = {**plain_call("chat", True, 8).body, "return_progress": True}
        n.start_soon(asgi_stream, s, body, gone, 2, stalled)
        await stalled.wait()
        await wait_for(s.runner.holding.is_set)  # admitted, prefilled, its progress delivered
        await trio.testing.wait_all_tasks_blocked()  # the producer holds the progress frame
        gone.set()
    s.runner.gate.set()
    (record,) = terminal_records(s)
    assert (record["event"], record["phase"]) == ("request_error", "cancelled")
    assert record["message"] != LEFT_EARLY
    async with httpx.AsyncClient(base_url=s.url) as c:
        await assert_nothing_held(s, c)


@DENSE
async def test_stream_gone_after_the_engine_finished_records_the_outcome(serve):
    # The client stops reading at the role chunk and leaves only once the engine has finished the
    # request (it counted its finish reason): the outcome exists, so the request's one terminal
    # record is request_done with it, not a cancellation (spec: request_done when the Engine returns
    # its outcome; a later transport failure adds no terminal).
    s = await serve()
    gone, stalled = trio.Event(), trio.Event()
    async with trio.open_nursery() as n:
        n.start_soon(asgi_stream, s, plain_call("chat", True, 64).body, gone, 2, stalled)
        await stalled.wait()
        await wait_for(lambda: s.engine.stats().requests_total.get("length") == 1)
        gone.set()
    (record,) = terminal_records(s)
    assert record["event"] == "request_done"
    result = record["result"]
    assert (result["finish_reason"], result["completion_tokens"], len(result["generated_token_ids"])) == ("length", 64, 64)
    async with httpx.AsyncClient(base_url=s.url) as c:
        metrics = (await c.get("/metrics")).text
        assert 'ninfer_requests_total{outcome="length"} 1' in metrics
        await assert_nothing_held(s, c)
