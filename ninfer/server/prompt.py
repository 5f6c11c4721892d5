"""Conversation → prompt token ids: the chat template, cache-hint frontiers and thinking control.

``PromptBuilder.prepare`` renders a normalized ``Conversation`` with the server's template defaults,
tokenizes it, and maps the conversation's prompt-cache hints to exact token frontiers (a hint that
is not one is dropped; hints never change the prompt). Every family prepares through it; token
counting endpoints use it without generating.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs
import trio

from ninfer.engine import ThinkingControl
from ninfer.text.chat_template import TemplateError, TemplateKwargError, early_close_ids
from protocols.conversation import Conversation
from protocols.errors import ProtocolError

SENTINEL = "\ue000"  # a private-use character marks cache-hint positions in a text-only rendering


@attrs.frozen
class ServeDefaults:
    """Process-wide request defaults from the command line."""

    max_tokens: int = 8192
    thinking: bool | None = None  # False with --no-thinking; None leaves the template default
    preserve_thinking: bool | None = None  # True with --preserve-thinking
    thinking_budget: int | None = None


@attrs.frozen
class PreparedPrompt:
    token_ids: tuple[int, ...]
    starts_in_thinking: bool
    cache_boundaries: tuple[int, ...]
    input_checkpoint: int | None
    # Time ``prepare`` spent on this prompt, builder lock held (waits for the lock or the thread
    # excluded): the template rendering and its encoding (ChatFormatter.render interleaves the two,
    # so they are not timed apart), the cache-hint frontier search and the prefill's encoding.
    # Measurements, not part of the prompt: two preparations of one conversation still compare equal.
    tokenizer_seconds: float = attrs.field(default=0.0, eq=False)
    cache_hint_seconds: float = attrs.field(default=0.0, eq=False)  # the frontier search's share


class PromptBuilder:
    """Conversation → token ids through the chat template (runs on the request's task)."""

    def __init__(self, tokenizer: Any, formatter: Any, defaults: ServeDefaults):
        self.tokenizer = tokenizer
        self.formatter = formatter
        self.defaults = defaults
        # The formatter is not thread-safe: every rendering holds this lock, whoever calls.
        self._lock = threading.Lock()
        self._limiter = trio.CapacityLimiter(1)

    async def prepare_async(self, conv: Conversation) -> PreparedPrompt:
        """``prepare`` on a worker thread: a long prompt takes milliseconds to seconds to render and
        tokenize, and the event loop must keep other streams flowing meanwhile."""
        return await trio.to_thread.run_sync(self.prepare, conv, limiter=self._limiter)

    def prepare(self, conv: Conversation) -> PreparedPrompt:
        with self._lock:
            return self._prepare(conv)

    def _prepare(self, conv: Conversation) -> PreparedPrompt:
        t0 = time.perf_counter()
        kwargs = conv.template_kwargs(thinking_default=self.defaults.thinking,
                                      preserve_default=self.defaults.preserve_thinking)
        messages = conv.template_messages()
        try:
            prompt = self.formatter.render(messages, conv.template_tools(), add_generation_prompt=True,
                                           boundary_messages=(), **kwargs)
        except TemplateKwargError as e:
            raise ProtocolError("invalid_value", str(e), f"chat_template_kwargs.{e.name}") from None
        except TemplateError as e:
            raise ProtocolError("invalid_prompt", f"The conversation cannot be rendered: {e}") from None
        t_hints = time.perf_counter()
        boundaries = self._cache_boundaries(conv, messages, kwargs, prompt)
        hint_seconds = time.perf_counter() - t_hints
        ids = prompt.token_ids
        if conv.prefill:  # Anthropic assistant prefill: generation continues this client text
            ids = ids + tuple(self.tokenizer.encode(conv.prefill))
        return PreparedPrompt(ids, prompt.thinking and not conv.prefill, boundaries, prompt.prefix_before_generation,
                              tokenizer_seconds=time.perf_counter() - t0, cache_hint_seconds=hint_seconds)

    def _cache_boundaries(self, conv: Conversation, messages: list[dict], kwargs: dict, prompt: Any) -> tuple[int, ...]:
        """Token frontiers of the cache hints; a hint that is no exact token frontier is ignored."""
        exact = self._part_offsets(conv, messages, kwargs, prompt)
        # Tool declarations and calls end in template text, which may merge into one token with what
        # follows (".\n\n"): their frontier is the last token frontier at or before that end.
        floor = self._tool_offsets(conv, kwargs, prompt) + self._call_offsets(conv, messages, kwargs, prompt)
        found = [self._token_frontier(prompt, o) for o in exact]
        found += [self._token_frontier(prompt, o, round_down=True) for o in floor]
        return tuple(sorted({b for b in found if b}))

    def _part_offsets(self, conv: Conversation, messages: list[dict], kwargs: dict, prompt: Any) -> list[int]:
        """Text offsets where the marked parts end."""
        marks = {(m.message, m.part) for m in conv.cache_marks()}
        if not marks:
            return []
        offsets = self._sentinel_offsets(conv, messages, kwargs, prompt, marks)
        if offsets is not None or len(marks) == 1:
            return offsets or []
        # The template moved or rewrote some marked text: each mark on its own, so only the marks
        # that are no exact frontier are ignored (a sentinel can, e.g., make an empty part non-empty).
        found = (self._sentinel_offsets(conv, messages, kwargs, prompt, {mark}) for mark in sorted(marks))
        return [o for offsets in found if offsets for o in offsets]

    def _sentinel_offsets(self, conv: Conversation, messages: list[dict], kwargs: dict, prompt: Any,
                          marks: set[tuple[int, int]]) -> list[int] | None:
        """Render once more with a sentinel after each part in ``marks`` (message, part); the sentinels'
        offsets in the prompt, or None when the template did not reproduce the prompt around them."""
        marked = [dict(m) for m in messages]
        for mi in {mi for mi, _ in marks}:
            parts = conv.messages[mi].parts
            marked[mi]["content"] = "".join(p.text + (SENTINEL if (mi, i) in marks else "") for i, p in enumerate(parts))
        text = self._render_text(marked, conv.template_tools(), True, kwargs)
        if text is None or text.replace(SENTINEL, "") != prompt.text:
            return None
        offsets, removed = [], 0
        for i, ch in enumerate(text):
            if ch == SENTINEL:
                offsets.append(i - removed)
                removed += 1
        return offsets

    def _tool_offsets(self, conv: Conversation, kwargs: dict, prompt: Any) -> list[int]:
        """Where the declarations of the tools up to a marked one end.

        The tools up to and including the marked one, rendered alone (no messages, no generation
        prompt), leave the prompt where the template's text starts to depend on anything else: after
        the marked tool's declaration, or for the last tool at the end of the whole tools block.
        """
        tools = conv.template_tools() or []
        out = []
        for i, tool in enumerate(conv.tools):
            if tool.cache_breakpoint:
                text = self._render_text([], tools[:i + 1], False, kwargs)
                if text is not None:
                    out.append(_common_prefix(text, prompt.text))
        return out

    def _call_offsets(self, conv: Conversation, messages: list[dict], kwargs: dict, prompt: Any) -> list[int]:
        """Where marked tool calls end: the prompt with the calls cut after the marked one, rendered
        with and without one more call after it, diverges right after the marked call."""
        tools = conv.template_tools()
        out = []
        for mi, msg in enumerate(conv.messages):
            for k, call in enumerate(msg.tool_calls):
                if not call.cache_breakpoint:
                    continue
                calls = messages[mi]["tool_calls"][:k + 1]
                texts = []
                for variant in (calls, calls + calls[-1:]):  # a copy of the call is a valid next call
                    cut = list(messages)
                    cut[mi] = dict(messages[mi], tool_calls=variant)
                    texts.append(self._render_text(cut, tools, True, kwargs))
                if None in texts:
                    continue
                end = _common_prefix(texts[0], texts[1])
                if texts[0][:end] == prompt.text[:end]:  # the earlier text does not depend on the cut
                    out.append(end)
        return out

    def _render_text(self, messages: list[dict], tools: Any, generation: bool, kwargs: dict) -> str | None:
        try:
            return self.formatter.render(messages, tools, add_generation_prompt=generation,
                                         boundary_messages=(), **kwargs).text
        except TemplateError:
            return None  # a rendering the template refuses offers no frontier

    def _token_frontier(self, prompt: Any, char_offset: int, round_down: bool = False) -> int | None:
        """The token count whose decoded prefix is exactly ``text[:char_offset]``, or None.

        ``round_down``: the largest token count whose decoded prefix is a prefix of that text.

        Hints usually sit near the end of the prompt (the implicit one ends the latest message), so
        the search runs on suffixes from the end, galloping outwards: its cost follows the distance
        from the end rather than the prompt length. One full-prefix decode confirms the answer.
        """
        ids, text = prompt.token_ids, prompt.text
        n, want = len(ids), len(text) - char_offset

        def suffix_len(k: int) -> int:
            return len(self.tokenizer.decode(ids[k:]))

        hi, lo, step = n, n - 1, 1  # suffix_len(hi) < want <= suffix_len(lo) once the gallop stops
        while lo > 0 and suffix_len(lo) < want:
            hi, step = lo, step * 2
            lo = max(0, n - step)
        while hi - lo > 1:  # the largest k whose suffix still covers ``want`` characters
            mid = (lo + hi) // 2
            if suffix_len(mid) >= want:
                lo = mid
            else:
                hi = mid
        k = lo if want > 0 else n
        head = self.tokenizer.decode(ids[:k]) if 0 < k <= n else None
        if head is not None and (head == text[:char_offset] or round_down and text.startswith(head)):
            return k
        return None

    def thinking_control(self, prepared: PreparedPrompt, budget: int | None) -> ThinkingControl:
        if not prepared.starts_in_thinking or budget is None:
            return ThinkingControl(starts_in_thinking=prepared.starts_in_thinking)
        return ThinkingControl(starts_in_thinking=True, budget=budget,
                               close_ids=early_close_ids(self.tokenizer),
                               end_think_id=self.tokenizer.added_tokens.get("</think>"))


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix: a bisection over slice comparisons, which run in C, instead of
    a Python loop over the characters of a prompt that may be hundreds of thousands long."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
