"""The CUDA runner's architecture gate runs before any device work, so it is checked on the CPU."""

import json
from pathlib import Path

import attrs
import pytest

runner = pytest.importorskip("ninfer.backends.cuda.runner")

FIXTURES = Path(__file__).parent / "fixtures"


def test_a_hybrid_artifact_config_is_refused_by_name():
    config = json.loads(next((FIXTURES / "hybrid").glob("*/config.json")).read_text())
    hybrid = {"architecture": config["architectures"][0], **{k: v for k, v in config.items() if k != "architectures"}}
    with pytest.raises(ValueError, match="the CUDA backend runs .*not 'Qwen3"):
        runner._dense_config(hybrid)


def test_a_dense_config_passes():
    from ninfer.models import DenseConfig

    dense = DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32,
                        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6,
                        rope_theta=1e4, qk_norm=True)
    assert runner._dense_config(dense.to_json()) == dense


def test_a_vocabulary_past_the_sampler_is_refused_by_name():
    from ninfer.backends.cuda.forward import SAMPLE_MAX_VOCAB, check_supported
    from ninfer.models import DenseConfig

    big = DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=SAMPLE_MAX_VOCAB + 1, hidden_size=16,
                      intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64,
                      rms_norm_eps=1e-6, rope_theta=1e4, qk_norm=True)
    with pytest.raises(ValueError, match="vocab_size of at most 262144"):
        check_supported(big, "bf16")
    check_supported(attrs.evolve(big, vocab_size=SAMPLE_MAX_VOCAB), "bf16")
