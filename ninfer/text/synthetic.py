"""A small, deterministic Qwen-style tokenizer for tests and random artifacts.

Tests across the project need a real tokenizer with the Qwen control tokens but cannot download
one. ``build_test_tokenizer_json()`` builds a byte-level BPE tokenizer in the same shape as Qwen's
(NFC normalizer, Qwen's split regex, byte-level alphabet, byte-level decoder, added control tokens)
with merges learned by our own tiny BPE loop over a built-in corpus. The loop breaks ties by the
pair's spelling, so the result is identical on every run and machine; the vocabulary has exactly
``TEST_VOCAB_SIZE`` entries.
"""

from __future__ import annotations

import collections
import functools
import json
from importlib import resources

from tokenizers import Tokenizer, pre_tokenizers, Regex

TEST_VOCAB_SIZE = 1024

# Qwen2/3 pre-tokenizer split pattern (a format fact: it decides which bytes may merge).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (spelling, special) in id order after the BPE vocabulary. Qwen marks the three ChatML tokens
# and the vision markers special; the reasoning and tool markers are ordinary added tokens that
# still encode as single ids.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Text the merges are learned from: prose, chat, code, JSON, tool markup words, digits, CJK and
# emoji, so that every kind of test input tokenizes into a realistic mix of merged pieces.
_CORPUS = """
The capital of France is Paris. The capital of Germany is Berlin. What is the weather like today?
You are a helpful assistant. Answer the question concisely and think step by step before answering.
Hello! How can I help you today? I would like to know more about speculative decoding and caching.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
Please summarize the following document in three sentences, and then list the main points.
Let me think about this problem. First, we compute the sum; then we check the result again.
The user asked for the current time in Tokyo, so I should call the get_time function.
Considering the limited time, I have to give the solution based on the thinking directly now.
Prefix caching keeps the key and value pages of earlier prompts, so a follow-up request that shares
the same beginning skips that part of the prefill. Streaming responses send each new piece of text as
soon as it is decoded; the server holds back a few characters when they might start a stop string.
Reference implementations run on the CPU with NumPy, while the production backend launches kernels on
the GPU. Tokens per second, memory bandwidth, batch size, context length, temperature, top_p, seed.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June July
August September October November December morning afternoon evening night yesterday tomorrow.
import json
import numpy as np
from typing import Any, Optional
async def handle(request: dict[str, Any]) -> Optional[str]:
    data = json.loads(request["body"])
    while True:
        try:
            value = await queue.get()
        except KeyError as error:
            raise ValueError("missing field") from error
        else:
            yield value
SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY name;
<html><body><div class="note">Hello &amp; welcome</div></body></html>
system user assistant tool developer function parameter parameters properties required type
string number integer boolean object array description name arguments content reasoning result
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Engine:
    def __init__(self, config):
        self.config = config
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        return len(self.requests)

for i in range(10):
    print(f"step {i}: {i * i}")

{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
 "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
 "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
{"name": "search", "arguments": {"query": "latest news", "limit": 5, "safe": true, "tags": null}}
<function=get_weather>
<parameter=city>
Paris
</parameter>
</function>
0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2026 3.14159 -17 1e-5 0x1F
东京的天气怎么样？今天是晴天。我们明天见。こんにちは、世界。안녕하세요.
Emoji: 🙂 🚀 ✅ 🎉 — “quotes” and ‘apostrophes’ … naïve café résumé.
    indented line
\t\ttabbed line
multiple   spaces   here

blank lines above and below

"""


def byte_alphabet() -> list[str]:
    """The byte-level alphabet indexed by byte value (the GPT-2 byte-to-unicode table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(
        range(0xAE, 0xFF + 1))
    table = {}
    extra = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def _learn_merges(corpus: str, num_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE: repeatedly merge the most frequent adjacent pair (ties: smallest spelling)."""
    words = collections.Counter(piece for piece, _ in _pre_tokenizer().pre_tokenize_str(corpus))
    seqs = {word: list(word) for word in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: collections.Counter = collections.Counter()
        for word, count in words.items():
            seq = seqs[word]
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += count
        if not pairs:
            raise RuntimeError(f"corpus exhausted after {len(merges)} merges")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        for word, seq in seqs.items():
            if len(seq) < 2:
                continue
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == best[0] and seq[i + 1] == best[1]:
                    out.append(joined)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[word] = out
    return merges


@functools.lru_cache(maxsize=1)
def build_test_tokenizer_json() -> str:
    """The test tokenizer as a `tokenizers` JSON string (deterministic, cached per process)."""
    alphabet = byte_alphabet()
    num_merges = TEST_VOCAB_SIZE - len(alphabet) - len(ADDED_TOKENS)
    merges = _learn_merges(_CORPUS, num_merges)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    if len(vocab) != len(alphabet) + num_merges:
        raise RuntimeError("duplicate merge results in the synthetic vocabulary")
    added = [
        {"id": len(vocab) + i, "content": text, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": special}
        for i, (text, special) in enumerate(ADDED_TOKENS)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": json.loads(_pre_tokenizer().__getstate__()),
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }
    text = json.dumps(spec, ensure_ascii=False)
    Tokenizer.from_str(text)  # fail here, not in a caller, if the spec is malformed
    return text


def _token_ids() -> dict[str, int]:
    base = TEST_VOCAB_SIZE - len(ADDED_TOKENS)
    return {text: base + i for i, (text, _) in enumerate(ADDED_TOKENS)}


# The artifact's special_tokens block for the test tokenizer (docs/internals.md, Artifact).
TEST_SPECIAL_TOKENS: dict = {
    "bos_token_id": None,
    "eos_token_ids": [_token_ids()["<|im_end|>"], _token_ids()["<|endoftext|>"]],
    "pad_token_id": _token_ids()["<|endoftext|>"],
    "tokens": _token_ids(),
}

# Our Qwen3-format chat template (ninfer/text/templates/qwen3.jinja).
QWEN3_TEMPLATE: str = resources.files("ninfer.text").joinpath("templates/qwen3.jinja").read_text(
    encoding="utf-8")
