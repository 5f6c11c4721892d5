"""Renderings agree with Hugging Face transformers' chat-template renderer.

Expected texts come from tools/make_chat_template_fixtures.py (transformers 5.24 render_jinja_template)
for our Qwen3 template, SmolLM2's template from the installed GGUF, and a template of ours that uses
the HF environment's features.
"""

import json
from pathlib import Path

import pytest

from ninfer.text import ChatFormatter, Tokenizer
from ninfer.text.synthetic import QWEN3_TEMPLATE, TEST_SPECIAL_TOKENS, build_test_tokenizer_json

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "chat_templates" / "hf_renderings.json")
                     .read_text(encoding="utf-8"))
CASES = FIXTURE["cases"]


def smollm2_template() -> str:
    from ninfer.convert.gguf_reader import GGUFFile
    from ninfer.demo import DemoModelMissing, demo_gguf

    try:
        path = demo_gguf()
    except DemoModelMissing as exc:  # make test installs it; a bare checkout may not have it
        pytest.skip(str(exc))
    with GGUFFile(path) as g:
        return g.metadata["tokenizer.chat_template"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_json(build_test_tokenizer_json(), TEST_SPECIAL_TOKENS)


def formatter(tok, template):
    if template == "qwen3":
        return ChatFormatter(tok, QWEN3_TEMPLATE, TEST_SPECIAL_TOKENS)
    if template == "smollm2":
        return ChatFormatter(tok, smollm2_template(), TEST_SPECIAL_TOKENS)
    if template == "logic":
        return ChatFormatter(tok, FIXTURE["logic_template"], TEST_SPECIAL_TOKENS)
    # the features template prints bos_token: give the synthetic vocabulary one
    special = dict(TEST_SPECIAL_TOKENS, bos_token_id=TEST_SPECIAL_TOKENS["tokens"]["<|endoftext|>"])
    return ChatFormatter(tok, FIXTURE["features_template"], special)


@pytest.mark.parametrize("case", CASES, ids=[f"{c['template']}-{c['name']}" for c in CASES])
def test_rendering_matches_transformers(tok, case):
    fmt = formatter(tok, case["template"])
    prompt = fmt.render(case["messages"], tools=case["tools"],
                        add_generation_prompt=case["add_generation_prompt"],
                        continue_final_message=case["continue_final_message"], **case["kwargs"])
    assert prompt.text == case["text"]
    assert tok.decode(prompt.token_ids) == prompt.text


def test_agent_style_logic_sees_raw_client_text_and_still_quotes_it(tok):
    """Reverse scans and startswith/split on client strings work as in HF, while the control
    spellings the client wrote stay text."""
    case = next(c for c in CASES if c["name"] == "logic-evil")
    prompt = formatter(tok, "logic").render(case["messages"], add_generation_prompt=False)
    names = {v: k for k, v in TEST_SPECIAL_TOKENS["tokens"].items()}
    assert [names[i] for i in prompt.token_ids if i in names] == [
        "<|im_start|>", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<tool_call>",
        "</tool_call>", "<|im_end|>"]


def test_fixture_covers_every_template():
    assert {c["template"] for c in CASES} == {"qwen3", "smollm2", "features", "logic"}
