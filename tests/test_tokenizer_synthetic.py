"""The synthetic Qwen-style test tokenizer: shape, control tokens and determinism."""

import hashlib
import json
import os
import subprocess
import sys

from tokenizers import Tokenizer as HFTokenizer

from ninfer.text.synthetic import (ADDED_TOKENS, QWEN3_TEMPLATE, TEST_SPECIAL_TOKENS,
                                   TEST_VOCAB_SIZE, build_test_tokenizer_json)

# Other engineers' tests build random artifacts on this tokenizer: a change to its vocabulary is a
# change to their fixtures, so it must be deliberate (update this digest in the same commit).
VOCAB_DIGEST = "8293277b4d6d4b3446483a4230b3efd2e5920af2ea9c1d150d06890d0ffa84ae"


def _vocab_digest(tokenizer_json: str) -> str:
    spec = json.loads(tokenizer_json)
    payload = [spec["model"]["vocab"], spec["model"]["merges"], spec["added_tokens"]]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def test_vocabulary_is_pinned():
    assert _vocab_digest(build_test_tokenizer_json()) == VOCAB_DIGEST


def test_same_json_in_a_fresh_process_with_another_hash_seed():
    code = ("from ninfer.text.synthetic import build_test_tokenizer_json as b; "
            "import sys; sys.stdout.write(b())")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out == build_test_tokenizer_json()


def test_size_and_control_tokens_are_single_ids():
    tok = HFTokenizer.from_str(build_test_tokenizer_json())
    assert tok.get_vocab_size() == TEST_VOCAB_SIZE
    for spelling, special in ADDED_TOKENS:
        token_id = TEST_SPECIAL_TOKENS["tokens"][spelling]
        assert tok.token_to_id(spelling) == token_id
        assert tok.encode(f"a{spelling}b", add_special_tokens=False).ids.count(token_id) == 1
    added = {t["content"]: t["special"] for t in json.loads(build_test_tokenizer_json())["added_tokens"]}
    assert added["<|im_end|>"] is True and added["<think>"] is False and added["<tool_call>"] is False


def test_special_tokens_block_matches_qwen_conventions():
    ids = TEST_SPECIAL_TOKENS["tokens"]
    assert TEST_SPECIAL_TOKENS["bos_token_id"] is None
    assert TEST_SPECIAL_TOKENS["eos_token_ids"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert TEST_SPECIAL_TOKENS["pad_token_id"] == ids["<|endoftext|>"]


def test_byte_level_round_trip_and_merges_are_used():
    tok = HFTokenizer.from_str(build_test_tokenizer_json())
    text = "The capital of France is Paris.\n\tdef f(x):  return x ** 2  # 東京 🙂 naïve\r\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(ids) < len(text.encode()) * 0.7  # real merges, not one token per byte


def test_template_source_is_the_packaged_qwen3_template():
    assert "<|im_start|>" in QWEN3_TEMPLATE and "<tool_response>" in QWEN3_TEMPLATE
