"""Time OutputDecoder per committed token on the synthetic tokenizer (docs/text.md, Output decoding).

Feeds one long output (reasoning, answer, a tool call with a large string value) one token at a
time, as the server does, and prints microseconds per token next to a full re-decode of the output,
the cost an approach that re-decodes everything per token would pay.

Usage: python tools/bench_output_decoder.py
"""

import time

from ninfer.text import Tokenizer
from ninfer.text.detokenizer import IncrementalDetokenizer
from ninfer.text.output import OutputDecoder
from ninfer.text.synthetic import TEST_SPECIAL_TOKENS, build_test_tokenizer_json

TOOL = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}


def model_output(tok: Tokenizer) -> list[int]:
    body = "Let me think about the weather in 東京 🙂 and compute 3.14159 * 2. " * 200
    call = ("<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
            "<parameter=content>\n" + "x = [i for i in range(10)]  # <b>\n" * 100
            + "\n</parameter>\n</function>\n</tool_call>")
    marker = tok.added_tokens
    return (tok.encode(body) + [marker["</think>"]] + tok.encode("\n\n" + body)
            + [marker["<tool_call>"]] + tok.encode(call[len("<tool_call>"):-len("</tool_call>")])
            + [marker["</tool_call>"], marker["<|im_end|>"]])


def best_of(reps: int, fn) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    tok = Tokenizer.from_json(build_test_tokenizer_json(), TEST_SPECIAL_TOKENS)
    ids = model_output(tok)

    def decoder(**options) -> None:
        dec = OutputDecoder(tok, **options)
        for i in ids:
            dec.push([i])
        dec.finish()

    def detokenizer() -> None:
        detok = IncrementalDetokenizer(lambda window: tok.decode(window, skip_special=True))
        for i in ids:
            detok.push([i])
        detok.flush()

    runs = {
        "detokenizer only": detokenizer,
        "decoder, no options": lambda: decoder(),
        "decoder, thinking+tools+2 stops": lambda: decoder(starts_in_thinking=True, tools=[TOOL],
                                                          stops=["STOP", "\nUser:"]),
    }
    print(f"output tokens: {len(ids)}")
    for name, fn in runs.items():
        print(f"{name:34s} {best_of(3, fn) / len(ids) * 1e6:6.1f} us/token")
    full = best_of(3, lambda: tok.decode(ids, skip_special=True))
    print(f"{'one full decode of the output':34s} {full * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
