"""The hybrid HF converter: config mapping, tensor round-trip, components, refusals.

Checkpoints are the transformers-made fixtures in tests/fixtures/hybrid (see
tools/make_hybrid_fixtures.py); every canonical tensor is checked against its source bits,
recomputed here from the checkpoint layout rather than through the converter's helpers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import numpy as np
import pytest

from ninfer.artifact import ArtifactError, open_artifact
from ninfer.artifact.bf16 import from_float32, to_float32
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
    # The registered sampler presets (spec: Server options): Qwen3.6 27B / 35B-A3B, Qwen3-Next's card.
    presets = {name: art.generation["presets"] for name, art in converted.items()}
    assert presets["qwen3_5"]["thinking"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                              "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert presets["qwen3_5"]["non_thinking"]["temperature"] == 0.7
    assert presets["qwen3_5"]["non_thinking"]["presence_penalty"] == 1.5
    assert presets["qwen3_5_moe"]["thinking"]["presence_penalty"] == 1.5
    assert presets["qwen3_next"]["thinking"]["temperature"] == 0.6


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


def weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, tuple[str, np.ndarray]]:
    """Random bf16 tensors, except that names ending ``norm.weight`` are f32 (values bf16 cannot hold)
    and ``.bias`` f16: tensors kept as they are must keep their dtype."""
    rng, out = np.random.default_rng(seed), {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        if name.endswith("norm.weight"):
            out[name] = ("F32", x)
        elif name.endswith(".bias"):
            out[name] = ("F16", x.astype(np.float16))
        else:
            out[name] = ("BF16", from_float32(x))
    return out


def mtp_weights(fused: bool, seed: int) -> dict[str, tuple[str, np.ndarray]]:
    """A one-layer MTP head of the tiny fixtures' shape (H 64, 4 experts of 32, shared 48), MoE MLP."""
    h, e, i = 64, 4, 32
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.layers.0.input_layernorm.weight": (h,),
              "mtp.layers.0.self_attn.q_proj.weight": (256, h), "mtp.layers.0.self_attn.o_proj.weight": (h, 128),
              "mtp.layers.0.mlp.gate.weight": (e, h), "mtp.layers.0.mlp.shared_expert.down_proj.weight": (h, 48),
              "mtp.layers.0.mlp.shared_expert_gate.weight": (1, h)}
    if fused:
        shapes |= {"mtp.layers.0.mlp.experts.gate_up_proj": (e, 2 * i, h),
                   "mtp.layers.0.mlp.experts.down_proj": (e, h, i)}
    else:
        for x in range(e):
            shapes |= {f"mtp.layers.0.mlp.experts.{x}.gate_proj.weight": (i, h),
                       f"mtp.layers.0.mlp.experts.{x}.up_proj.weight": (i, h),
                       f"mtp.layers.0.mlp.experts.{x}.down_proj.weight": (h, i)}
    return weights(shapes, seed)


VISION_SHAPES = {"model.visual.patch_embed.proj.weight": (16, 3, 2, 16, 16),
                 "model.visual.patch_embed.proj.bias": (16,), "model.visual.pos_embed.weight": (2304, 16),
                 "model.visual.blocks.0.norm1.weight": (16,), "model.visual.blocks.0.attn.qkv.weight": (48, 16),
                 "model.visual.merger.linear_fc2.weight": (64, 64)}


def assert_kept(art, extra: dict[str, tuple[str, np.ndarray]]) -> None:
    """Every vision / mtp source tensor is in its component with its name, shape, dtype and bits."""
    want = {("vision", "vision." + n[len("model.visual."):]) if n.startswith("model.visual.") else ("mtp", n): v
            for n, v in extra.items()}
    for component in ("vision", "mtp"):
        assert sorted(art.tensor_names(component)) == sorted(n for c, n in want if c == component)
    for (component, name), (dtype, array) in want.items():
        info = art.tensor_info(name)
        assert (info.component, info.dtype) == (component, dtype.lower())
        got = art.tensor(name)
        assert got.dtype == array.dtype
        np.testing.assert_array_equal(got, array)


def assert_same_text(art, base) -> None:
    assert art.tensor_names("text") == base.tensor_names("text")
    for name in base.tensor_names("text"):
        np.testing.assert_array_equal(art.tensor(name), base.tensor(name), err_msg=name)


def test_qwen3_5_moe_conditional_generation_checkpoint(tmp_path, converted):
    """Qwen3.6-35B-A3B's layout: the wrapper class with ``text_config`` nested, the text weights under
    ``model.language_model.*`` (``lm_head`` stays top level), a vision tower, and an MTP layer
    whose MLP is MoE. The text converts to the bits of the text-class fixture."""
    d = copy_fixture(tmp_path, "qwen3_5_moe")
    text = {k: v for k, v in json.loads((d / "config.json").read_text()).items()
            if k not in ("architectures", "dtype", "transformers_version")}
    text |= dict(model_type="qwen3_5_moe_text", mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    (d / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe", dtype="bfloat16",
        text_config=text, tie_word_embeddings=False, image_token_id=248056, video_token_id=248057,
        vision_start_token_id=248053, vision_end_token_id=248054,
        vision_config=dict(model_type="qwen3_5_moe", depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=64, in_channels=3, patch_size=16, temporal_patch_size=2,
                           spatial_merge_size=2, num_position_embeddings=2304))))
    extra = weights(VISION_SHAPES, seed=1) | mtp_weights(fused=True, seed=2)

    def wrap(t):
        for name in [n for n in t if n.startswith("model.")]:
            t["model.language_model." + name[len("model."):]] = t.pop(name)
        t.update(extra)
    rewrite(d, wrap)
    convert_hf(d, tmp_path / "cg.ninfer")
    base = converted["qwen3_5_moe"]
    with open_artifact(tmp_path / "cg.ninfer", components=None) as art:
        assert HybridConfig.from_json(art.config) == attrs.evolve(
            HybridConfig.from_json(base.config), architecture="Qwen3_5MoeForConditionalGeneration", mtp_num_layers=1)
        assert art.components == ("text", "mtp", "vision")
        assert "lm_head" in art.tensor_names("text")  # untied: the wrapper's tie_word_embeddings=false
        assert_same_text(art, base)
        assert_kept(art, extra)


def test_qwen3_next_mtp_layer_is_kept(tmp_path, converted):
    """Qwen3-Next's MTP head (``num_nextn_predict_layers``, experts per expert) becomes the ``mtp``
    component; the text is unchanged."""
    d = copy_fixture(tmp_path, "qwen3_next")
    cfg = json.loads((d / "config.json").read_text()) | dict(num_nextn_predict_layers=1)
    (d / "config.json").write_text(json.dumps(cfg))
    extra = mtp_weights(fused=False, seed=3)
    rewrite(d, lambda t: t.update(extra))
    convert_hf(d, tmp_path / "n.ninfer")
    with open_artifact(tmp_path / "n.ninfer", components=None) as art:
        assert HybridConfig.from_json(art.config).mtp_num_layers == 1
        assert art.components == ("text", "mtp")
        assert_same_text(art, converted["qwen3_next"])
        assert_kept(art, extra)


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
