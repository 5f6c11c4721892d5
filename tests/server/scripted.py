"""A test-only ModelRunner that forces scripted output tokens through the real Engine.

It wraps the reference runner (real prefill, KV pages and decode) and replaces each sampled token
with the next id of the script bound to that lane, so reasoning, tool-call and stop-string paths
run through the real Engine, detokenizer and parsers with an output we choose. The scripts the
end-to-end tests share, and the SSE readers they check the wire with, live here too.
"""

from __future__ import annotations

import collections
import json
import threading
import time

import numpy as np

from ninfer.backends.inputs import DecodesAtLaunch
from ninfer.backends.reference import ReferenceRunner
from ninfer.backends.runner import StepResult


def script(tok, *pieces):
    """Token ids of text pieces; one-tuples like ``("<think>",)`` are control tokens by spelling."""
    ids = []
    for p in pieces:
        ids += [tok.added_tokens[p[0]]] if isinstance(p, tuple) else tok.encode(p)
    return ids


def thinking_answer(tok):
    return script(tok, "Let me think.", ("</think>",), "\n\nParis it is.", ("<|im_end|>",))


def tool_call(tok, name="get_weather"):
    return script(tok, ("</think>",), "\n\nChecking.\n", ("<tool_call>",),
                  f"\n<function={name}>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
                  "</parameter>\n</function>\n", ("</tool_call>",), ("<|im_end|>",))


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, JSON data) of every SSE frame (Chat's closing ``[DONE]`` is not JSON: skipped)."""
    out = []
    for frame in text.split("\n\n"):
        name, data = None, None
        for line in frame.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
        if data is not None:
            out.append((name, data))
    return out


def sse_json(text: str) -> list:
    """The data payloads of an SSE body, JSON-decoded ([DONE] kept as a string)."""
    out = []
    for frame in text.split("\n\n"):
        for line in frame.splitlines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


class ScriptedRunner:
    def __init__(self, inner: ReferenceRunner):
        self._inner = inner
        self.info = inner.info
        self.scripts: collections.deque[list[int]] = collections.deque()  # one per upcoming request
        self._lane_script: dict[int, list[int]] = {}
        self._lane_pos: dict[int, int] = {}
        # Tests clear ``gate`` to hold the engine worker inside decode (a request that stays busy),
        # and set ``fail`` to make the next decode raise (an engine-wide failure).
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.delay = 0.0  # seconds each decode step takes at least (a slow model)
        self.prefill_delay = 0.0  # seconds each prefill call takes at least
        self.prefill_gate = threading.Event()  # cleared: prefill calls wait until the test sets it
        self.prefill_gate.set()
        # The pipelined protocol (the engine uses it: the inner runner's info says so): a following
        # step is fed the scripted tokens of the one before it, as a GPU step would be.
        self._launched = DecodesAtLaunch(self.info, self.decode)

    def bind_lane(self, lane, generated):
        self._inner.bind_lane(lane, generated)
        if not generated:  # a fresh request takes the next script
            self._lane_script[lane] = self.scripts.popleft() if self.scripts else []
            self._lane_pos[lane] = 0

    def _next(self, lane: int, sampled: int) -> int:
        script = self._lane_script.get(lane, [])
        pos = self._lane_pos.get(lane, 0)
        self._lane_pos[lane] = pos + 1
        return script[pos] if pos < len(script) else sampled

    def prefill(self, chunk):
        if not self.prefill_gate.wait(timeout=60):
            raise RuntimeError("scripted runner: the test never reopened the prefill gate")
        if self.prefill_delay:
            time.sleep(self.prefill_delay)
        result = self._inner.prefill(chunk)
        if chunk.sample is None:
            return result
        return StepResult(tokens=np.array([self._next(chunk.lane, int(result.tokens[0]))], dtype=np.int32),
                          logits=result.logits)

    def decode(self, batch):
        if not self.gate.wait(timeout=60):
            raise RuntimeError("scripted runner: the test never reopened the gate")
        if self.fail:
            raise RuntimeError("scripted runner: injected decode failure")
        if self.delay:
            time.sleep(self.delay)
        result = self._inner.decode(batch)
        tokens = [self._next(int(lane), int(t)) for lane, t in zip(batch.lanes, result.tokens)]
        return StepResult(tokens=np.array(tokens, dtype=np.int32), logits=result.logits)

    def launch_decode(self, batch, follow=False):
        self._launched.launch(batch, follow)

    def finish_decode(self):
        return self._launched.finish()

    def copy_pages(self, src, dst):
        self._inner.copy_pages(src, dst)

    def read_pages(self, pages):
        return self._inner.read_pages(pages)

    def write_pages(self, pages, data):
        self._inner.write_pages(pages, data)

    def close(self):
        self._inner.close()
