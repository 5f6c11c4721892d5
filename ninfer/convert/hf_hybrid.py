"""Convert Qwen3-Next / Qwen3.5 / Qwen3.5-MoE checkpoints (Hugging Face layout) into artifacts.

The text backbone becomes the ``text`` component under the canonical names of
``ninfer.models.hybrid``. Two checkpoint facts are normalised here, once:

- Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` are grouped per key head (``[q_g k_g v_g z_g]``
  for each group ``g``, and ``[b_g a_g]``); Qwen3.5 stores contiguous ``in_proj_qkv`` / ``_z`` /
  ``_b`` / ``_a``. Both become one ``in_proj`` with rows q | k | v | z | b | a.
- MoE experts come per expert (``experts.{e}.gate_proj``...) or fused (``experts.gate_up_proj``
  ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``); both become the fused form.

Tensors the text model does not run are kept, not dropped: ``model.visual.*`` as the ``vision``
component (named ``vision.<rest>``) and ``mtp.*`` as the ``mtp`` component (names unchanged), both
with their source shapes and dtypes, for the vision and speculative-decoding work that reads them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.artifact import TensorSource, write_artifact
from ninfer.convert.errors import ConversionError
from ninfer.convert.hf_checkpoint import CheckpointWeights
from ninfer.convert.fields import Fields
from ninfer.convert.hf_config import config_fields, head_dim_of, single_architecture
from ninfer.models.hybrid import (
    ARCHITECTURES, DENSE, FULL, LINEAR, MOE, HybridConfig, tensor_dtype, tensor_names,
)

def _preset(temperature: float, top_p: float, presence_penalty: float) -> dict[str, float]:
    return {"temperature": temperature, "top_p": top_p, "top_k": 20, "min_p": 0.0,
            "presence_penalty": presence_penalty, "frequency_penalty": 0.0}


# Sampler presets by architecture and thinking mode: the spec's registered values for the Qwen3.6
# models (the dense 27B; the 35B-A3B MoE also penalises presence when thinking), the Qwen3-Next
# model card's for Qwen3-Next.
_QWEN3_NEXT = {"thinking": _preset(0.6, 0.95, 0.0), "non_thinking": _preset(0.7, 0.8, 0.0)}
_QWEN3_6 = {"thinking": _preset(1.0, 0.95, 0.0), "non_thinking": _preset(0.7, 0.8, 1.5)}
_QWEN3_6_MOE = {"thinking": _preset(1.0, 0.95, 1.5), "non_thinking": _preset(0.7, 0.8, 1.5)}
PRESETS = {
    "Qwen3NextForCausalLM": _QWEN3_NEXT,
    "Qwen3_5ForConditionalGeneration": _QWEN3_6, "Qwen3_5ForCausalLM": _QWEN3_6,
    "Qwen3_5MoeForConditionalGeneration": _QWEN3_6_MOE, "Qwen3_5MoeForCausalLM": _QWEN3_6_MOE,
}


# -- config.json ------------------------------------------------------------------------------

def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: ``text_config`` of the multimodal classes, else the top level."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    merged = dict(config_fields(cfg).section("text_config").data)  # refuses a text_config that is no object
    if "tie_word_embeddings" in cfg:  # the wrapper's value is the one transformers applies
        merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return merged


def _text_fields(cfg: dict[str, Any]) -> Fields:
    """The text model's fields, named as config.json spells them (``text_config.hidden_size``)."""
    prefix = "" if cfg.get("text_config") is None else "text_config."
    return Fields(_text_config(cfg), "config.json", prefix)


def _rope(cfg: Fields, head_dim: int) -> tuple[float, int, list[int] | None]:
    """(theta, rotary_dim, mrope_section); only unscaled RoPE is described by these models."""
    params, scaling = cfg.section("rope_parameters"), cfg.section("rope_scaling")
    kind = params.string("rope_type", scaling.string("rope_type", scaling.string("type", "default")))
    # "mrope" (the Qwen2-VL spelling) is unscaled multi-axis RoPE: for text it is the default.
    if kind not in ("default", "mrope"):
        raise ConversionError(f"config.json: rope type {kind!r} is not supported for hybrid models "
                              f"(only the default)")
    theta = params.positive("rope_theta", cfg.positive("rope_theta", 10000.0))
    factor = params.positive("partial_rotary_factor", cfg.positive("partial_rotary_factor", 0.25))
    section = params.integers("mrope_section", scaling.integers("mrope_section", None))
    return theta, int(head_dim * factor), section


