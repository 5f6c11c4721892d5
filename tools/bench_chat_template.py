"""Time ChatFormatter.render on the synthetic tokenizer and our Qwen3 template (docs/text.md).

Usage: python tools/bench_chat_template.py
"""

import time

from ninfer.text import ChatFormatter, Tokenizer
from ninfer.text.synthetic import QWEN3_TEMPLATE, TEST_SPECIAL_TOKENS, build_test_tokenizer_json


def conversation(turns: int, body: str) -> list[dict]:
    msgs = [{"role": "system", "content": body}]
    for _ in range(turns):
        msgs.append({"role": "user", "content": body})
        msgs.append({"role": "assistant", "content": body, "reasoning_content": body})
    msgs.append({"role": "user", "content": body})
    return msgs


def main() -> None:
    tok = Tokenizer.from_json(build_test_tokenizer_json(), TEST_SPECIAL_TOKENS)
    fmt = ChatFormatter(tok, QWEN3_TEMPLATE, TEST_SPECIAL_TOKENS)
    body = "The capital of France is Paris. " * 8  # ~250 characters
    tools = [{"type": "function", "function": {
        "name": f"f{i}", "description": body,
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
        for i in range(8)]
    for turns in (1, 10, 50, 100):
        msgs = conversation(turns, body)
        fmt.render(msgs, tools=tools)  # warm-up
        reps = 5
        start = time.perf_counter()
        for _ in range(reps):
            prompt = fmt.render(msgs, tools=tools)
        ms = (time.perf_counter() - start) / reps * 1e3
        print(f"messages={len(msgs):4d} prompt_tokens={len(prompt.token_ids):6d} render_ms={ms:7.1f}")


if __name__ == "__main__":
    main()
