"""Rebuild a GGUF file's byte-level BPE vocabulary as a Hugging Face `tokenizers` JSON.

A GGUF stores no tokenizer.json, only llama.cpp's pieces of one: the tokens (already spelled in the
GPT-2 byte alphabet, "Ġ" for a space), the merges ("Ġ t"), a type per token, and a
``tokenizer.ggml.pre`` name that says how text is split into words before BPE. This module puts
those pieces back together so the rebuilt tokenizer encodes and decodes exactly like the original
(tests/test_gguf_smollm2.py checks SmolLM2's against ids llama.cpp gives; tests/test_gguf_tokenizer.py
checks a tiny vocabulary).

Only ``tokenizer.ggml.model == "gpt2"`` exists here; SentencePiece vocabularies ("llama") and
unknown pre-tokenizer names are refused with an error that lists what is supported.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from ninfer.convert.fields import Fields
from ninfer.convert.gguf_reader import GGUFError

# llama.cpp token types (llama_token_type): only CONTROL and USER_DEFINED change tokenization.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The split regexes of the model families, as their original tokenizer.json files spell them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split_then_bytes(pattern: str) -> dict[str, Any]:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        _byte_level(use_regex=False)]}


# tokenizer.ggml.pre → (pre_tokenizer JSON, BPE ignore_merges). GPT-2's own word regex is what
# ByteLevel(use_regex=True) applies; the StarCoder/SmolLM family first isolates every digit
# (llama.cpp: "\p{N}" before the GPT-2 regex; tokenizer.json: Digits(individual_digits)).
# Llama 3 looks whole words up in the vocabulary before merging (ignore_merges), like its original.
_DIGITS_THEN_GPT2 = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True}, _byte_level(use_regex=True)]}
PRE_TOKENIZERS: dict[str, tuple[dict[str, Any], bool]] = {
    "gpt2": (_byte_level(use_regex=True), False),
    "smollm": (_DIGITS_THEN_GPT2, False),
    "starcoder": (_DIGITS_THEN_GPT2, False),
    "llama3": (_split_then_bytes(_LLAMA3_SPLIT), True),
    "llama-v3": (_split_then_bytes(_LLAMA3_SPLIT), True),
    "llama-bpe": (_split_then_bytes(_LLAMA3_SPLIT), True),
    "qwen2": (_split_then_bytes(_QWEN2_SPLIT), False),
    "deepseek-r1-qwen": (_split_then_bytes(_QWEN2_SPLIT), False),
}


@attrs.frozen
class GGUFTokenizer:
    """The rebuilt tokenizer JSON plus the facts the artifact keeps beside it."""

    json: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool


def _token_id(metadata: Fields, key: str, vocab_size: int) -> int | None:
    value = metadata.integer(f"tokenizer.ggml.{key}", None, minimum=0)
    if value is not None and value >= vocab_size:
        raise metadata.fail(f"tokenizer.ggml.{key}", f"= {value} is outside the {vocab_size}-token vocabulary")
    return value


def _added_tokens(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    """CONTROL tokens become special added tokens (matched whole, skipped by decode(skip_special));
    USER_DEFINED ones become plain added tokens (matched whole, like llama.cpp does)."""
    added = []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, USER_DEFINED):
            added.append({"id": index, "content": token, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": kind == CONTROL})
    return added


def _post_processor(tokens: list[str], bos: int | None, eos: int | None,
                    add_bos: bool, add_eos: bool) -> dict[str, Any] | None:
    """Where the GGUF asks for BOS/EOS around every encoding, say so in the tokenizer itself
    (a pair of sequences, which llama.cpp has no notion of, just appends the second one)."""
    before = [bos] if add_bos and bos is not None else []
    after = [eos] if add_eos and eos is not None else []
    if not before and not after:
        return None

    def special(i: int) -> dict[str, Any]:
        return {"SpecialToken": {"id": tokens[i], "type_id": 0}}

    single = [*map(special, before), {"Sequence": {"id": "A", "type_id": 0}}, *map(special, after)]
    return {"type": "TemplateProcessing", "single": single,
            "pair": [*single, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]}
                               for i in before + after}}


def build_tokenizer(metadata: dict[str, Any], where: str = "GGUF metadata") -> GGUFTokenizer:
    """Rebuild the tokenizer a GGUF file's metadata describes; errors name ``where`` (the file)."""
    md = Fields(metadata, where, error=GGUFError)
    model = md.string("tokenizer.ggml.model")
    if model != "gpt2":
        raise md.fail("tokenizer.ggml.model", f"{model!r} is not supported: NInfer rebuilds only byte-level "
                                              f"BPE vocabularies (\"gpt2\")")
    pre = md.string("tokenizer.ggml.pre", None)
    if pre not in PRE_TOKENIZERS:
        raise md.fail("tokenizer.ggml.pre", f"{pre!r} is not supported (supported: "
                      f"{', '.join(sorted(PRE_TOKENIZERS))}); its word-splitting rule is unknown to NInfer")
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    tokens: list[str] = md.strings("tokenizer.ggml.tokens")
    types: list[int] = md.integers("tokenizer.ggml.token_type", None) or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise md.fail("tokenizer.ggml.token_type", f"has {len(types)} entries for {len(tokens)} tokens")
    merges = [m.split(" ") for m in md.strings("tokenizer.ggml.merges")]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise md.fail("tokenizer.ggml.merges", f"holds {' '.join(bad)!r}, not two tokens")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)  # a duplicated spelling keeps its first id, as llama.cpp does
    bos = _token_id(md, "bos_token_id", len(tokens))
    eos = _token_id(md, "eos_token_id", len(tokens))
    eot = _token_id(md, "eot_token_id", len(tokens))
    add_bos = md.boolean("tokenizer.ggml.add_bos_token", False)
    add_eos = md.boolean("tokenizer.ggml.add_eos_token", False)
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, types),
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": _post_processor(tokens, bos, eos, add_bos, add_eos),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges},
    }
    return GGUFTokenizer(
        json=json.dumps(data, ensure_ascii=False),
        chat_template=md.string("tokenizer.chat_template", None),
        bos_token_id=bos,
        eos_token_ids=list(dict.fromkeys(i for i in (eos, eot) if i is not None)),
        pad_token_id=_token_id(md, "padding_token_id", len(tokens)),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
    )
