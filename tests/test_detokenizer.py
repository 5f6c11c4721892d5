"""IncrementalDetokenizer against real `tokenizers` decoders: byte-level BPE and SentencePiece style."""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import example, given, settings, strategies as st
from tokenizers import Tokenizer

from ninfer.text.detokenizer import MAX_DIRTY_WINDOW, TRIM_AT, IncrementalDetokenizer
from ninfer.text.synthetic import build_test_tokenizer_json

BYTE_LEVEL = Tokenizer.from_str(build_test_tokenizer_json())


def _decode(ids: list[int]) -> str:
    return BYTE_LEVEL.decode(ids, skip_special_tokens=True)


def _encode(text: str) -> list[int]:
    return BYTE_LEVEL.encode(text, add_special_tokens=False).ids


def _byte_id(byte: int) -> int:
    """The id of one raw byte: the synthetic vocabulary starts with the 256 byte symbols in order."""
    assert _decode([byte]) == bytes([byte]).decode("utf-8", "replace")
    return byte


def _stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    pieces, start = [], 0
    for cut in sorted(set(cuts)) + [len(ids)]:
        pieces.append(detok.push(ids[start:cut]))
        start = cut
    pieces.append(detok.flush())
    return pieces


def _texts(pieces: list[str], max_size: int) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(pieces), max_size=max_size).map("".join)


TEXT = _texts(list("ab é€🚀東京\n\t<>/") + ["🙂", "a\u0301", "🇫🇷", " the", "\u200d", "\ufffd"], 60)


@settings(max_examples=150, deadline=None)
@given(TEXT, st.lists(st.integers(min_value=0, max_value=80), max_size=12))
def test_byte_level_concatenation_equals_full_decode_for_any_split(text, cuts):
    ids = _encode(text)
    pieces = _stream(IncrementalDetokenizer(_decode), ids, [c for c in cuts if c <= len(ids)])
    assert "".join(pieces) == _decode(ids) == unicodedata.normalize("NFC", text)
    # U+FFFD appears only where the model wrote one, never for half a character.
    assert sum(p.count("\ufffd") for p in pieces) == text.count("\ufffd")


def test_multibyte_character_is_emitted_once_complete():
    ids = _encode("🚀")
    assert len(ids) > 1, "the test needs an emoji split over several byte tokens"
    detok = IncrementalDetokenizer(_decode)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🚀"]
    assert detok.flush() == ""


def test_incomplete_character_at_the_end_flushes_as_replacement():
    ids = _encode("ok🚀")[:-1]
    detok = IncrementalDetokenizer(_decode)
    assert "".join(detok.push([i]) for i in ids) == "ok"
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_invalid_byte_shows_once_a_later_character_proves_it():
    stray = _byte_id(0x80)  # a continuation byte with no lead byte
    detok = IncrementalDetokenizer(_decode)
    assert detok.push(_encode("a")) == "a"
    assert detok.push([stray]) == ""
    assert detok.push(_encode("b")) == "\ufffdb"


def test_window_stays_bounded_on_long_output():
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return _decode(ids)

    text = "The quick brown fox jumps over the lazy dog. 東京🚀 " * 40
    ids = _encode(text)
    detok = IncrementalDetokenizer(decode)
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == text
    # The window is cut once it reaches TRIM_AT ids with clean text; a character in progress
    # (at most 4 byte tokens) can delay the cut by three ids.
    assert max(seen) <= TRIM_AT + 3
    assert len(seen) < 1.2 * len(ids)  # about one decode per token, not one per window size


def test_stream_of_invalid_bytes_does_not_grow_the_window_forever():
    lead = _byte_id(0xE2)  # a lead byte, then ASCII: each lead byte is invalid
    ids = [lead, _encode("x")[0]] * 100 + [lead]
    seen: list[int] = []

    def decode(window: list[int]) -> str:
        seen.append(len(window))
        return _decode(window)

    detok = IncrementalDetokenizer(decode)
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == _decode(ids) == "\ufffdx" * 100 + "\ufffd"
    assert max(seen) <= MAX_DIRTY_WINDOW


def test_special_tokens_skipped_by_the_decoder_emit_nothing():
    im_end = BYTE_LEVEL.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(_decode)
    assert detok.push(_encode("done")) == "done"
    assert detok.push([im_end]) == ""
    assert detok.flush() == ""


# -- a SentencePiece-style tokenizer: Metaspace pieces, byte fallback, leading-space strip -------

def _sentencepiece_tokenizer() -> Tokenizer:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["<unk>", *byte_tokens, "▁", *"abcdehlortw", "▁t", "▁th", "▁the", "he", "ll", "llo",
              "▁he", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [["▁", "t"], ["▁t", "h"], ["▁th", "e"], ["h", "e"], ["l", "l"], ["ll", "o"],
              ["▁", "he"], ["▁he", "llo"], ["▁", "w"], ["o", "r"], ["▁w", "or"], ["l", "d"],
              ["▁wor", "ld"]]
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                  "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": merges},
    }
    return Tokenizer.from_str(json.dumps(spec))


SENTENCEPIECE = _sentencepiece_tokenizer()


@settings(max_examples=100, deadline=None)
@given(_texts(["the", " hello", " world", " ", "a", "é", "🚀", "東"], 40),
       st.lists(st.integers(min_value=0, max_value=120), max_size=10))
# A window cut inside a byte-fallback character once turned the whole next byte run into U+FFFD.
@example(text=" hello🚀thethe🚀東東é", cuts=[20])
def test_sentencepiece_spaces_and_byte_fallback_survive_any_split(text, cuts):
    ids = SENTENCEPIECE.encode(text, add_special_tokens=False).ids
    pieces = _stream(IncrementalDetokenizer(SENTENCEPIECE.decode), ids,
                     [c for c in cuts if c <= len(ids)])
    assert "".join(pieces) == SENTENCEPIECE.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_sentencepiece_one_token_at_a_time_keeps_word_spaces():
    text = " hello world the world " * 5 + "🚀"
    ids = SENTENCEPIECE.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(SENTENCEPIECE.decode)
    out = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(out) == SENTENCEPIECE.decode(ids)
    assert " world" in out  # a word token alone decodes without its space; in context it keeps it


@pytest.mark.parametrize("text", ["", "a", "🚀🚀🚀"])
def test_push_of_no_ids_returns_nothing(text):
    detok = IncrementalDetokenizer(_decode)
    detok.push(_encode(text))
    assert detok.push([]) == ""
