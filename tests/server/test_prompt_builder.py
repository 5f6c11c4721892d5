"""PromptBuilder: cache hints map to exact token frontiers or are dropped; the prompt never changes."""

from __future__ import annotations

import pytest

from ninfer.artifact import open_artifact
from ninfer.server.prompt import PromptBuilder, ServeDefaults
from ninfer.text import ChatFormatter, Tokenizer
from protocols.openai_chat import parse_request


@pytest.fixture(scope="module")
def builder(tiny_artifact):
    art = open_artifact(tiny_artifact)
    tok = Tokenizer.from_artifact(art)
    return PromptBuilder(tok, ChatFormatter(tok, art.chat_template, art.special_tokens), ServeDefaults())


def prepare(builder, parts, **extra):
    content = [{"type": "text", "text": t, **({"prompt_cache_breakpoint": {"mode": "explicit"}} if bp else {})}
               for t, bp in parts]
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return builder.prepare(parse_request(body, "m").conversation)


def test_boundaries_are_exact_frontiers(builder):
    tok = builder.tokenizer
    parts = [("Paris is big.", True), (" Berlin too. 東京 🙂", True), (" The end.", False)]
    p = prepare(builder, parts, prompt_cache_options={"mode": "explicit"})
    plain = prepare(builder, [(t, False) for t, _ in parts], prompt_cache_options={"mode": "explicit"})
    assert p.token_ids == plain.token_ids  # hints never change the prompt
    assert len(p.cache_boundaries) == 2
    for k, upto in zip(p.cache_boundaries, ("Paris is big.", "Paris is big. Berlin too. 東京 🙂")):
        assert tok.decode(p.token_ids[:k]).endswith(upto)


def test_a_boundary_inside_a_token_is_dropped(builder):
    tok = builder.tokenizer
    assert len(tok.encode("Hello")) == 1  # "Hel" + "lo" tokenizes as one piece, no frontier between
    p = prepare(builder, [("Hel", True), ("lo", False)], prompt_cache_options={"mode": "explicit"})
    assert p.cache_boundaries == ()
    # The implicit candidate (end of the latest part) still maps.
    p = prepare(builder, [("Hel", True), ("lo", False)])
    assert len(p.cache_boundaries) == 1 and tok.decode(p.token_ids[:p.cache_boundaries[0]]).endswith("Hello")


def test_a_mark_the_template_cannot_reproduce_drops_only_itself(builder):
    # The empty assistant text beside tool calls renders differently once it holds the sentinel (the
    # template tests whether it is empty): that mark is no frontier, the user's mark still is.
    bp = {"prompt_cache_breakpoint": {"mode": "explicit"}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"model": "m", "prompt_cache_options": {"mode": "explicit"},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Paris is big.", **bp}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "", **bp}], "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    p = builder.prepare(parse_request(body, "m").conversation)
    assert len(p.cache_boundaries) == 1
    assert builder.tokenizer.decode(p.token_ids[:p.cache_boundaries[0]]).endswith("Paris is big.")


def test_client_data_nested_past_the_stack_is_a_prompt_error(builder):
    from protocols.errors import ProtocolError

    deep: list = []
    for _ in range(5000):  # the template ignores the kwarg; tracking its client text would recurse
        deep = [deep]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": deep}}
    with pytest.raises(ProtocolError) as e:
        builder.prepare(parse_request(body, "m").conversation)
    assert e.value.code == "invalid_prompt"
