"""Random test artifacts: deterministic per seed, valid for the reader, and sanely scaled."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest

from ninfer.artifact import open_artifact
from ninfer.artifact.bf16 import to_float32
from ninfer.cli import main
from ninfer.backends.reference import HybridRunner, ReferenceRunner
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow
from ninfer.convert.random_model import HYBRID_PRESETS, PRESETS, make_random_artifact
from ninfer.models import DenseConfig, HybridConfig, RopeScaling, tensor_names
from ninfer.models import hybrid


def test_cli_random_preset_is_deterministic_per_seed(tmp_path, capsys):
    a, b, c = (tmp_path / f"{n}.ninfer" for n in "abc")
    assert main(["convert", "--random", "tiny-llama", str(a), "--seed", "5"]) == 0
    assert main(["convert", "--random", "tiny-llama", str(b), "--seed", "5"]) == 0
    assert main(["convert", "--random", "tiny-llama", str(c), "--seed", "6"]) == 0
    assert "MB/s" in capsys.readouterr().err
    assert a.read_bytes() == b.read_bytes()
    art_a, art_c = open_artifact(a), open_artifact(c)
    assert art_a.metadata["source"] == {"kind": "random", "seed": 5, "preset": "tiny-llama"}
    assert not np.array_equal(art_a.tensor("layers.0.qkv"), art_c.tensor("layers.0.qkv"))


def test_cli_random_from_config_file(tmp_path):
    config = attrs.evolve(PRESETS["tiny-llama"], attention_bias=True, num_layers=3,
                          rope_scaling=RopeScaling(kind="linear", factor=2.0))
    (tmp_path / "cfg.json").write_text(json.dumps(config.to_json()))
    assert main(["convert", "--random", str(tmp_path / "cfg.json"), str(tmp_path / "r.ninfer")]) == 0
    art = open_artifact(tmp_path / "r.ninfer")
    assert DenseConfig.from_json(art.config) == config
    assert set(art.tensor_names()) == set(tensor_names(config))
    assert "layers.2.qkv_bias" in art.tensor_names()


def test_cli_random_from_hybrid_config_file(tmp_path, capsys):
    config = attrs.evolve(HYBRID_PRESETS["tiny-qwen3-next"], num_layers=2, layer_types=("linear_attention",
                          "full_attention"), mlp_types=("dense", "moe"))
    (tmp_path / "cfg.json").write_text(json.dumps(config.to_json()))
    assert main(["convert", "--random", str(tmp_path / "cfg.json"), str(tmp_path / "r.ninfer")]) == 0
    assert HybridConfig.from_json(open_artifact(tmp_path / "r.ninfer").config) == config
    bad = {**config.to_json(), "layer_types": ["linear_attention"]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert main(["convert", "--random", str(tmp_path / "bad.json"), str(tmp_path / "b.ninfer")]) == 1
    assert "layer_types/mlp_types must list 2 layers" in capsys.readouterr().err


def test_cli_random_rejects_unknown_config(tmp_path, capsys):
    assert main(["convert", "--random", "huge-llama", str(tmp_path / "r.ninfer")]) == 1
    presets = "tiny-llama, tiny-qwen3, qwen3-8b, tiny-qwen3-next, tiny-qwen3.5, tiny-qwen3.5-moe"
    assert f"neither a preset ({presets}) nor a file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"hidden_size": 3}')
    assert main(["convert", "--random", str(tmp_path / "bad.json"), str(tmp_path / "r.ninfer")]) == 1
    assert "is not a DenseConfig or HybridConfig JSON" in capsys.readouterr().err
    assert not (tmp_path / "r.ninfer").exists()


def test_vocab_smaller_than_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 100 is smaller than the test tokenizer"):
        make_random_artifact(tmp_path / "x.ninfer", attrs.evolve(PRESETS["tiny-qwen3"], vocab_size=100))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_activations_stay_near_unit_scale(tmp_path, preset):
    """The first projections and the logits of random weights are O(1): no NaN, no collapse."""
    config = PRESETS[preset]
    make_random_artifact(tmp_path / "m.ninfer", preset, seed=1)
    art = open_artifact(tmp_path / "m.ninfer")
    w = {n: to_float32(art.tensor(n)) for n in art.tensor_names()}
    x = w["embed"][np.arange(0, 1000, 37)]

    def rms_norm(v, g):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + config.rms_norm_eps) * g

    h = rms_norm(x, w["layers.0.attn_norm"])
    qkv = h @ w["layers.0.qkv"].T
    gate_up = rms_norm(x, w["layers.0.mlp_norm"]) @ w["layers.0.gate_up"].T
    logits = rms_norm(x, w["final_norm"]) @ w.get("lm_head", w["embed"]).T
    for name, value in {"qkv": qkv, "gate_up": gate_up}.items():
        assert 0.5 < value.std() < 2.0, f"{name} std {value.std()}"
    assert np.isfinite(logits).all() and 0.5 < logits.std() / np.sqrt(1 if "lm_head" in w else config.hidden_size) < 2.0
    assert len(set(logits.argmax(-1).tolist())) > 5  # greedy choices vary with the input


@pytest.mark.parametrize("preset", sorted(HYBRID_PRESETS))
def test_hybrid_preset_runs_with_finite_varied_logits(tmp_path, preset):
    """The CLI writes a hybrid artifact the reference HybridRunner opens; a 48-token prefill gives
    finite, O(1)-spread logits whose greedy choices vary along the prompt."""
    path = tmp_path / "h.ninfer"
    assert main(["convert", "--random", preset, str(path), "--seed", "2"]) == 0
    art = open_artifact(path)
    config = HybridConfig.from_json(art.config)
    assert config == HYBRID_PRESETS[preset] and art.metadata["architecture"] == config.architecture
    assert set(art.tensor_names()) == set(hybrid.tensor_names(config))
    assert art.chat_template and "<|im_start|>" in art.chat_template
    runner = ReferenceRunner(str(path), page_size=16, num_pages=8, max_batch=1, max_context=64, state_slots=1)
    assert isinstance(runner, HybridRunner)
    tokens = (np.arange(48, dtype=np.int32) * 37) % 900 + 5
    result = runner.prefill(PrefillChunk(lane=0, tokens=tokens, start=0, page_table=np.arange(3, dtype=np.int32),
                                         return_logits=True))
    logits = result.logits
    assert logits.shape == (48, config.vocab_size) and np.isfinite(logits).all()
    assert 0.1 < logits.std(axis=-1).mean() < 10.0, logits.std(axis=-1).mean()
    assert len(set(logits.argmax(-1).tolist())) > 5


@pytest.mark.parametrize("preset", sorted(HYBRID_PRESETS))
def test_hybrid_preset_greedy_decode_matches_a_prefill(tmp_path, preset):
    """Greedy decoding on the reference backend: each token is the argmax of its logits, and the
    decode steps' logits (the recurrent delta rule from the lane's state) are those a one-shot
    prefill of the same tokens in another lane gives (the chunked form)."""
    make_random_artifact(tmp_path / "h.ninfer", preset, seed=3)
    runner = ReferenceRunner(str(tmp_path / "h.ninfer"), page_size=16, num_pages=8, max_batch=2, max_context=64)
    prompt, steps, greedy = (np.arange(20, dtype=np.int32) * 53) % 900 + 5, 8, SamplingRow(temperature=0.0)
    first = runner.prefill(PrefillChunk(lane=0, tokens=prompt, start=0, page_table=np.arange(4, dtype=np.int32),
                                        sample=greedy, return_logits=True))
    tokens, logits = [int(first.tokens[0])], [first.logits[-1]]
    for step in range(steps):
        result = runner.decode(DecodeBatch(lanes=np.array([0]), tokens=np.array([tokens[-1]]),
                                           positions=np.array([len(prompt) + step]),
                                           page_tables=np.arange(4, dtype=np.int32)[None],
                                           sampling=[greedy], return_logits=True))
        tokens.append(int(result.tokens[0]))
        logits.append(result.logits[0])
    logits = np.stack(logits)
    assert tokens == logits.argmax(-1).tolist()
    whole = np.concatenate([prompt, np.array(tokens[:-1], np.int32)])
    again = runner.prefill(PrefillChunk(lane=1, tokens=whole, start=0, page_table=np.arange(4, 8, dtype=np.int32),
                                        return_logits=True)).logits[len(prompt) - 1:]
    np.testing.assert_allclose(logits, again, rtol=0, atol=1e-4 * np.abs(again).max())