def _layer_types(cfg: Fields, layers: int) -> list[str]:
    types = cfg.strings("layer_types", None)
    if types is None:
        interval = cfg.integer("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % interval else FULL for i in range(layers)]
    if len(types) != layers:
        raise ConversionError(f"config.json: layer_types lists {len(types)} layers, num_hidden_layers is {layers}")
    return list(types)


def _mlp_types(architecture: str, cfg: Fields, layers: int) -> list[str]:
    if architecture.startswith("Qwen3_5Moe"):
        return [MOE] * layers
    if architecture.startswith("Qwen3_5"):
        return [DENSE] * layers
    # Qwen3-Next: MoE where num_experts > 0 and (i + 1) % decoder_sparse_step == 0, unless listed
    # in mlp_only_layers (transformers' Qwen3NextDecoderLayer).
    experts = cfg.integer("num_experts", 0, minimum=0)
    step = cfg.integer("decoder_sparse_step", 1)
    only = set(cfg.integers("mlp_only_layers", []))
    return [MOE if experts > 0 and (i + 1) % step == 0 and i not in only else DENSE for i in range(layers)]


def architecture_of(cfg: dict[str, Any]) -> str | None:
    """The hybrid architecture named by ``config.json``, or None when it names another family."""
    architecture = single_architecture(cfg)
    return architecture if architecture in ARCHITECTURES else None


def _moe_fields(text: Fields, mlp_types: list[str]) -> dict[str, int]:
    """The MoE sizes, required where a layer is MoE (0 otherwise, as the model description wants)."""
    if MOE not in mlp_types:
        return {}
    return {"num_experts": text.integer("num_experts"),
            "num_experts_per_tok": text.integer("num_experts_per_tok"),
            "moe_intermediate_size": text.integer("moe_intermediate_size"),
            "shared_expert_intermediate_size": text.integer("shared_expert_intermediate_size", 0, minimum=0)}


def hybrid_config_from_hf(cfg: dict[str, Any]) -> HybridConfig:
    config_fields(cfg)  # a config.json that is no object stops here
    architecture = architecture_of(cfg)
    if architecture is None:
        raise ConversionError(f"config.json: {cfg.get('architectures')!r} is not a hybrid architecture "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    text = _text_fields(cfg)
    act = text.string("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    if text.boolean("attention_bias", False):
        raise ConversionError("config.json: attention_bias=true is not supported for hybrid models")
    layers = text.integer("num_hidden_layers")
    hidden = text.integer("hidden_size")
    heads = text.integer("num_attention_heads")
    head_dim = head_dim_of(text, hidden, heads)
    theta, rotary_dim, section = _rope(text, head_dim)
    mlp_types = _mlp_types(architecture, text, layers)
    try:
        return HybridConfig(
            architecture=architecture,
            vocab_size=text.integer("vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            layer_types=_layer_types(text, layers),
            mlp_types=mlp_types,
            rms_norm_eps=text.positive("rms_norm_eps", 1e-6),
            num_heads=heads,
            num_kv_heads=text.integer("num_key_value_heads", heads),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=theta,
            max_position_embeddings=text.integer("max_position_embeddings", 32768),
            linear_num_k_heads=text.integer("linear_num_key_heads"),
            linear_num_v_heads=text.integer("linear_num_value_heads"),
            linear_k_head_dim=text.integer("linear_key_head_dim"),
            linear_v_head_dim=text.integer("linear_value_head_dim"),
            conv_kernel=text.integer("linear_conv_kernel_dim", 4),
            intermediate_size=text.integer("intermediate_size") if DENSE in mlp_types else 0,
            **_moe_fields(text, mlp_types),
            # Qwen3.5-MoE's router always renormalises the top-k (its config has no such field).
            norm_topk_prob=text.boolean("norm_topk_prob", True),
            tie_word_embeddings=text.boolean("tie_word_embeddings", False),
            mtp_num_layers=text.integer("mtp_num_hidden_layers",
                                        text.integer("num_nextn_predict_layers", 0, minimum=0), minimum=0),
            mrope_section=section,
        )
    except ValueError as exc:
        raise ConversionError(f"config.json: {exc}") from exc


# -- tensors ------------------------------------------------------------------------------------

class _Plan:
    """The checkpoint, its key prefix and the source tensors used so far (each looked up with checks)."""

    def __init__(self, config: HybridConfig, weights: CheckpointWeights):
        self.config = config
        self.weights = weights
        self.used: set[str] = set()
        names = set(weights.names())
        self.prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in names else "model."

    def src(self, name: str, shape: tuple[int, ...] | None = None) -> str:
        """``name`` after checking it is a float weight of ``shape``; marks it used."""
        info = self.weights.checked(name, f"by {self.config.architecture}")
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise ConversionError(f"{self.weights.directory}: tensor {name!r} has shape {list(info.shape)}, "
                                  f"expected {list(shape)}")
        self.used.add(name)
        return name

def _layer_loader(plan: _Plan, canonical: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    c = plan.config
    _, index, suffix = canonical.split(".", 2)
    layer = int(index)
    p = f"{plan.prefix}layers.{layer}."
    h = c.hidden_size
    if suffix == "attn_norm":
        return _rows(plan, [plan.src(p + "input_layernorm.weight", shape)])
    if suffix == "mlp_norm":
        return _rows(plan, [plan.src(p + "post_attention_layernorm.weight", shape)])
    if suffix == "in_proj":
        return _in_proj(plan, p + "linear_attn.")
    if suffix == "conv":
        name = plan.src(p + "linear_attn.conv1d.weight", (c.conv_dim, 1, c.conv_kernel))
        return lambda: plan.weights.bf16(name).reshape(c.conv_dim, c.conv_kernel)
    if suffix in ("dt_bias", "A_log"):
        name = plan.src(p + f"linear_attn.{suffix}", shape)
        return lambda: plan.weights.f32(name)
    if suffix == "linear_norm":
        return _rows(plan, [plan.src(p + "linear_attn.norm.weight", shape)])
    if suffix == "out":
        return _rows(plan, [plan.src(p + "linear_attn.out_proj.weight", shape)])
    if suffix == "qkv":
        a = p + "self_attn."
        return _rows(plan, [plan.src(a + "q_proj.weight", (2 * c.q_size, h)),
                            plan.src(a + "k_proj.weight", (c.kv_size, h)),
                            plan.src(a + "v_proj.weight", (c.kv_size, h))])
    if suffix in ("q_norm", "k_norm", "o"):
        source = {"q_norm": "q_norm.weight", "k_norm": "k_norm.weight", "o": "o_proj.weight"}[suffix]
        return _rows(plan, [plan.src(p + "self_attn." + source, shape)])
    return _mlp_loader(plan, p + "mlp.", suffix, shape)


def _mlp_loader(plan: _Plan, m: str, suffix: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    c = plan.config
    h = c.hidden_size
    if suffix == "gate_up":
        i = c.intermediate_size
        return _rows(plan, [plan.src(m + "gate_proj.weight", (i, h)), plan.src(m + "up_proj.weight", (i, h))])
    if suffix == "down":
        return _rows(plan, [plan.src(m + "down_proj.weight", shape)])
    if suffix == "router":
        return _rows(plan, [plan.src(m + "gate.weight", shape)])
    if suffix == "shared.gate_up":
        s = c.shared_expert_intermediate_size
        return _rows(plan, [plan.src(m + "shared_expert.gate_proj.weight", (s, h)),
                            plan.src(m + "shared_expert.up_proj.weight", (s, h))])
    if suffix == "shared.down":
        return _rows(plan, [plan.src(m + "shared_expert.down_proj.weight", shape)])
    if suffix == "shared_gate":
        return _rows(plan, [plan.src(m + "shared_expert_gate.weight", shape)])
    if suffix in ("experts.gate_up", "experts.down"):
        return _experts(plan, m + "experts.", suffix.split(".")[1], shape)
    raise AssertionError(f"no source mapping for {suffix!r}")


def _rows(plan: _Plan, names: list[str]) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        parts = [plan.weights.bf16(n) for n in names]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    return load


def _in_proj(plan: _Plan, a: str) -> Callable[[], np.ndarray]:
    c = plan.config
    h, nk, nv = c.hidden_size, c.linear_num_k_heads, c.linear_num_v_heads
    if a + "in_proj_qkvz.weight" in plan.weights.where:
        qkvz = plan.src(a + "in_proj_qkvz.weight", (2 * c.key_dim + 2 * c.value_dim, h))
        ba = plan.src(a + "in_proj_ba.weight", (2 * nv, h))

        def load_grouped() -> np.ndarray:
            dk, r_dv, r = c.linear_k_head_dim, (nv // nk) * c.linear_v_head_dim, nv // nk
            g = plan.weights.bf16(qkvz).reshape(nk, 2 * dk + 2 * r_dv, h)
            q, k, v, z = np.split(g, np.cumsum([dk, dk, r_dv]), axis=1)
            g = plan.weights.bf16(ba).reshape(nk, 2 * r, h)
            b, a_ = g[:, :r], g[:, r:]
            # Concatenating the groups in order gives head g*r + j at row block g*r + j, which is
            # how transformers reshapes [.., nk, r*dv] into [.., nv, dv].
            return np.concatenate([x.reshape(-1, h) for x in (q, k, v, z, b, a_)], axis=0)
        return load_grouped
    return _rows(plan, [plan.src(a + "in_proj_qkv.weight", (c.conv_dim, h)),
                        plan.src(a + "in_proj_z.weight", (c.value_dim, h)),
                        plan.src(a + "in_proj_b.weight", (nv, h)),
                        plan.src(a + "in_proj_a.weight", (nv, h))])


def _experts(plan: _Plan, e: str, which: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    c = plan.config
    h, i = c.hidden_size, c.moe_intermediate_size
    fused = e + ("gate_up_proj" if which == "gate_up" else "down_proj")
    if fused in plan.weights.where:
        name = plan.src(fused, shape)
        return lambda: plan.weights.bf16(name)
    if which == "gate_up":
        per = [(plan.src(f"{e}{x}.gate_proj.weight", (i, h)), plan.src(f"{e}{x}.up_proj.weight", (i, h)))
               for x in range(c.num_experts)]
        return lambda: np.stack([np.concatenate([plan.weights.bf16(g), plan.weights.bf16(u)]) for g, u in per])
    per_down = [plan.src(f"{e}{x}.down_proj.weight", (h, i)) for x in range(c.num_experts)]
    return lambda: np.stack([plan.weights.bf16(d) for d in per_down])


def _global_loader(plan: _Plan, canonical: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    source = {"embed": plan.prefix + "embed_tokens.weight", "final_norm": plan.prefix + "norm.weight",
              "lm_head": "lm_head.weight"}[canonical]
    return _rows(plan, [plan.src(source, shape)])


# Source dtype -> artifact dtype of the tensors kept as they are (the float dtypes ``src`` accepts).
_KEPT_DTYPES = {"BF16": "bf16", "F16": "f16", "F32": "f32"}


def _extra_components(plan: _Plan) -> list[TensorSource]:
    """``vision`` and ``mtp`` tensors, kept bit for bit in their source shape and dtype (no text
    model reads them yet, so no runtime layout applies)."""
    out = []
    for name in plan.weights.names():
        if name.startswith("model.visual."):
            component, canonical = "vision", "vision." + name[len("model.visual."):]
        elif name.startswith("mtp."):
            component, canonical = "mtp", name
        else:
            continue
        info = plan.weights.info(plan.src(name))
        out.append(TensorSource(canonical, component, _KEPT_DTYPES[info.dtype], tuple(info.shape),
                                lambda name=name: plan.weights.get(name)))
    return out


def plan_sources(config: HybridConfig, weights: CheckpointWeights) -> list[TensorSource]:
    plan = _Plan(config, weights)
    sources = []
    for canonical, shape in tensor_names(config).items():
        if canonical.startswith("layers."):
            load = _layer_loader(plan, canonical, shape)
        else:
            load = _global_loader(plan, canonical, shape)
        sources.append(TensorSource(canonical, "text", tensor_dtype(canonical), shape, load))
    sources.extend(_extra_components(plan))
    weights.refuse_unknown(plan.used, config.architecture, config.tie_word_embeddings)
    return sources


def convert_hf_hybrid(directory: Path, cfg: dict[str, Any], out: str | os.PathLike[str], progress=None
                      ) -> dict[str, Any]:
    from ninfer.convert.hf import header_fields  # the shared header: tokenizer, template, specials

    config = hybrid_config_from_hf(cfg)
    weights = CheckpointWeights(directory)
    sources = plan_sources(config, weights)
    merged = _text_config(cfg) | cfg
    merged.setdefault("torch_dtype", cfg.get("dtype"))  # transformers 5 writes "dtype"
    fields = header_fields(directory, merged, config, weights)
    fields["components"] = ["text"] + sorted({s.component for s in sources} - {"text"})
    if not fields["generation"]["presets"]:
        fields["generation"]["presets"] = PRESETS[config.architecture]
    return write_artifact(out, fields, sources, progress=progress)
