"""The tokenizer wrapper: one `tokenizers` vocabulary, two encoders.

``encode`` is for text that came from a client (or any other plain text): added tokens such as
``<|im_end|>`` or ``<think>`` are never recognized in it, their spellings become ordinary
byte-level pieces. Only the chat formatter turns template markup into control-token ids, through
``added_tokens``. ``decode`` uses the full vocabulary, so control ids decode to their spellings
unless ``skip_special`` asks to drop the special ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """The tokenizer JSON or its special-token block cannot be used."""


def _plain_spec(spec: dict) -> dict:
    """The same tokenizer without control tokens, so none can be matched in client text.

    Added tokens made only of whitespace carry no control meaning and keep their usual effect on
    plain text.
    """
    plain = dict(spec)
    plain["added_tokens"] = [t for t in spec.get("added_tokens") or []
                             if t["content"] and t["content"].isspace()]
    return plain


def _without_first_prefix(spec: dict) -> dict | None:
    """For a Metaspace pre-tokenizer that prefixes only the start of the input (prepend_scheme
    "first"), the same spec prefixing nothing: text after a control token is not the start.
    None when the tokenizer has no such position-dependent step."""
    found = False

    def patch(node: Any) -> Any:
        nonlocal found
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                found = True
                return {**node, "prepend_scheme": "never"}
            return {k: patch(v) for k, v in node.items()}
        if isinstance(node, list):
            return [patch(v) for v in node]
        return node

    patched = dict(spec, pre_tokenizer=patch(spec.get("pre_tokenizer")))
    return patched if found else None


class Tokenizer:
    """Encode/decode over one vocabulary; see the module docstring for the two encoders."""

    def __init__(self, tokenizer_json: str, special_tokens: Mapping[str, Any]):
        try:
            spec = json.loads(tokenizer_json)
            self._full = _HFTokenizer.from_str(tokenizer_json)
            plain = _plain_spec(spec)
            self._plain = _HFTokenizer.from_str(json.dumps(plain))
            rest = _without_first_prefix(plain)
            self._plain_rest = self._plain if rest is None else _HFTokenizer.from_str(json.dumps(rest))
        except Exception as exc:  # json or tokenizers parse errors: one clear type
            raise TokenizerError(f"invalid tokenizer JSON: {exc}") from exc
        self._added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
        # Whitespace an added token absorbs on its left/right when it is matched (tokenizers flags).
        self._strips = {t["content"]: (bool(t.get("lstrip")), bool(t.get("rstrip")))
                        for t in spec.get("added_tokens") or []}
        for content, i in self._added.items():
            if self._full.token_to_id(content) != i:
                raise TokenizerError(f"added token {content!r} declares id {i} but the tokenizer "
                                     f"assigns {self._full.token_to_id(content)}")
        # The library numbers added tokens itself, so the plain encoder's kept (whitespace) tokens
        # may get other ids than in the full vocabulary: map them back.
        self._plain_remap = {self._plain.token_to_id(c): i for c, i in self._added.items()
                             if self._plain.token_to_id(c) not in (None, i)}
        self._special = {t["id"] for t in spec.get("added_tokens") or [] if t.get("special")}
        self._vocab_size = self._full.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = special_tokens.get("bos_token_id")
        self.pad_token_id = special_tokens.get("pad_token_id")
        self.eos_token_ids = tuple(special_tokens.get("eos_token_ids") or ())
        for name, ids in (("bos_token_id", [self.bos_token_id]), ("pad_token_id", [self.pad_token_id]),
                          ("eos_token_ids", self.eos_token_ids)):
            for i in ids:
                if i is not None and not (isinstance(i, int) and 0 <= i < self._vocab_size):
                    raise TokenizerError(f"special_tokens.{name}: {i!r} is not a token id of this "
                                         f"vocabulary (size {self._vocab_size})")
        for spelling, i in (special_tokens.get("tokens") or {}).items():
            if self._full.token_to_id(spelling) != i:
                raise TokenizerError(f"special_tokens.tokens[{spelling!r}] = {i!r} but the "
                                     f"tokenizer gives {self._full.token_to_id(spelling)!r}")

    @classmethod
    def from_json(cls, tokenizer_json: str, special_tokens: Mapping[str, Any]) -> "Tokenizer":
        return cls(tokenizer_json, special_tokens)

    @classmethod
    def from_artifact(cls, art: Any) -> "Tokenizer":
        return cls(art.tokenizer_json, art.special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def added_tokens(self) -> dict[str, int]:
        """Spelling -> id of every added (control) token; a copy."""
        return dict(self._added)

    def added_token_strips(self, spelling: str) -> tuple[bool, bool]:
        """(lstrip, rstrip) of an added token: whether matching it absorbs adjacent whitespace."""
        return self._strips.get(spelling, (False, False))

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text; control-token spellings in it stay text."""
        return self._remap(self._plain.encode(text, add_special_tokens=False).ids)

    def encode_many(self, texts: Sequence[str], continued: bool = False) -> list[list[int]]:
        """``encode`` for several texts in one call (the tokenizers library batches them).

        ``continued``: the texts follow a control token rather than start the input, which
        matters to SentencePiece-style tokenizers that mark only the input's start.
        """
        if not texts:
            return []
        plain = self._plain_rest if continued else self._plain
        return [self._remap(e.ids) for e in plain.encode_batch(list(texts), add_special_tokens=False)]

    def _remap(self, ids: list[int]) -> list[int]:
        if not self._plain_remap:
            return ids
        return [self._plain_remap.get(i, i) for i in ids]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._full.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._full.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._full.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        """Whether the id is an added token marked special (dropped by ``skip_special``)."""
        return token_id in self._special
