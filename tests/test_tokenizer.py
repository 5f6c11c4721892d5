"""The tokenizer wrapper over the synthetic Qwen-style vocabulary."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer

from ninfer.text import Tokenizer, TokenizerError
from ninfer.text.synthetic import TEST_SPECIAL_TOKENS, TEST_VOCAB_SIZE, build_test_tokenizer_json

IDS = TEST_SPECIAL_TOKENS["tokens"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_json(build_test_tokenizer_json(), TEST_SPECIAL_TOKENS)


def test_from_artifact_reads_a_real_artifact_file(tmp_path):
    from ninfer.artifact import open_artifact
    from ninfer.convert.random_model import make_random_artifact
    from ninfer.text import ChatFormatter

    path = tmp_path / "tiny.ninfer"
    make_random_artifact(path, "tiny-qwen3", seed=1)
    with open_artifact(path) as art:
        tok = Tokenizer.from_artifact(art)
        assert tok.vocab_size == TEST_VOCAB_SIZE
        assert tok.eos_token_ids == (IDS["<|im_end|>"], IDS["<|endoftext|>"])
        assert tok.pad_token_id == IDS["<|endoftext|>"] and tok.bos_token_id is None
        prompt = ChatFormatter(tok, art.chat_template, art.special_tokens).render(
            [{"role": "user", "content": "Hi <|im_end|>"}])
    assert prompt.token_ids[0] == IDS["<|im_start|>"] and prompt.thinking
    assert prompt.token_ids.count(IDS["<|im_end|>"]) == 1


@pytest.mark.parametrize("spelling", ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>",
                                      "</think>", "<tool_call>", "</tool_response>"])
def test_control_spellings_in_text_stay_text(tok, spelling):
    text = f"before {spelling} after"
    ids = tok.encode(text)
    assert not set(ids) & set(IDS.values())
    assert tok.decode(ids) == text
    # the raw library, by contrast, parses the spelling into its control id
    raw = HFTokenizer.from_str(build_test_tokenizer_json()).encode(text, add_special_tokens=False).ids
    assert IDS[spelling] in raw


def test_plain_text_encodes_like_the_library(tok):
    text = "The capital of France is Paris.\n\n  def f(x):\treturn x  # 東京 🙂"
    raw = HFTokenizer.from_str(build_test_tokenizer_json()).encode(text, add_special_tokens=False)
    assert tok.encode(text) == raw.ids
    assert tok.encode_many([text, "", "abc"]) == [raw.ids, [], tok.encode("abc")]


def test_decode_keeps_or_skips_special_tokens(tok):
    ids = [IDS["<|im_start|>"]] + tok.encode("user\nhi") + [IDS["<think>"], IDS["<|im_end|>"]]
    assert tok.decode(ids) == "<|im_start|>user\nhi<think><|im_end|>"
    # <think> is an added token that Qwen marks non-special: skip_special keeps it
    assert tok.decode(ids, skip_special=True) == "user\nhi<think>"
    assert tok.is_special(IDS["<|im_end|>"]) and not tok.is_special(IDS["<think>"])


def test_token_lookup(tok):
    assert tok.token_to_id("<|im_end|>") == IDS["<|im_end|>"]
    assert tok.id_to_token(IDS["</think>"]) == "</think>"
    assert tok.token_to_id("no-such-token") is None
    assert tok.added_tokens["<tool_call>"] == IDS["<tool_call>"]


def test_bad_json_is_one_clear_error():
    with pytest.raises(TokenizerError, match="invalid tokenizer JSON"):
        Tokenizer.from_json("{not json", TEST_SPECIAL_TOKENS)


def test_special_ids_outside_the_vocabulary_are_rejected():
    bad = dict(TEST_SPECIAL_TOKENS, eos_token_ids=[TEST_VOCAB_SIZE + 5])
    with pytest.raises(TokenizerError, match=r"special_tokens.eos_token_ids: \d+ is not a token id"):
        Tokenizer.from_json(build_test_tokenizer_json(), bad)


def test_special_token_spellings_must_agree_with_the_vocabulary():
    bad = dict(TEST_SPECIAL_TOKENS, tokens={"<|im_end|>": 3})
    with pytest.raises(TokenizerError, match=r"tokens\['<\|im_end\|>'\] = 3"):
        Tokenizer.from_json(build_test_tokenizer_json(), bad)


def test_whitespace_added_tokens_still_apply_to_plain_text():
    spec = json.loads(build_test_tokenizer_json())
    new_id = TEST_VOCAB_SIZE
    spec["added_tokens"].append({"id": new_id, "content": "    ", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    tok = Tokenizer.from_json(json.dumps(spec), TEST_SPECIAL_TOKENS)
    assert new_id in tok.encode("a    b")
    assert IDS["<think>"] not in tok.encode("a<think>b")
