"""The GGUF tokenizer rebuild on a tiny byte-level vocabulary (the SmolLM2 golden is in test_gguf_smollm2)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer

from gguf_testing import tiny_tokenizer_metadata
from ninfer.convert.gguf_reader import GGUFError
from ninfer.convert.gguf_tokenizer import PRE_TOKENIZERS, build_tokenizer
from ninfer.text import Tokenizer


def _build(**change):
    md = tiny_tokenizer_metadata()
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"].value
    md.update(change)
    return build_tokenizer({k: v for k, v in md.items() if v is not None or k == "tokenizer.ggml.pre"})


def test_merges_and_added_tokens():
    gt = _build()
    tok = HFTokenizer.from_str(gt.json)
    enc = tok.encode("the then", add_special_tokens=False)
    assert enc.tokens == ["t", "he", "Ġthe", "n"]  # no merge joins t+he; "Ġt"+"he" → "Ġthe"
    added = {t["content"]: t for t in json.loads(gt.json)["added_tokens"]}
    assert added["<|im_start|>"]["special"] is True and added["<|im_start|>"]["id"] == 260
    assert added["<think>"]["special"] is False  # USER_DEFINED: matched whole, not special
    assert tok.encode("a<think>b", add_special_tokens=False).ids == [ord("a"), 262, ord("b")]
    ids = tok.encode("x <|im_end|>\n\ty", add_special_tokens=False).ids
    assert 261 in ids and tok.decode(ids, skip_special_tokens=False) == "x <|im_end|>\n\ty"
    assert tok.decode(ids) == "x \n\ty"  # special tokens are skipped when asked (the default here)


def test_product_tokenizer_encodes_control_spellings_as_text():
    gt = _build()
    record = {"bos_token_id": gt.bos_token_id, "eos_token_ids": gt.eos_token_ids, "pad_token_id": gt.pad_token_id,
              "tokens": {"<|endoftext|>": 259, "<|im_start|>": 260, "<|im_end|>": 261}}
    tok = Tokenizer.from_json(gt.json, record)
    ids = tok.encode("<|im_start|>")
    assert 260 not in ids and len(ids) == len("<|im_start|>")
    assert tok.decode(ids) == "<|im_start|>"
    assert tok.is_special(260) and not tok.is_special(262)


def test_facts_kept_beside_the_json():
    gt = _build(**{"tokenizer.ggml.eot_token_id": 259})
    assert (gt.bos_token_id, gt.eos_token_ids, gt.pad_token_id) == (260, [261, 259], 259)
    assert gt.chat_template.startswith("{% for m in messages %}")
    assert gt.add_bos_token is False and json.loads(gt.json)["post_processor"] is None


def test_add_bos_token_prepends_bos():
    gt = _build(**{"tokenizer.ggml.add_bos_token": True})
    tok = HFTokenizer.from_str(gt.json)
    assert tok.encode("hi").ids == [260, ord("h"), ord("i")]
    assert tok.encode("hi", add_special_tokens=False).ids == [ord("h"), ord("i")]
    both = HFTokenizer.from_str(_build(**{"tokenizer.ggml.add_bos_token": True,
                                          "tokenizer.ggml.add_eos_token": True}).json)
    assert both.encode("hi").ids == [260, ord("h"), ord("i"), 261]
    assert both.encode("a", "b").ids == [260, ord("a"), 261, ord("b")]


@pytest.mark.parametrize("pre,text,pieces", [
    # GPT-2's regex keeps a space with the following digits; SmolLM isolates every digit first.
    ("gpt2", "a   12", ["a", "ĠĠ", "Ġ12"]),
    ("smollm", "a   12", ["a", "ĠĠĠ", "1", "2"]),
    ("llama3", "12345 ok", ["123", "45", "Ġok"]),  # digits in groups of up to three
    ("qwen2", "12345 ok", ["1", "2", "3", "4", "5", "Ġok"]),  # single digits
    ("llama-bpe", "Hello\n\n  world", ["Hello", "ĊĊ", "Ġ", "Ġworld"]),
])
def test_pre_tokenizer_families(pre, text, pieces):
    tok = HFTokenizer.from_str(_build(**{"tokenizer.ggml.pre": pre}).json)
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)] == pieces


def test_llama3_family_looks_up_whole_words_first():
    assert json.loads(_build(**{"tokenizer.ggml.pre": "llama-bpe"}).json)["model"]["ignore_merges"] is True
    assert json.loads(_build().json)["model"]["ignore_merges"] is False


def test_unknown_pre_lists_the_supported_ones():
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre 'mystery' is not supported") as info:
        _build(**{"tokenizer.ggml.pre": "mystery"})
    assert all(name in str(info.value) for name in PRE_TOKENIZERS)
    with pytest.raises(GGUFError, match="tokenizer.ggml.pre None is not supported"):
        _build(**{"tokenizer.ggml.pre": None})


def test_bad_metadata_is_named():
    with pytest.raises(GGUFError, match="SentencePiece|byte-level"):
        _build(**{"tokenizer.ggml.model": "llama"})
    with pytest.raises(GGUFError, match="bos_token_id = 999 is outside the 263-token vocabulary"):
        _build(**{"tokenizer.ggml.bos_token_id": 999})
    with pytest.raises(GGUFError, match="token_type has 2 entries for 263 tokens"):
        _build(**{"tokenizer.ggml.token_type": [1, 1]})
    with pytest.raises(GGUFError, match="lacks 'tokenizer.ggml.merges'"):
        _build(**{"tokenizer.ggml.merges": None})
