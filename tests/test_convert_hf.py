"""Hugging Face checkpoint → .ninfer: real safetensors shards on disk, the real converter and CLI."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest

from hf_fixtures import LLAMA, QWEN3, hf_weights, write_checkpoint
from ninfer.artifact import open_artifact
from ninfer.artifact.bf16 import from_float32
from ninfer.cli import main
from ninfer.convert import ConversionError, convert
from ninfer.convert.hf_config import dense_config_from_hf
from ninfer.models import RopeScaling, tensor_names


def _bf16(x):
    return from_float32(x)


def test_llama_sharded_f32_untied_with_bias(tmp_path):
    weights = hf_weights(LLAMA, seed=1)
    gen = {"bos_token_id": 1, "eos_token_id": [2, 5], "temperature": 0.6, "top_p": 0.9, "do_sample": True,
           "max_length": 4096}
    src = write_checkpoint(tmp_path / "llama", LLAMA, weights, dtype="F32", shards=3, generation=gen)
    convert(src, tmp_path / "llama.ninfer")
    art = open_artifact(tmp_path / "llama.ninfer")
    cfg = art.config
    assert (cfg["architecture"], cfg["head_dim"], cfg["num_kv_heads"], cfg["attention_bias"],
            cfg["qk_norm"], cfg["tie_word_embeddings"]) == ("LlamaForCausalLM", 16, 2, True, False, False)
    assert cfg["rope_scaling"] == attrs.asdict(RopeScaling(kind="llama3", factor=8.0, original_max_position=1024))
    assert set(art.tensor_names()) == set(tensor_names(dense_config_from_hf(LLAMA)))
    p = "model.layers.1."
    np.testing.assert_array_equal(art.tensor("layers.1.qkv"), _bf16(np.concatenate(
        [weights[p + "self_attn.q_proj.weight"], weights[p + "self_attn.k_proj.weight"],
         weights[p + "self_attn.v_proj.weight"]])))
    np.testing.assert_array_equal(art.tensor("layers.1.qkv_bias"), _bf16(np.concatenate(
        [weights[p + "self_attn.q_proj.bias"], weights[p + "self_attn.k_proj.bias"],
         weights[p + "self_attn.v_proj.bias"]])))
    np.testing.assert_array_equal(art.tensor("layers.1.gate_up"), _bf16(np.concatenate(
        [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])))
    np.testing.assert_array_equal(art.tensor("lm_head"), _bf16(weights["lm_head.weight"]))
    np.testing.assert_array_equal(art.tensor("layers.0.attn_norm"),
                                  _bf16(weights["model.layers.0.input_layernorm.weight"]))
    im_end = art.special_tokens["tokens"]["<|im_end|>"]
    assert art.special_tokens["bos_token_id"] == 1
    assert art.special_tokens["eos_token_ids"] == [2, 5, im_end]  # generation_config, then tokenizer_config
    assert art.generation["defaults"] == {"temperature": 0.6, "top_p": 0.9, "do_sample": True}
    assert art.chat_template and "<|im_start|>" in art.chat_template
    assert art.metadata["source"]["shards"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_qwen3_bf16_tied_qk_norm_yarn_passes_bits_through(tmp_path):
    weights = hf_weights(QWEN3, seed=2)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied checkpoints may store it
    src = write_checkpoint(tmp_path / "qwen", QWEN3, weights, dtype="BF16", template_in="jinja")
    convert(src, tmp_path / "q.ninfer")
    art = open_artifact(tmp_path / "q.ninfer")
    assert art.config["qk_norm"] and art.config["tie_word_embeddings"] and art.config["head_dim"] == 32
    assert art.config["rope_scaling"]["kind"] == "yarn" and art.config["rope_scaling"]["factor"] == 4.0
    assert "lm_head" not in art.tensor_names()
    np.testing.assert_array_equal(art.tensor("layers.0.q_norm"),
                                  _bf16(weights["model.layers.0.self_attn.q_norm.weight"]))
    np.testing.assert_array_equal(art.tensor("embed"), _bf16(weights["model.embed_tokens.weight"]))
    assert art.tensor("layers.1.qkv").shape == (4 * 32 + 2 * 2 * 32, 64)
    assert art.chat_template == (src / "chat_template.jinja").read_text()
    assert art.generation["presets"]["thinking"]["top_k"] == 20
    assert art.metadata["name"] == "qwen"


def test_f16_source_is_widened_then_rounded(tmp_path):
    cfg = {**LLAMA, "attention_bias": False, "rope_scaling": None}
    weights = hf_weights(cfg, seed=3)
    src = write_checkpoint(tmp_path / "f16", cfg, weights, dtype="F16")
    convert(src, tmp_path / "f16.ninfer")
    art = open_artifact(tmp_path / "f16.ninfer")
    np.testing.assert_array_equal(art.tensor("layers.0.down"),
                                  _bf16(weights["model.layers.0.mlp.down_proj.weight"].astype(np.float16)))
    assert art.config["rope_scaling"]["kind"] == "none"


@pytest.mark.parametrize("scaling,expected", [
    ({"type": "linear", "factor": 2.0}, RopeScaling(kind="linear", factor=2.0)),
    ({"rope_type": "default"}, RopeScaling()),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 16,
      "attention_factor": 1.2},
     RopeScaling(kind="yarn", factor=4.0, original_max_position=32768, beta_fast=16.0, attention_factor=1.2)),
])
def test_rope_scaling_mapping(scaling, expected):
    assert dense_config_from_hf({**LLAMA, "rope_scaling": scaling}).rope_scaling == expected


def test_rope_parameters_form_and_head_dim_default():
    cfg = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "rope_scaling")}
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 3.0, "rope_theta": 123.0}
    config = dense_config_from_hf(cfg)
    assert config.rope_theta == 123.0 and config.rope_scaling == RopeScaling(kind="linear", factor=3.0)
    assert config.head_dim == 64 // 4


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture \\['MistralForCausalLM'\\]"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ConversionError, match=message):
        dense_config_from_hf({**LLAMA, **change})


def _broken(tmp_path, mutate_weights=None, **kw):
    weights = hf_weights(LLAMA)
    if mutate_weights:
        mutate_weights(weights)
    return write_checkpoint(tmp_path / "src", LLAMA, weights, **kw)


@pytest.mark.parametrize("mutate,message", [
    (lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"),
     "tensor 'model.layers.1.self_attn.k_proj.weight' missing \\(needed for 'layers.1.qkv'"),
    (lambda w: w.__setitem__("model.layers.0.mlp.down_proj.weight", np.zeros((64, 95), np.float32)),
     "mlp.down_proj.weight' has shape \\[64, 95\\], incompatible with 'layers.0.down'"),
    (lambda w: w.__setitem__("model.layers.0.mlp.up_proj.weight", np.zeros((90, 64), np.float32)),
     "give 186 rows, the config needs 192 for 'layers.0.gate_up'"),
    (lambda w: w.__setitem__("model.layers.0.mlp.gate_proj.bias", np.full(96, 0.5, np.float32)),
     "unexpected tensor 'model.layers.0.mlp.gate_proj.bias'"),
    (lambda w: w.__setitem__("model.layers.0.self_attn.o_proj.bias", np.eye(1, 64, 3, dtype=np.float32)[0]),
     "unexpected tensor 'model.layers.0.self_attn.o_proj.bias'"),
])
def test_bad_checkpoints_fail_before_writing(tmp_path, mutate, message):
    src = _broken(tmp_path, mutate)
    with pytest.raises(ConversionError, match=message):
        convert(src, tmp_path / "out.ninfer")
    assert not list(tmp_path.glob("out.ninfer*"))


def test_all_zero_unmapped_bias_and_rotary_buffers_are_dropped(tmp_path):
    """transformers writes Llama's o_proj.bias under attention_bias; zeros change nothing."""
    def add(w):
        w["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
        w["model.layers.1.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    convert(_broken(tmp_path, add), tmp_path / "out.ninfer")
    assert "layers.0.o" in open_artifact(tmp_path / "out.ninfer").tensor_names()


def test_chat_template_sources_in_order(tmp_path):
    from ninfer.convert.hf_checkpoint import chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "P"}))
    assert chat_template(tmp_path) == "P"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert chat_template(tmp_path) == "J"


