"""Chat template rendering: messages -> prompt text and token ids (docs/text.md).

Templates run in Hugging Face's sandboxed environment (``template_env``). Each prompt
is rendered twice: once plainly, giving the prompt text, and once with client strings marked
(``client_text``), giving which characters came from the client. Control tokens are recognized
only in the template's own text; every run of text between them, template and client text
together, is encoded with control tokens off, as Hugging Face would tokenize it.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import jinja2

from ninfer.text import client_text
from ninfer.text.client_text import Marks
from ninfer.text.reasoning import CLOSE_MARKER as THINK_CLOSE, OPEN_MARKER as THINK_OPEN
from ninfer.text.template_env import TemplateError, make_environment
from ninfer.text.tokenizer import Tokenizer

__all__ = ["ChatFormatter", "Prompt", "TemplateError", "TemplateKwargError", "early_close_ids",
           "QWEN_THINKING_EARLY_CLOSE", "RESERVED_TEMPLATE_KWARGS"]

# Names a request's template kwargs may not set: the conversation, the generation mode and what
# the tokenizer provides (spec, chat_template_kwargs).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "boundary_messages",
    "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now",
    "namespace",
})
# Standard options where None means "unspecified": they are dropped so the template default holds.
STANDARD_OPTIONS = ("enable_thinking", "preserve_thinking", "reasoning_effort")

# Message ends whose token offsets render() computes unless told which (one rendering each).
DEFAULT_BOUNDARY_MESSAGES = 8

# Qwen's canonical guidance when a thinking budget runs out: committed to the sequence, then the
# close marker (spec, --default-thinking-budget).
QWEN_THINKING_EARLY_CLOSE = ("\n\nConsidering the limited time, I have to give the solution based on "
                             "the thinking directly now.\n</think>\n\n")


class TemplateKwargError(ValueError):
    """A template kwarg that a request may not set."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"chat_template_kwargs.{name}: {reason}")
        self.name = name


@attrs.frozen
class Prompt:
    token_ids: tuple[int, ...]
    text: str
    thinking: bool  # generation starts inside an open <think>
    # Token count at the end of each message where the prompt of messages[:i+1] (no generation
    # prompt) is an exact token prefix of this prompt; None where it is not (e.g. the template
    # dropped that turn's reasoning once a later user turn arrived).
    message_end_offsets: tuple[int | None, ...]
    # Token count before the generation prompt (None if the template rewrote earlier text).
    prefix_before_generation: int | None


