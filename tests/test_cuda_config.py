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


class _Probe:
    """A workspace with a one-page pool, as ``auto_kv_pages`` receives it."""

    page_elems, kv_itemsize = 2 * 16 * 8 * 128, 2  # K and V of 16 tokens, 8 heads of 128, bf16
    workspace_bytes = (300 << 20) + 65536  # 300 MiB of activations and tables, then the one page

    def __init__(self):
        from ninfer.backends.cuda import runtime as rt

        self.arena = type("Arena", (), {"base": rt.DevicePtr(1 << 32, self.workspace_bytes, "workspace")})()


class _FreeDevice:
    def __init__(self, free):
        self.free_bytes, self.freed = free, []

    def free(self, ptr):
        self.freed.append(ptr)
        self.free_bytes += ptr.nbytes

    def free_memory(self):
        return self.free_bytes


def test_auto_kv_pages_leave_the_headroom_and_the_graphs_and_free_the_probe():
    probe, device = _Probe(), _FreeDevice(40 << 30)
    page = probe.page_elems * probe.kv_itemsize
    pages, ledger = runner.auto_kv_pages(device, probe, graphs=240)
    assert device.freed == [probe.arena.base]
    free = (40 << 30) + probe.workspace_bytes  # the probe's memory counts as free again
    left = free - (300 << 20) - pages * page - 240 * runner.GRAPH_BYTES_ESTIMATE
    assert runner.KV_HEADROOM_BYTES <= left < runner.KV_HEADROOM_BYTES + page  # the rest, to a page
    assert ledger == {"free_bytes": free, "workspace_without_kv": 300 << 20, "graph_reserve": 240 * runner.GRAPH_BYTES_ESTIMATE,
                      "headroom": runner.KV_HEADROOM_BYTES, "page_bytes": page, "pages": pages}


def test_auto_kv_pages_refuse_a_device_without_room():
    with pytest.raises(MemoryError, match="no room for a KV pool"):
        runner.auto_kv_pages(_FreeDevice(1 << 30), _Probe(), graphs=8)
