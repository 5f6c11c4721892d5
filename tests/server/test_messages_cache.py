"""Messages cache_control on tools, tool_use and tool_result: exact prompt frontiers (PromptBuilder)."""

from __future__ import annotations

import pytest

from ninfer.artifact import open_artifact
from ninfer.server.prompt import PromptBuilder, ServeDefaults
from ninfer.text import ChatFormatter, Tokenizer
from protocols.anthropic_messages import parse_request

EPH = {"type": "ephemeral"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.fixture(scope="module")
def builder(tiny_artifact):
    art = open_artifact(tiny_artifact)
    tok = Tokenizer.from_artifact(art)
    return PromptBuilder(tok, ChatFormatter(tok, art.chat_template, art.special_tokens), ServeDefaults())


def prepare(builder, **body):
    body = {"model": "m", "max_tokens": 16, **body}
    return builder.prepare(parse_request(body).conversation)


def tools(marked: int | None):
    return [dict({"name": n, "description": f"tool {n}", "input_schema": SCHEMA},
                 **({"cache_control": EPH} if i == marked else {})) for i, n in enumerate(("alpha", "beta"))]


def before(builder, p, k: int) -> str:
    return builder.tokenizer.decode(p.token_ids[:k])


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_marker_on_last_tool_ends_the_tools_declaration(builder, system):
    extra = {"system": system} if system else {}
    msgs = [{"role": "user", "content": "weather?"}]
    p = prepare(builder, tools=tools(1), messages=msgs, **extra)
    assert p.token_ids == prepare(builder, tools=tools(None), messages=msgs, **extra).token_ids
    assert len(p.cache_boundaries) == 1
    head = before(builder, p, p.cache_boundaries[0])
    assert '"name": "beta"' in head and "</tools>" in head  # the whole declaration, rules included
    assert "weather?" not in head and (system is None or system not in head)
    # The same tools under another conversation share exactly that prefix.
    other = prepare(builder, tools=tools(None), messages=[{"role": "user", "content": "other"}], **extra)
    assert other.token_ids[:p.cache_boundaries[0]] == p.token_ids[:p.cache_boundaries[0]]


def test_marker_on_an_earlier_tool_ends_its_declaration(builder):
    p = prepare(builder, tools=tools(0), messages=[{"role": "user", "content": "weather?"}])
    assert len(p.cache_boundaries) == 1
    head = before(builder, p, p.cache_boundaries[0])
    assert '"name": "alpha"' in head and '"name": "beta"' not in head


def history(call_mark: bool, result_mark: bool):
    use = {"type": "tool_use", "id": "toolu_1", "name": "alpha", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    if call_mark:
        use["cache_control"] = EPH
    if result_mark:
        result["cache_control"] = EPH
    return [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, use]},
            {"role": "user", "content": [result, {"type": "text", "text": "and tomorrow?"}]}]


def test_markers_on_tool_use_and_tool_result_end_the_call_and_the_result(builder):
    p = prepare(builder, tools=tools(None), messages=history(True, True))
    plain = prepare(builder, tools=tools(None), messages=history(False, False))
    assert p.token_ids == plain.token_ids
    assert len(p.cache_boundaries) == 2
    call_head, result_head = (before(builder, p, k) for k in p.cache_boundaries)
    assert call_head.endswith("</tool_call>") and "sunny" not in call_head
    assert result_head.endswith("sunny") and "tomorrow" not in result_head
