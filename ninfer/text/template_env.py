"""The Jinja environment chat templates run in: Hugging Face's, with client-text tracking.

Hugging Face renders templates in ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` with the loop-controls extension, a ``{% generation %}`` tag, the globals
``raise_exception`` and ``strftime_now`` and its own ``tojson``. We do the same, and during a
marked render (``client_text.CURRENT_MARKS`` set) the calls and filters that rebuild strings keep
track of client text (see ``client_text``).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer.text import client_text
from ninfer.text.client_text import ClientStr, Marks

_MARKS = client_text.CURRENT_MARKS


class TemplateError(Exception):
    """The chat template cannot render this conversation; the message says why."""


def _raise_exception(message: Any) -> None:
    raise TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """HF's ``{% generation %}`` marks assistant text for training masks; here it only renders."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False,
            marks: Marks | None = None) -> str:
    """HF ``tojson``: plain ``json.dumps`` (non-ASCII kept, member order kept, no HTML escaping).

    Client strings keep their marks: each is swapped for a placeholder before dumping and the
    placeholder replaced by the marked, JSON-escaped text afterwards.
    """
    found: list[str] = []
    tag = marks.nonce if marks is not None else ""

    def swap(v: Any) -> Any:
        if isinstance(v, ClientStr):
            found.append(str.__str__(v))
            return f"\ue010{tag}:{len(found) - 1}\ue011"
        if isinstance(v, Mapping):
            items = sorted(v.items(), key=lambda kv: str.__str__(kv[0])) if sort_keys else v.items()
            return {swap(k): swap(x) for k, x in items}
        if isinstance(v, (list, tuple)):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value), ensure_ascii=ensure_ascii, indent=indent, separators=separators)
    if not found:
        return text
    assert marks is not None

    def unswap(m: re.Match) -> str:
        escaped = json.dumps(found[int(m.group(1))], ensure_ascii=ensure_ascii)[1:-1]
        return f"{marks.open}{escaped}{marks.close}" if escaped else ""

    # the placeholder as json.dumps wrote it (escaped when ensure_ascii)
    left, right = (json.dumps(c, ensure_ascii=ensure_ascii)[1:-1] for c in ("\ue010", "\ue011"))
    return re.sub(f"{re.escape(left)}{tag}:(\\d+){re.escape(right)}", unswap, text)


_MARKS = client_text.CURRENT_MARKS


class _Env(ImmutableSandboxedEnvironment):
    """The sandbox, plus provenance tracking for Python calls while a marked render runs."""

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        result = super().call(__context, __obj, *args, **kwargs)
        marks = _MARKS.get()
        # Macros are template code whose output is tracked precisely.
        if marks is None or isinstance(__obj, jinja2.runtime.Macro):
            return result
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, ClientStr):
            # a client string's method (the sandbox runs str.format itself): its result is client text
            return client_text.rewrap(result, owner.marks)
        return client_text.taint_result(result, args, kwargs, marks)


def _tracked_filter(fn):
    passes_context = hasattr(fn, "jinja_pass_arg")

    def filt(*args, **kwargs):
        result = fn(*args, **kwargs)
        marks = _MARKS.get()
        if marks is None:
            return result
        # A context/environment first argument holds the whole template state, not an input.
        inputs = args[1:] if passes_context else args
        return client_text.taint_result(result, inputs, kwargs, marks)

    if passes_context:
        filt.jinja_pass_arg = fn.jinja_pass_arg
    return filt


def make_environment() -> _Env:
    """A fresh sandbox with HF's settings, globals and filters, tracking client text."""
    env = _Env(trim_blocks=True, lstrip_blocks=True,
               extensions=[jinja2.ext.loopcontrols, _GenerationTag])

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return _tojson(value, ensure_ascii, indent, separators, sort_keys, _MARKS.get())

    def join(value, d="", attribute=None):
        items = list(value) if attribute is None else [env.getattr(v, attribute) for v in value]
        return str(d).join(str(v) for v in items)  # str() keeps each client item's marks

    for name, fn in list(env.filters.items()):
        env.filters[name] = _tracked_filter(fn)
    env.filters["tojson"] = tojson
    env.filters["join"] = join
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