def test_missing_files(tmp_path):
    src = _broken(tmp_path, shards=2)
    (src / "tokenizer.json").unlink()
    with pytest.raises(ConversionError, match="tokenizer.json: missing"):
        convert(src, tmp_path / "o.ninfer")
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConversionError, match="model-00002-of-00002.safetensors: missing shard"):
        convert(src, tmp_path / "o.ninfer")
    (src / "model.safetensors.index.json").unlink()
    (src / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ConversionError, match="no \\*.safetensors weights found"):
        convert(src, tmp_path / "o.ninfer")
    with pytest.raises(ConversionError, match="no such file or directory"):
        convert(tmp_path / "nope", tmp_path / "o.ninfer")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConversionError, match="not a Hugging Face checkpoint directory or a .gguf file"):
        convert(tmp_path / "weights.bin", tmp_path / "o.ninfer")


def test_cli_convert_and_inspect(tmp_path, capsys):
    src = write_checkpoint(tmp_path / "ck", LLAMA, hf_weights(LLAMA), shards=2)
    out = tmp_path / "ck.ninfer"
    assert main(["convert", str(src), str(out)]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "100% (" in err  # not a TTY: plain lines
    assert "MB/s)" in err.splitlines()[-1]
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    expected = tensor_names(dense_config_from_hf(LLAMA))
    total = sum(np.prod(s) * 2 for s in expected.values())
    assert "architecture  LlamaForCausalLM" in shown
    assert f"tensors       {len(expected)}, {total / 1e6:.2f} MB" in shown
    assert f"  text              {len(expected)} tensors" in shown
    assert main(["inspect", "--tensors", str(out)]) == 0
    assert "layers.1.gate_up" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["convert", str(tmp_path), str(tmp_path / "o.ninfer")]) == 1
    assert "ninfer convert: error: " in capsys.readouterr().err
    assert main(["convert", str(tmp_path)]) == 2
    (tmp_path / "bad.ninfer").write_bytes(b"garbage" * 10)
    assert main(["inspect", str(tmp_path / "bad.ninfer")]) == 1
    assert "wrong magic" in capsys.readouterr().err


