"""GGUF → .ninfer on small synthetic llama GGUF files written by tests/gguf_testing.py."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_testing import (F32, FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, Typed,
                          dequantize_reference, hf_weights, permute_rope_rows, quantize, tiny_llama_metadata,
                          type_of, write_gguf, write_tiny_llama)
from ninfer.artifact import open_artifact
from ninfer.artifact.bf16 import from_float32, to_float32
from ninfer.convert import ConversionError, convert
from ninfer.convert.gguf import convert_gguf, default_name, unpermute_rope_rows
from ninfer.models import tensor_names

def _hf_order_rows(gguf_rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Per head, HF row i < d/2 is GGUF row 2i and HF row d/2 + i is GGUF row 2i + 1."""
    d = gguf_rows.shape[0] // n_heads
    index = [h * d + (2 * i if i < d // 2 else 2 * (i - d // 2) + 1) for h in range(n_heads) for i in range(d)]
    return gguf_rows[index]


def _expected(raws: dict[str, bytes], shape_of) -> dict[str, np.ndarray]:
    """Every canonical tensor from the per-element reference dequantization."""
    deq = {n: dequantize_reference(r, type_of(n)).reshape(shape_of(n)) for n, r in raws.items()}
    out = {"embed": deq["token_embd.weight"], "final_norm": deq["output_norm.weight"]}
    if "output.weight" in deq:
        out["lm_head"] = deq["output.weight"]
    for i in range(LAYERS):
        b, p = f"blk.{i}.", f"layers.{i}."
        out[p + "attn_norm"] = deq[b + "attn_norm.weight"]
        out[p + "mlp_norm"] = deq[b + "ffn_norm.weight"]
        out[p + "qkv"] = np.concatenate([_hf_order_rows(deq[b + "attn_q.weight"], HEADS),
                                         _hf_order_rows(deq[b + "attn_k.weight"], KV_HEADS),
                                         deq[b + "attn_v.weight"]])
        out[p + "o"] = deq[b + "attn_output.weight"]
        out[p + "gate_up"] = np.concatenate([deq[b + "ffn_gate.weight"], deq[b + "ffn_up.weight"]])
        out[p + "down"] = deq[b + "ffn_down.weight"]
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_tensors_are_the_dequantized_fused_unpermuted_weights(tmp_path, tied):
    hf, raws = write_tiny_llama(tmp_path / "tiny.gguf", tied=tied)
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny.ninfer")
    art = open_artifact(tmp_path / "tiny.ninfer")
    cfg = art.config
    assert cfg["tie_word_embeddings"] is tied
    assert set(art.tensor_names()) == set(tensor_names(_dense(cfg)))
    expected = _expected(raws, lambda n: hf[n].shape)
    for name, want in expected.items():
        got = np.asarray(art.tensor(name))
        assert art.tensor_info(name).dtype == "bf16" and got.shape == want.shape, name
        np.testing.assert_array_equal(got, from_float32(want), err_msg=name)


def _dense(cfg):
    from ninfer.models import DenseConfig
    return DenseConfig.from_json(cfg)


def test_float_q_and_k_come_back_in_hf_layout_exactly(tmp_path):
    hf, _ = write_tiny_llama(tmp_path / "f.gguf", types=lambda n: "F32")
    convert_gguf(tmp_path / "f.gguf", tmp_path / "f.ninfer")
    qkv = to_float32(np.asarray(open_artifact(tmp_path / "f.ninfer").tensor("layers.1.qkv")))
    q, k = hf["blk.1.attn_q.weight"], hf["blk.1.attn_k.weight"]
    np.testing.assert_array_equal(qkv[:q.shape[0]], to_float32(from_float32(q)))
    np.testing.assert_array_equal(qkv[q.shape[0]:q.shape[0] + k.shape[0]], to_float32(from_float32(k)))


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(5).normal(size=(3 * 8, 5))
    np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w, 3), 3), w)
    assert not np.array_equal(permute_rope_rows(w, 3), w)


def _rope_interleaved(x, pos, base):
    """GGML's normal RoPE: rotates the pairs (2i, 2i+1)."""
    d = x.shape[-1]
    theta = pos * base ** (-np.arange(0, d, 2) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(theta) - b * np.sin(theta)
    out[..., 1::2] = a * np.sin(theta) + b * np.cos(theta)
    return out


def _rope_rotate_half(x, pos, base):
    """Hugging Face's RoPE: rotates the pairs (i, i + d/2)."""
    d = x.shape[-1]
    theta = pos * base ** (-np.arange(0, d, 2) / d)
    a, b = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)], -1)


