"""Provenance of client text through a chat template.

The rule (spec, Chat Completions): control-token spellings quoted in client strings are encoded as
text; only the template's own literal markup may produce control tokens. Jinja renders everything
into one string, so we track where client text lands:

* every client string enters the template as a ``ClientStr``: a ``str`` subclass whose value is
  the raw text, so comparisons, ``in``, ``startswith``, ``length`` and dict lookups behave exactly
  as with plain strings, and whose string methods (``strip``, ``split``, slicing, ...) return
  ``ClientStr`` again;
* whenever a ``ClientStr`` becomes output or part of a concatenation (``str()``, ``~``, ``+``,
  ``format``), it turns into its raw text between two private sentinels that carry a per-render
  random nonce, with its leading/trailing whitespace kept outside (so a later ``strip`` of the
  concatenation still strips what the real rendering strips);
* anything that rebuilds a string from client text without going through those paths (a filter or
  a method of a template string called with client arguments) is marked client text as a whole.
  That errs towards "text": it can turn template markup into text, never client text into markup.

``split_marked`` turns the marked rendering back into (text, is_client) spans; the caller checks
that the spans joined equal the plain rendering, so a template whose logic saw a marked string
differently fails loudly instead of producing a wrong prompt.
"""

from __future__ import annotations

import contextvars
import re
import secrets
from collections.abc import Mapping
from typing import Any


class Marks:
    """The sentinel pair of one render: private-use characters around a random nonce."""

    def __init__(self) -> None:
        self.nonce = nonce = secrets.token_hex(8)
        self.open = f"\ue000{nonce}\ue001"
        self.close = f"\ue002{nonce}\ue003"
        self.pattern = re.compile(f"({re.escape(self.open)}|{re.escape(self.close)})")

    def wrap(self, raw: str) -> str:
        core = raw.strip()
        if not core:
            return raw  # whitespace only: nothing that could spell a control token
        start = raw.index(core[0])
        end = start + len(core)
        return f"{raw[:start]}{self.open}{core}{self.close}{raw[end:]}"

    def contains(self, text: str) -> bool:
        return self.pattern.search(text) is not None


# The marks of the marked render in progress (None during a plain render). A context variable,
# so that renders on different threads or tasks never see each other's marks.
CURRENT_MARKS: contextvars.ContextVar[Marks | None] = contextvars.ContextVar("ninfer_marks",
                                                                            default=None)


def rewrap(value: Any, marks: Marks) -> Any:
    """Results of a client string's method stay client text."""
    if type(value) is str:
        return ClientStr(value, marks)
    if isinstance(value, list):
        return [rewrap(v, marks) for v in value]
    if isinstance(value, tuple):
        return tuple(rewrap(v, marks) for v in value)
    return value


class ClientStr(str):
    """A client string inside the template: behaves as its raw value, renders marked."""

    _marks: Marks

    @property
    def marks(self) -> Marks:
        return self._marks

    def __new__(cls, value: str, marks: Marks | None = None) -> "ClientStr":
        # Jinja's sandbox rebuilds format results as type(s)(text): take the render's marks.
        marks = marks if marks is not None else CURRENT_MARKS.get()
        if marks is None:
            raise RuntimeError("a client string was created outside a marked render")
        obj = super().__new__(cls, value)
        obj._marks = marks
        return obj

    def __str__(self) -> str:
        return self._marks.wrap(str.__str__(self))

    def __format__(self, spec: str) -> str:
        return self._marks.wrap(str.__format__(str.__str__(self), spec))

    def __add__(self, other: object) -> str:
        if not isinstance(other, str):
            return NotImplemented
        return str(self) + str(other)

    def __radd__(self, other: object) -> str:
        if not isinstance(other, str):
            return NotImplemented
        return str(other) + str(self)

    def __getitem__(self, key: Any) -> "ClientStr":
        return ClientStr(str.__getitem__(self, key), self._marks)

    def __iter__(self):
        return (ClientStr(ch, self._marks) for ch in str.__str__(self))

    def __mul__(self, n: Any) -> "ClientStr":
        return ClientStr(str.__mul__(self, n), self._marks)

    __rmul__ = __mul__

    def __mod__(self, args: Any) -> "ClientStr":
        return ClientStr(str.__mod__(self, args), self._marks)

    def __reduce__(self):  # never pickled or copied with the marks lost
        raise TypeError("ClientStr cannot be pickled")


def _method(name: str):
    base = getattr(str, name)

    def method(self: ClientStr, *args: Any, **kwargs: Any) -> Any:
        return rewrap(base(str.__str__(self), *args, **kwargs), self._marks)

    method.__name__ = name
    return method


for _name in ("capitalize", "casefold", "center", "expandtabs", "format", "format_map", "join",
              "ljust", "lower", "lstrip", "partition", "removeprefix", "removesuffix", "replace",
              "rjust", "rpartition", "rsplit", "rstrip", "split", "splitlines", "strip",
              "swapcase", "title", "translate", "upper", "zfill"):
    setattr(ClientStr, _name, _method(_name))


def mark_client(value: Any, marks: Marks) -> Any:
    """Deep-copy JSON-like client data with every string (keys too) as a ``ClientStr``."""
    if isinstance(value, str):
        return ClientStr(value, marks)
    if isinstance(value, Mapping):
        return {mark_client(k, marks): mark_client(v, marks) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_client(v, marks) for v in value]
    return value


def carries_client_text(value: Any, marks: Marks) -> bool:
    """Whether an argument holds client text, raw or already marked."""
    if isinstance(value, ClientStr):
        return True
    if isinstance(value, str):
        return marks.contains(value)
    if isinstance(value, Mapping):
        return any(carries_client_text(k, marks) or carries_client_text(v, marks)
                   for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(carries_client_text(v, marks) for v in value)
    return False


def taint_result(result: Any, args: tuple, kwargs: dict, marks: Marks) -> Any:
    """A string computed from client arguments by code that does not track marks is client text.

    A result that already carries marks was built through ``str()`` of client strings and keeps
    its precise spans.
    """
    if type(result) is not str or marks.contains(result):
        return result
    if any(carries_client_text(a, marks) for a in args) or any(
            carries_client_text(v, marks) for v in kwargs.values()):
        return ClientStr(result, marks)
    return result


class UnbalancedMarks(ValueError):
    """The template cut through a client string's markers."""


def split_marked(text: str, marks: Marks) -> list[tuple[str, bool]]:
    """Split a marked rendering into (text, is_client) spans, dropping the markers."""
    spans: list[tuple[str, bool]] = []
    depth = 0
    for i, piece in enumerate(marks.pattern.split(text)):
        if i % 2:  # a marker
            depth += 1 if piece == marks.open else -1
            if depth < 0:
                raise UnbalancedMarks("a client-text end marker without its start")
        elif piece:
            spans.append((piece, depth > 0))
    if depth:
        raise UnbalancedMarks("a client-text start marker without its end")
    return spans