def test_safetensors_round_trip_and_malformed(tmp_path):
    from ninfer.convert.safetensors import SafetensorsFile, write_safetensors

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": ("BF16", np.arange(4, dtype=np.uint16)),
               "c": np.array([1, -2], dtype=np.int64), "d": np.zeros((0, 3), np.float16)}
    write_safetensors(tmp_path / "t.safetensors", tensors, metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "t.safetensors")
    assert f.metadata == {"format": "pt"} and f.infos["b"].dtype == "BF16"
    np.testing.assert_array_equal(f.get("a"), tensors["a"])
    np.testing.assert_array_equal(f.get("b"), tensors["b"][1])
    np.testing.assert_array_equal(f.get("c"), tensors["c"])
    assert f.get("d").shape == (0, 3)
    raw = (tmp_path / "t.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header["a"]["data_offsets"][1] += 4
    body = json.dumps(header).encode()
    (tmp_path / "bad.safetensors").write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + len(raw[8:8 + int.from_bytes(raw[:8], "little")]):])
    with pytest.raises(ConversionError, match="tensor 'a' data_offsets"):
        SafetensorsFile(tmp_path / "bad.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConversionError, match="not a safetensors file"):
        SafetensorsFile(tmp_path / "junk.safetensors")


def test_progress_redraws_on_a_tty_and_reports_rate():
    import io

    from ninfer.convert.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream, ticks = Terminal(), iter([10.0, 12.0])
    progress = Progress("convert", stream=stream, clock=lambda: next(ticks))
    progress(50_000_000, 100_000_000, "embed")
    progress(100_000_000, 100_000_000, "lm_head")
    assert progress.finish() == pytest.approx(50.0)
    text = stream.getvalue()
    assert text.count("\r") == 2 and " 50.0%" in text and "100.0%" in text
    assert text.endswith("\nconvert: wrote 100.0 MB in 2.00 s (50.0 MB/s)\n")