class ChatFormatter:
    """Renders conversations with one template over one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, template_source: str, special_tokens: Mapping[str, Any]):
        self.tokenizer = tokenizer
        self._env = make_environment()
        try:
            self._template = self._env.from_string(template_source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template syntax error, line {exc.lineno}: {exc.message}") from exc
        bos = special_tokens.get("bos_token_id")
        eos = list(special_tokens.get("eos_token_ids") or [])
        pad = special_tokens.get("pad_token_id")
        # HF passes the tokenizer's special-token spellings to every template.
        self._token_vars = {
            "bos_token": tokenizer.id_to_token(bos) if bos is not None else "",
            "eos_token": tokenizer.id_to_token(eos[0]) if eos else "",
            "pad_token": tokenizer.id_to_token(pad) if pad is not None else "",
        }
        added = tokenizer.added_tokens
        # Leftmost-longest match of control spellings in template text.
        self._control = {s: i for s, i in added.items() if not s.isspace()}
        self._control_re = _control_pattern(tokenizer, self._control)
        self._control_order = _longest_first(self._control)
        self._think_open = added.get(THINK_OPEN)
        self._think_close = added.get(THINK_CLOSE)

    # -- public -------------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], /,
               tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
               boundary_messages: Iterable[int] | None = None, continue_final_message: bool = False,
               **template_kwargs: Any) -> Prompt:
        """Render and encode one conversation.

        ``boundary_messages``: indices of the messages whose end offsets to compute (each costs
        one more template rendering of the shorter conversation); default: the last
        ``DEFAULT_BOUNDARY_MESSAGES``. The others are None in ``message_end_offsets``.
        ``continue_final_message``: the prompt ends right after the final message's content so
        that generation continues it (assistant prefill), cut as Hugging Face does.
        """
        kwargs = self._check_kwargs(template_kwargs)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are exclusive")
        wanted = _wanted_boundaries(len(messages), boundary_messages)
        messages = _alias_reasoning(messages)
        if continue_final_message:
            messages = _tag_final_message(messages)
        text = self._render_plain(messages, tools, add_generation_prompt, kwargs)
        spans = self._render_spans(messages, tools, add_generation_prompt, kwargs, text)
        if continue_final_message:
            text = text[:_continuation_end(messages, text)]
            spans = _cut_spans(spans, len(text))
        pieces = self._pieces(spans)
        ids, starts = self._encode(pieces)

        def prefix(msgs: Sequence[Mapping[str, Any]]) -> int | None:
            return self._prefix_tokens(msgs, tools, False, kwargs, text, pieces, starts)

        if continue_final_message:
            before_generation = prefix(messages[:-1])  # the continued turn is the response
        elif add_generation_prompt:
            before_generation = prefix(messages)
        else:
            before_generation = len(ids)
        return Prompt(
            token_ids=tuple(ids),
            text=text,
            thinking=self._starts_thinking(ids),
            message_end_offsets=tuple(prefix(messages[:i + 1]) if i in wanted else None
                                      for i in range(len(messages))),
            prefix_before_generation=before_generation,
        )

    # -- rendering ------------------------------------------------------------------------------

    def _check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        for name in kwargs:
            if name in RESERVED_TEMPLATE_KWARGS:
                raise TemplateKwargError(name, "is set by the server and cannot be overridden")
        return {k: v for k, v in kwargs.items() if not (k in STANDARD_OPTIONS and v is None)}

    def _run(self, messages, tools, add_generation_prompt, kwargs) -> str:
        try:
            return self._template.render(
                **kwargs, **self._token_vars, messages=messages, tools=tools,
                add_generation_prompt=add_generation_prompt)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                RecursionError) as exc:  # errors of the template's own code, not of ours
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def _render_plain(self, messages, tools, add_generation_prompt, kwargs) -> str:
        return self._run(list(messages), list(tools) if tools else tools, add_generation_prompt, kwargs)

    def _render_spans(self, messages, tools, add_generation_prompt, kwargs,
                      plain: str) -> list[tuple[str, bool]]:
        """The rendering as (text, is_client) spans, checked against the plain rendering."""
        marks = Marks()
        token = client_text.CURRENT_MARKS.set(marks)
        try:
            marked = self._run(client_text.mark_client(list(messages), marks),
                               client_text.mark_client(tools, marks) if tools else tools,
                               add_generation_prompt, client_text.mark_client(kwargs, marks))
            spans = client_text.split_marked(marked, marks)
        except client_text.UnbalancedMarks as exc:
            raise TemplateError(f"chat template cuts through client text ({exc}); cannot tell "
                                "client text from template markup") from exc
        except RecursionError as exc:  # marking walks client data, which may nest past the stack
            raise TemplateError("client data nests too deeply to track its text") from exc
        finally:
            client_text.CURRENT_MARKS.reset(token)
        if "".join(s for s, _ in spans) != plain:
            raise TemplateError("chat template renders client strings differently when tracking "
                                "their origin; cannot tell client text from template markup")
        return spans

    # -- encoding -------------------------------------------------------------------------------

    def _pieces(self, spans: list[tuple[str, bool]]) -> list[str | tuple[int, int]]:
        """Text runs and control ids: controls only from template spans, text runs merged."""
        pieces: list[str | tuple[int, int]] = []

        def add_text(s: str) -> None:
            if not s:
                return
            if pieces and isinstance(pieces[-1], str):
                pieces[-1] += s
            else:
                pieces.append(s)

        for text, is_client in spans:
            if is_client or self._control_re is None:
                add_text(text)
                continue
            pos = 0
            for m in self._control_re.finditer(text):
                add_text(text[pos:m.start()])
                # (id, characters covered): lstrip/rstrip tokens also cover whitespace
                spelling = self._control_order[int(m.lastgroup[1:])]
                pieces.append((self._control[spelling], m.end() - m.start()))
                pos = m.end()
            add_text(text[pos:])
        return pieces

    def _encode(self, pieces: list[str | tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids plus (char offset, token index) at the start of each piece."""
        texts = [p for p in pieces if isinstance(p, str)]
        # only a text at the very start of the prompt is the input's start
        head = 1 if pieces and isinstance(pieces[0], str) else 0
        encoded = iter(self.tokenizer.encode_many(texts[:head])
                       + self.tokenizer.encode_many(texts[head:], continued=True))
        ids: list[int] = []
        starts: list[tuple[int, int]] = []
        char = 0
        for p in pieces:
            starts.append((char, len(ids)))
            if isinstance(p, str):
                ids.extend(next(encoded))
                char += len(p)
            else:
                ids.append(p[0])
                char += p[1]
        starts.append((char, len(ids)))
        return ids, starts

    def _prefix_tokens(self, messages, tools, add_generation_prompt, kwargs, full_text: str,
                       pieces: list[str | tuple[int, int]], starts: list[tuple[int, int]]) -> int | None:
        """Token count of a shorter rendering if it is an exact token prefix of the full prompt."""
        try:
            prefix = self._render_plain(messages, tools, add_generation_prompt, kwargs)
        except TemplateError:
            return None
        if not full_text.startswith(prefix):
            return None
        end = len(prefix)
        k = bisect.bisect_right(starts, (end, float("inf"))) - 1
        char, tok = starts[k]
        if char == end:
            return tok
        piece = pieces[k]
        if not isinstance(piece, str):
            return None  # the prefix ends inside a control token's spelling
        # inside a text run: a boundary only if encoding the run's head alone agrees
        head, whole = self.tokenizer.encode_many([piece[:end - char], piece], continued=char > 0)
        return tok + len(head) if whole[:len(head)] == head else None

    def _starts_thinking(self, ids: Sequence[int]) -> bool:
        """Whether the last reasoning marker in the prompt opens a block (client text has none)."""
        if self._think_open is None:
            return False
        for token in reversed(ids):
            if token == self._think_open:
                return True
            if token == self._think_close:
                return False
        return False