def test_attention_scores_agree_between_gguf_rope_and_our_rope(tmp_path):
    """The point of the unpermutation: llama.cpp's interleaved RoPE over the GGUF rows and our
    rotate-half RoPE over the converted rows give the same attention scores."""
    from ninfer.convert.gguf_reader import GGUFFile

    write_tiny_llama(tmp_path / "r.gguf", types=lambda n: "F32")
    convert_gguf(tmp_path / "r.gguf", tmp_path / "r.ninfer")
    qkv = to_float32(np.asarray(open_artifact(tmp_path / "r.ninfer").tensor("layers.0.qkv"))).astype(np.float64)
    with GGUFFile(tmp_path / "r.gguf") as g:
        gq = to_float32(from_float32(g.dequantize("blk.0.attn_q.weight"))).astype(np.float64)
        gk = to_float32(from_float32(g.dequantize("blk.0.attn_k.weight"))).astype(np.float64)
    x = np.random.default_rng(7).normal(size=(2, HIDDEN))  # a query token and a key token
    qs, ks = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    ours_q = _rope_rotate_half((x[0] @ qkv[:qs].T).reshape(HEADS, HEAD_DIM), 9.0, 10000.0)
    ours_k = _rope_rotate_half((x[1] @ qkv[qs:qs + ks].T).reshape(KV_HEADS, HEAD_DIM), 4.0, 10000.0)
    ggml_q = _rope_interleaved((x[0] @ gq.T).reshape(HEADS, HEAD_DIM), 9.0, 10000.0)
    ggml_k = _rope_interleaved((x[1] @ gk.T).reshape(KV_HEADS, HEAD_DIM), 4.0, 10000.0)
    group = HEADS // KV_HEADS
    ours = np.array([ours_q[h] @ ours_k[h // group] for h in range(HEADS)])
    ggml = np.array([ggml_q[h] @ ggml_k[h // group] for h in range(HEADS)])
    np.testing.assert_allclose(ours, ggml, rtol=1e-9, atol=1e-9)
    wrong = np.array([_rope_rotate_half((x[0] @ gq.T).reshape(HEADS, HEAD_DIM), 9.0, 10000.0)[h]
                      @ _rope_rotate_half((x[1] @ gk.T).reshape(KV_HEADS, HEAD_DIM), 4.0, 10000.0)[h // group]
                      for h in range(HEADS)])
    assert not np.allclose(wrong, ggml, atol=1e-3)  # without unpermuting, the scores would differ


def test_config_and_text_assets(tmp_path):
    write_tiny_llama(tmp_path / "tiny-model.Q4_0.gguf")
    header = convert(tmp_path / "tiny-model.Q4_0.gguf", tmp_path / "c.ninfer")  # the generic entry point
    art = open_artifact(tmp_path / "c.ninfer")
    cfg = art.config
    assert (cfg["architecture"], cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == \
        ("LlamaForCausalLM", VOCAB, HIDDEN, FFN)
    assert (cfg["num_layers"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]) == (LAYERS, HEADS, KV_HEADS, HEAD_DIM)
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 10000.0 and cfg["max_position_embeddings"] == 1024
    assert cfg["rope_scaling"]["kind"] == "none"
    assert art.metadata["name"] == "tiny-model" and art.metadata["architecture"] == "LlamaForCausalLM"
    assert art.metadata["source"]["kind"] == "gguf" and art.metadata["source"]["general.name"] == "tiny test llama"
    assert art.chat_template.startswith("{% for m in messages %}")
    st = art.special_tokens
    assert (st["bos_token_id"], st["eos_token_ids"], st["pad_token_id"]) == (260, [261], 259)
    assert st["tokens"] == {"<|endoftext|>": 259, "<|im_start|>": 260, "<|im_end|>": 261}
    assert header["tokenizer"]["add_bos_token"] is False
    assert list(art.components) == ["text"]


def test_yarn_rope_scaling_keys(tmp_path):
    md = tiny_llama_metadata(**{"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                      "llama.rope.scaling.original_context_length": 256,
                      "llama.rope.scaling.yarn_beta_fast": 16.0, "llama.rope.scaling.attn_factor": 1.0})
    write_tiny_llama(tmp_path / "y.gguf", metadata=md)
    convert_gguf(tmp_path / "y.gguf", tmp_path / "y.ninfer")
    rs = open_artifact(tmp_path / "y.ninfer").config["rope_scaling"]
    assert (rs["kind"], rs["factor"], rs["original_max_position"], rs["beta_fast"], rs["beta_slow"]) == \
        ("yarn", 4.0, 256, 16.0, 1.0)
    assert rs["attention_factor"] is None  # derived by the backend as 0.1 * ln(factor) + 1


def test_unsupported_tensor_type_fails_before_writing(tmp_path):
    def types(name):
        return "Q5_0" if name == "blk.1.ffn_up.weight" else type_of(name)

    hf = hf_weights(False)
    tensors = []
    for name, w in hf.items():
        raw = bytes(w.size // 32 * 22) if types(name) == "Q5_0" else quantize(w, types(name))
        tensors.append((name, types(name), w.shape, raw))
    write_gguf(tmp_path / "k.gguf", tiny_llama_metadata(), tensors)
    with pytest.raises(ConversionError, match=r"'blk\.1\.ffn_up\.weight' has type Q5_0"):
        convert_gguf(tmp_path / "k.gguf", tmp_path / "k.ninfer")
    assert not (tmp_path / "k.ninfer").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "k.gguf"]


@pytest.mark.parametrize("change,message", [
    ({"general.architecture": "qwen2"}, r"general.architecture 'qwen2' is not supported"),
    ({"llama.rope.scaling.type": "longrope"}, r"rope.scaling.type 'longrope' is not supported"),
    ({"llama.rope.dimension_count": 8}, r"partial rotary"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.attn_factor": 0.5}, r"attn_factor 0.5 is not supported"),
    ({"tokenizer.ggml.pre": "mystery"}, r"tokenizer.ggml.pre 'mystery' is not supported"),
    ({"tokenizer.ggml.model": "llama"}, r"tokenizer.ggml.model 'llama' is not supported"),
])
def test_unsupported_models_are_refused(tmp_path, change, message):
    write_tiny_llama(tmp_path / "u.gguf", metadata=tiny_llama_metadata(**change))
    with pytest.raises(ConversionError, match=message):
        convert_gguf(tmp_path / "u.gguf", tmp_path / "u.ninfer")
    assert not (tmp_path / "u.ninfer").exists()


def test_missing_metadata_key_is_named(tmp_path):
    md = tiny_llama_metadata()
    del md["llama.feed_forward_length"]
    write_tiny_llama(tmp_path / "m.gguf", metadata=md)
    with pytest.raises(ConversionError, match="lacks 'llama.feed_forward_length'"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "m.ninfer")


def test_unknown_and_misshaped_tensors_are_refused(tmp_path):
    extra = [("rope_freqs.weight", "F32", (HEAD_DIM // 2,), quantize(np.ones(HEAD_DIM // 2), "F32"))]
    write_tiny_llama(tmp_path / "r.gguf", extra_tensors=extra)
    with pytest.raises(ConversionError, match="rope_freqs.weight"):
        convert_gguf(tmp_path / "r.gguf", tmp_path / "r.ninfer")
    extra = [("blk.0.attn_q_norm.weight", "F32", (HEAD_DIM,), quantize(np.ones(HEAD_DIM), "F32"))]
    write_tiny_llama(tmp_path / "x.gguf", extra_tensors=extra)
    with pytest.raises(ConversionError, match=r"no place in a llama model: blk\.0\.attn_q_norm\.weight"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "x.ninfer")
    wrong = tiny_llama_metadata(**{"llama.feed_forward_length": FFN + 32})
    write_tiny_llama(tmp_path / "s.gguf", metadata=wrong)
    with pytest.raises(ConversionError, match=r"layers\.0\.gate_up.*the config needs \[256, 64\]"):
        convert_gguf(tmp_path / "s.gguf", tmp_path / "s.ninfer")


def test_default_name_strips_the_quantization_suffix(tmp_path):
    from pathlib import Path
    assert default_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert default_name(Path("llama-3-8b-instruct-q8_0.gguf")) == "llama-3-8b-instruct"
    assert default_name(Path("model-F16.gguf")) == "model"
    assert default_name(Path("plain.gguf")) == "plain"
    assert default_name(Path("model-Instruct.gguf")) == "model-Instruct"
    assert default_name(Path("m.IQ2_XXS.gguf")) == "m" and default_name(Path("m-Q4_K_M.gguf")) == "m"


def test_metadata_float_rounding_is_shortest(tmp_path):
    md = tiny_llama_metadata(**{"llama.attention.layer_norm_rms_epsilon": Typed(F32, 1e-5)})
    write_tiny_llama(tmp_path / "e.gguf", metadata=md)
    convert_gguf(tmp_path / "e.gguf", tmp_path / "e.ninfer")
    assert open_artifact(tmp_path / "e.ninfer").config["rms_norm_eps"] == 1e-5
