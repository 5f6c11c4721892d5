"""The hybrid HF converter: config mapping, tensor round-trip, components, refusals.

Checkpoints are the transformers-made fixtures in tests/fixtures/hybrid (see
tools/make_hybrid_fixtures.py); every canonical tensor is checked against its source bits,
recomputed here from the checkpoint layout rather than through the converter's helpers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ninfer.artifact import ArtifactError, open_artifact
from ninfer.artifact.bf16 import to_float32
from ninfer.convert import ConversionError
from ninfer.convert.hf import convert_hf
from ninfer.convert.hf_hybrid import hybrid_config_from_hf
from ninfer.convert.safetensors import SafetensorsFile, write_safetensors
from ninfer.models.hybrid import HybridConfig, tensor_names

FIXTURES = Path(__file__).parent / "fixtures" / "hybrid"


def source(name: str) -> dict[str, np.ndarray]:
    f = SafetensorsFile(FIXTURES / name / "model.safetensors")
    return {k: np.array(f.get(k)) for k in f.keys()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid_convert")
    result = {}
    for name in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        convert_hf(FIXTURES / name, out / f"{name}.ninfer")
        result[name] = open_artifact(out / f"{name}.ninfer", components=None)
    return result


def test_configs_follow_the_checkpoints(converted):
    nxt = HybridConfig.from_json(converted["qwen3_next"].config)
    assert nxt.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert nxt.mlp_types == ("moe", "dense", "moe", "moe")  # mlp_only_layers=[1]
    assert (nxt.num_experts, nxt.num_experts_per_tok, nxt.norm_topk_prob) == (4, 2, True)
    assert nxt.rotary_dim == 8 and nxt.rope_theta == 1e6 and not nxt.tie_word_embeddings
    q35 = HybridConfig.from_json(converted["qwen3_5"].config)
    assert q35.layer_types == ("linear_attention", "full_attention") * 2  # full_attention_interval=2
    assert q35.mlp_types == ("dense",) * 4 and q35.tie_word_embeddings and q35.num_experts == 0
    assert q35.mrope_section == (1, 2, 1)
    moe = HybridConfig.from_json(converted["qwen3_5_moe"].config)
    assert moe.mlp_types == ("moe",) * 4 and moe.norm_topk_prob and moe.architecture == "Qwen3_5MoeForCausalLM"
    for art in converted.values():
        config = HybridConfig.from_json(art.config)
        assert HybridConfig.from_json(config.to_json()) == config
        assert art.metadata["architecture"] == config.architecture
        assert {n: tuple(art.tensor_info(n).shape) for n in tensor_names(config)} == tensor_names(config)
        assert art.generation["presets"]["thinking"]["temperature"] == 0.6


def test_qwen3_next_grouped_projections_are_ungrouped(converted):
    src = source("qwen3_next")
    art = converted["qwen3_next"]
    nk, nv, dk, dv, h = 2, 4, 16, 16, 64
    r = nv // nk
    qkvz = src["model.layers.0.linear_attn.in_proj_qkvz.weight"].reshape(nk, 2 * dk + 2 * r * dv, h)
    ba = src["model.layers.0.linear_attn.in_proj_ba.weight"].reshape(nk, 2 * r, h)
    in_proj = art.tensor("layers.0.in_proj")
    key_dim, value_dim = nk * dk, nv * dv
    for g in range(nk):
        np.testing.assert_array_equal(in_proj[g * dk : (g + 1) * dk], qkvz[g, :dk])  # q
        np.testing.assert_array_equal(in_proj[key_dim + g * dk : key_dim + (g + 1) * dk], qkvz[g, dk : 2 * dk])
        for j in range(r):
            head = g * r + j  # value head g*r + j belongs to key head g
            v_rows = slice(2 * key_dim + head * dv, 2 * key_dim + (head + 1) * dv)
            z_rows = slice(2 * key_dim + value_dim + head * dv, 2 * key_dim + value_dim + (head + 1) * dv)
            np.testing.assert_array_equal(in_proj[v_rows], qkvz[g, 2 * dk + j * dv : 2 * dk + (j + 1) * dv])
            np.testing.assert_array_equal(in_proj[z_rows], qkvz[g, 2 * dk + r * dv + j * dv :][:dv])
            np.testing.assert_array_equal(in_proj[2 * key_dim + 2 * value_dim + head], ba[g, j])
            np.testing.assert_array_equal(in_proj[2 * key_dim + 2 * value_dim + nv + head], ba[g, r + j])


def test_qwen3_5_projections_attention_and_components(converted):
    src = source("qwen3_5")
    art = converted["qwen3_5"]
    p = "model.language_model.layers."
    np.testing.assert_array_equal(art.tensor("layers.0.in_proj"), np.concatenate(
        [src[p + f"0.linear_attn.in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")]))
    np.testing.assert_array_equal(art.tensor("layers.0.conv"), src[p + "0.linear_attn.conv1d.weight"][:, 0])
    a_log = art.tensor("layers.0.A_log")
    assert a_log.dtype == np.float32
    np.testing.assert_array_equal(a_log, to_float32(src[p + "0.linear_attn.A_log"]))
    np.testing.assert_array_equal(art.tensor("layers.1.qkv"), np.concatenate(
        [src[p + f"1.self_attn.{x}_proj.weight"] for x in ("q", "k", "v")]))
    np.testing.assert_array_equal(art.tensor("layers.1.gate_up"), np.concatenate(
        [src[p + "1.mlp.gate_proj.weight"], src[p + "1.mlp.up_proj.weight"]]))
    assert "lm_head" not in art.tensor_names("text")  # tied to the embedding
    # Vision and MTP weights travel as their own components, bits unchanged.
    assert art.components == ("text", "mtp", "vision")
    np.testing.assert_array_equal(art.tensor("vision.pos_embed.weight"), src["model.visual.pos_embed.weight"])
    assert art.tensor_info("vision.pos_embed.weight").component == "vision"
    np.testing.assert_array_equal(art.tensor("mtp.fc.weight"), src["mtp.fc.weight"])
    assert art.tensor_info("mtp.norm.weight").component == "mtp"
    # A process that enables only the text component never reads the others.
    with open_artifact(art.path, components=("text",)) as text_only:
        with pytest.raises(ArtifactError, match="did not enable"):
            text_only.tensor("vision.pos_embed.weight")


@pytest.mark.parametrize("name, prefix", [("qwen3_next", "model.layers.2.mlp."),
                                          ("qwen3_5_moe", "model.layers.2.mlp.")])
def test_experts_per_expert_and_fused_both_become_fused(converted, name, prefix):
    src = source(name)
    gate_up = converted[name].tensor("layers.2.experts.gate_up")
    down = converted[name].tensor("layers.2.experts.down")
    for e in range(4):
        if prefix + "experts.gate_up_proj" in src:  # fused on disk
            want_gate_up, want_down = src[prefix + "experts.gate_up_proj"][e], src[prefix + "experts.down_proj"][e]
        else:
            want_gate_up = np.concatenate([src[prefix + f"experts.{e}.gate_proj.weight"],
                                           src[prefix + f"experts.{e}.up_proj.weight"]])
            want_down = src[prefix + f"experts.{e}.down_proj.weight"]
        np.testing.assert_array_equal(gate_up[e], want_gate_up)
        np.testing.assert_array_equal(down[e], want_down)
    np.testing.assert_array_equal(converted[name].tensor("layers.2.router"), src[prefix + "gate.weight"])
    np.testing.assert_array_equal(converted[name].tensor("layers.2.shared_gate"),
                                  src[prefix + "shared_expert_gate.weight"])


def copy_fixture(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    return target


def rewrite(directory: Path, change) -> None:
    f = SafetensorsFile(directory / "model.safetensors")
    tensors = {k: (f.infos[k].dtype, np.array(f.get(k))) for k in f.keys()}
    del f
    change(tensors)
    write_safetensors(directory / "model.safetensors", tensors)


def test_unknown_and_missing_tensors_are_refused(tmp_path):
    d = copy_fixture(tmp_path, "qwen3_5_moe")
    rewrite(d, lambda t: t.__setitem__("model.layers.0.linear_attn.extra", ("BF16", np.zeros(4, np.uint16))))
    with pytest.raises(ConversionError, match="unexpected tensor 'model.layers.0.linear_attn.extra'"):
        convert_hf(d, tmp_path / "a.ninfer")
    d = copy_fixture(tmp_path / "b", "qwen3_5_moe")
    rewrite(d, lambda t: t.pop("model.layers.3.self_attn.q_norm.weight"))
    with pytest.raises(ConversionError, match="'model.layers.3.self_attn.q_norm.weight' missing"):
        convert_hf(d, tmp_path / "b.ninfer")
    assert not (tmp_path / "a.ninfer").exists() and not (tmp_path / "b.ninfer").exists()


def test_wrong_shapes_are_refused(tmp_path):
    d = copy_fixture(tmp_path, "qwen3_5_moe")
    rewrite(d, lambda t: t.__setitem__("model.layers.0.linear_attn.conv1d.weight",
                                       ("BF16", np.zeros((128, 1, 3), np.uint16))))
    with pytest.raises(ConversionError, match=r"conv1d.weight' has shape \[128, 1, 3\], expected \[128, 1, 4\]"):
        convert_hf(d, tmp_path / "a.ninfer")


def base_config() -> dict:
    return json.loads((FIXTURES / "qwen3_5_moe" / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e6)), "rope type 'yarn'"),
    (dict(layer_types=["linear_attention"]), "layer_types lists 1 layers"),
    (dict(layer_types=["linear_attention", "sliding", "linear_attention", "full_attention"]), "unknown kinds"),
    (dict(linear_num_value_heads=3), "multiple of linear_num_k_heads"),
    (dict(architectures=["MambaForCausalLM"]), "not a hybrid architecture"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(ConversionError, match=message):
        hybrid_config_from_hf(base_config() | change)


def test_rope_spellings():
    classic = base_config() | dict(rope_parameters=None, rope_theta=5e6, partial_rotary_factor=0.5,
                                   rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]))
    config = hybrid_config_from_hf(classic)
    assert (config.rope_theta, config.rotary_dim, config.mrope_section) == (5e6, 16, (2, 3, 3))
    bare = {k: v for k, v in base_config().items() if k != "rope_parameters"}
    assert hybrid_config_from_hf(bare).rotary_dim == 8  # partial_rotary_factor defaults to 0.25


def test_real_model_shapes_and_state_sizes():
    """Qwen3.6-27B's published text config: derived shapes and per-sequence sizes."""
    text = dict(vocab_size=248320, hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, intermediate_size=17408, linear_num_key_heads=16,
                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=262144,
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                     mrope_section=[11, 11, 10], mrope_interleaved=True))
    config = hybrid_config_from_hf(dict(architectures=["Qwen3_5ForConditionalGeneration"], text_config=text,
                                        tie_word_embeddings=False))
    assert len(config.linear_layers) == 48 and config.attention_layers == tuple(range(3, 64, 4))
    assert config.rotary_dim == 64 and config.conv_dim == 10240
    names = tensor_names(config)
    assert names["layers.0.in_proj"] == (10240 + 6144 + 96, 5120)
    assert names["layers.3.qkv"] == (2 * 6144 + 2 * 1024, 5120)
    assert config.conv_state_shape == (3, 10240) and config.recurrent_state_shape == (48, 128, 128)
    assert config.state_floats * 4 == 48 * (3 * 10240 + 48 * 128 * 128) * 4  # ~146 MiB fp32 per sequence
    assert config.kv_bytes_per_token == 16 * 2 * 4 * 256 * 2  # 64 KiB bf16 per token


def test_an_artifact_missing_a_hybrid_tensor_is_refused(tmp_path, converted):
    """The artifact layer checks the text component against the hybrid description."""
    from ninfer.artifact import TensorSource, write_artifact

    art = converted["qwen3_5_moe"]
    config = HybridConfig.from_json(art.config)
    header = {k: art.header[k] for k in ("metadata", "config", "tokenizer", "chat_template", "special_tokens",
                                        "generation")} | {"components": ["text"]}
    sources = [TensorSource(n, "text", art.tensor_info(n).dtype, shape, lambda n=n: np.array(art.tensor(n)))
               for n, shape in tensor_names(config).items() if n != "layers.3.q_norm"]
    with pytest.raises(ArtifactError, match="layers.3.q_norm"):
        write_artifact(tmp_path / "x.ninfer", header, sources)
