"""Context-cost presets keyed by model signature: the signature a runner's config and KV dtype
give, and which preset entries an Engine over a real artifact selects."""

from __future__ import annotations

import json
import logging

import attrs
import pytest

from ninfer.backends.reference import ReferenceRunner
from ninfer.convert.random_model import make_random_artifact
from ninfer.engine import Engine, EngineConfig
from ninfer.engine.context_cost import GENERIC_PREFILL_SECONDS_PER_TOKEN, GENERIC_TRANSFER_SECONDS_PER_BYTE, load
from ninfer.engine.errors import ContextCostPresetsError
from ninfer.engine.signature import model_signature, signature_of
from ninfer.models.dense import DenseConfig


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("cost") / "tiny.ninfer"
    make_random_artifact(path, "tiny-qwen3", seed=5)
    return str(path)


def runner(artifact, **kw):
    sizes = dict(page_size=16, num_pages=8, max_batch=1, max_context=128)
    sizes.update(kw)
    return ReferenceRunner(artifact, **sizes)


def test_the_signature_names_architecture_shapes_and_kv_dtype(artifact):
    r = runner(artifact)
    sig = model_signature(r)
    c = r.config
    assert sig.startswith(f"{c.architecture}-h{c.hidden_size}-l{c.num_layers}-float32-")
    assert len(sig.rsplit("-", 1)[1]) == 12
    # Stable: another runner over the same model, with other pool sizes, has the same one.
    assert model_signature(runner(artifact, num_pages=16, max_batch=2, max_context=64)) == sig
    config = attrs.asdict(c)
    assert signature_of(config, "float32") == sig
    # Numerics and the context setting do not change the cost of a token; shapes and dtype do.
    assert signature_of(dict(config, rope_theta=1.0, rms_norm_eps=1e-3, max_position_embeddings=9), "float32") == sig
    assert signature_of(dict(config, intermediate_size=c.intermediate_size * 2), "float32") != sig
    assert signature_of(dict(config, num_kv_heads=1), "float32") != sig
    assert signature_of(config, "bfloat16") != sig


def test_a_runner_without_a_model_config_has_no_signature():
    class Bare:
        pass

    assert model_signature(Bare()) is None
    cost = load(None, "simulated", None)
    assert cost.source == "generic (hardware simulated, model signature unknown)"


def write(tmp_path, data) -> str:
    path = tmp_path / "presets.json"
    path.write_text(json.dumps(data))
    return str(path)


async def test_a_preset_keyed_by_this_models_signature_is_selected(artifact, tmp_path, caplog):
    sig = model_signature(runner(artifact))
    presets = write(tmp_path, {
        "transfer": [{"hardware": "reference", "seconds_per_byte": 1e-9}],
        "prefill": [{"hardware": "reference", "seconds_per_token": 1e-3},
                    {"hardware": "reference", "model": sig, "seconds_per_token": 4e-3},
                    {"model": "Qwen3ForCausalLM-h4096-l36-bfloat16-000000000000", "seconds_per_token": 9e-3}]})
    cfg = EngineConfig(max_context=128, context_cost_presets=presets)
    with caplog.at_level(logging.INFO, logger="ninfer.engine"):
        async with Engine.open(artifact, cfg) as engine:
            source = engine.stats().context_cost_source
            cost = engine._core.cost
    assert (cost.transfer_seconds_per_byte, cost.prefill_seconds_per_token) == (1e-9, 4e-3)
    assert source == f"{presets}: transfer[0], prefill[1] (hardware reference, model {sig})"
    assert f"context cost: {source}" in caplog.text


async def test_a_preset_for_another_model_is_not_selected(artifact, tmp_path):
    sig = model_signature(runner(artifact))
    other = sig[:-12] + ("0" * 12 if not sig.endswith("0" * 12) else "1" * 12)  # same name, other shapes
    presets = write(tmp_path, {"prefill": [{"hardware": "reference", "model": other, "seconds_per_token": 4e-3},
                                           {"hardware": "cuda", "model": "*", "seconds_per_token": 5e-3}]})
    async with Engine.open(artifact, EngineConfig(max_context=128, context_cost_presets=presets)) as engine:
        source = engine.stats().context_cost_source
        cost = engine._core.cost
    assert (cost.transfer_seconds_per_byte, cost.prefill_seconds_per_token) == (
        GENERIC_TRANSFER_SECONDS_PER_BYTE, GENERIC_PREFILL_SECONDS_PER_TOKEN)
    assert source == f"{presets}: no matching entry (generic) (hardware reference, model {sig})"


def test_an_empty_model_key_is_refused(tmp_path):
    presets = write(tmp_path, {"prefill": [{"model": "", "seconds_per_token": 1e-3}]})
    with pytest.raises(ContextCostPresetsError, match=r"prefill\[0\]: hardware and model must be non-empty"):
        load(presets, "reference", None)


def test_the_dense_config_fields_the_signature_counts_exist():
    # The signature's readable part names these fields; a rename would silently make it "h?".
    fields = attrs.fields_dict(DenseConfig)
    assert {"architecture", "hidden_size", "num_layers"} <= set(fields)


def test_compiled_defaults_match_the_measured_shape_and_yield_to_the_file(tmp_path):
    """Spec: coefficients resolve from generic defaults, matching compiled values, then the file. The
    compiled prefill value belongs to the CUDA runner's Qwen3-8B shape (the preset the measurement ran);
    the compiled transfer value to the CUDA backend, any model."""
    from ninfer.convert.random_model import LARGE_PRESETS
    from ninfer.engine.context_cost import COMPILED_PREFILL, COMPILED_TRANSFER

    sig = signature_of(attrs.asdict(LARGE_PRESETS["qwen3-8b"], recurse=True), "bfloat16")
    assert ("cuda", sig) in COMPILED_PREFILL
    cost = load(None, "cuda", sig)
    assert cost.prefill_seconds_per_token == COMPILED_PREFILL["cuda", sig]
    assert cost.transfer_seconds_per_byte == COMPILED_TRANSFER["cuda"] != GENERIC_TRANSFER_SECONDS_PER_BYTE
    assert cost.source == f"compiled transfer, compiled prefill (hardware cuda, model {sig})"
    assert load(None, "reference", sig).transfer_seconds_per_byte == GENERIC_TRANSFER_SECONDS_PER_BYTE
    # Another model, or the same shape on another backend or KV dtype, keeps the generic value.
    for hardware, model in (("cuda", signature_of(attrs.asdict(LARGE_PRESETS["qwen3-8b"]), "float32")),
                            ("reference", sig), ("cuda", None)):
        assert load(None, hardware, model).prefill_seconds_per_token == GENERIC_PREFILL_SECONDS_PER_TOKEN
    presets = write(tmp_path, {"prefill": [{"hardware": "cuda", "seconds_per_token": 1e-4}]})
    cost = load(presets, "cuda", sig)
    assert cost.prefill_seconds_per_token == 1e-4
    assert cost.source == f"{presets}: prefill[0], compiled transfer (hardware cuda, model {sig})"
    assert load(write(tmp_path, {}), "cuda", sig).source == (
        f"{tmp_path / 'presets.json'}: no matching entry (compiled transfer, compiled prefill) (hardware cuda, model {sig})")