# HF's reasoning field names: a message carrying any of them gets all of `reasoning_content` and
# `thinking`, so templates reading either see it.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the content of a message to continue; the prompt is cut where it lands (HF's rule).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _alias_reasoning(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def _tag_final_message(messages: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str):
        raise TemplateError("continue_final_message needs a final message with string content")
    return messages[:-1] + [{**messages[-1], "content": content + _CONTINUE_TAG}]


def _continuation_end(messages: list[Mapping[str, Any]], text: str) -> int:
    """Where the continued message's own text ends: at the tag, or before trimmed spacing."""
    content = messages[-1]["content"][:-len(_CONTINUE_TAG)]
    tag = _CONTINUE_TAG.strip()
    if content.strip() not in text or tag not in text:
        raise TemplateError("the chat template does not render the final message's content "
                            "verbatim, so it cannot be continued")
    at = text.rindex(tag)
    return at if text.startswith(_CONTINUE_TAG, at) else len(text[:at].rstrip())


def _control_pattern(tokenizer: Tokenizer, control: Mapping[str, int]) -> re.Pattern | None:
    """Leftmost-longest match of control spellings, with the whitespace they absorb.

    Alternative i is the group ``t{i}`` of the spellings sorted longest first.
    """
    alternatives = []
    for i, spelling in enumerate(_longest_first(control)):
        lstrip, rstrip = tokenizer.added_token_strips(spelling)
        left, right = (r"\s*" if lstrip else ""), (r"\s*" if rstrip else "")
        alternatives.append(f"(?P<t{i}>{left}{re.escape(spelling)}{right})")
    return re.compile("|".join(alternatives)) if alternatives else None


def _longest_first(control: Mapping[str, int]) -> list[str]:
    return sorted(control, key=len, reverse=True)


def _cut_spans(spans: list[tuple[str, bool]], end: int) -> list[tuple[str, bool]]:
    out, pos = [], 0
    for text, is_client in spans:
        if pos >= end:
            break
        out.append((text[:end - pos], is_client))
        pos += len(text)
    return out


def _wanted_boundaries(count: int, indices: Iterable[int] | None) -> frozenset[int]:
    if indices is None:
        return frozenset(range(max(0, count - DEFAULT_BOUNDARY_MESSAGES), count))
    wanted = frozenset(indices)
    for i in wanted:
        if not (isinstance(i, int) and 0 <= i < count):
            raise ValueError(f"boundary_messages: {i!r} is not a message index (0..{count - 1})")
    return wanted


def early_close_ids(tokenizer: Tokenizer) -> list[int]:
    """Token ids of ``QWEN_THINKING_EARLY_CLOSE``: guidance text, the ``</think>`` id, text."""
    close = tokenizer.added_tokens.get(THINK_CLOSE)
    if close is None:
        raise ValueError(f"the tokenizer has no {THINK_CLOSE} token; a thinking budget needs it")
    before, after = QWEN_THINKING_EARLY_CLOSE.split(THINK_CLOSE)
    return tokenizer.encode(before) + [close] + tokenizer.encode(after)
