"""Random weights made on the GPU (numba_kernels/random_fill.py) and ``--kv-capacity auto`` (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from ninfer.artifact.bf16 import to_float32  # noqa: E402
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow  # noqa: E402
from ninfer.models.dense import DenseConfig  # noqa: E402

SMALL = DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=2048, hidden_size=256, intermediate_size=384,
                    num_layers=3, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, qk_norm=True)


def _read(ptr, dtype, count):
    from ninfer.backends.cuda import runtime as rt

    out = np.empty(count, dtype)
    rt.check(rt.cu.cuMemcpyDtoH(out.ctypes.data, ptr.addr, out.nbytes), "cuMemcpyDtoH")
    return out


def test_random_weights_follow_their_roles_and_the_seed():
    from ninfer.backends.cuda import runtime as rt
    from ninfer.backends.cuda.random_weights import VISIBLE_BOOST, random_device_weights

    device = rt.Device(0)
    try:
        stream = device.stream()
        a, _ = random_device_weights(device, stream, SMALL, seed=5, visible_ids=100)
        b, _ = random_device_weights(device, stream, SMALL, seed=5, visible_ids=100)
        c, _ = random_device_weights(device, stream, SMALL, seed=6, visible_ids=100)
        n = SMALL.intermediate_size * 2 * SMALL.hidden_size
        gate_up = to_float32(_read(a["layers.0.gate_up"], np.uint16, n))
        assert np.array_equal(_read(a["layers.0.gate_up"], np.uint16, n), _read(b["layers.0.gate_up"], np.uint16, n))
        assert not np.array_equal(_read(a["layers.0.gate_up"], np.uint16, n), _read(c["layers.0.gate_up"], np.uint16, n))
        assert abs(gate_up.mean()) < 3e-3 and abs(gate_up.std() * SMALL.hidden_size ** 0.5 - 1) < 0.02
        norm = _read(a["layers.1.attn_norm"], np.float32, SMALL.hidden_size)
        assert abs(norm.mean() - 1) < 0.03 and abs(norm.std() - 0.1) < 0.02
        embed = to_float32(_read(a["embed"], np.uint16, SMALL.vocab_size * SMALL.hidden_size))
        assert abs(embed.std() - 1) < 0.01
        assert np.corrcoef(embed[:-1], embed[1:])[0, 1] < 0.01  # neighbours are independent
        head = to_float32(_read(a["lm_head"], np.uint16, SMALL.vocab_size * SMALL.hidden_size)).reshape(SMALL.vocab_size, -1)
        ratio = head[:100].std() / head[100:].std()
        assert abs(ratio - VISIBLE_BOOST) < 0.2
    finally:
        device.close()


def test_auto_kv_capacity_fills_the_device_and_runs():
    from ninfer.backends.cuda import CudaRunner
    from ninfer.backends.cuda import runtime as rt
    from ninfer.backends.cuda.random_weights import random_device_weights
    from ninfer.backends.cuda.runner import KV_HEADROOM_BYTES

    device = rt.Device(0)
    weights, _ = random_device_weights(device, device.stream(), SMALL, seed=1, visible_ids=1024)
    runner = CudaRunner.from_device_weights(SMALL, weights, device=device, page_size=16, num_pages="auto",
                                            max_batch=4, max_context=1024)
    try:
        s = runner.startup
        print("auto KV startup:", s)
        assert runner.info.num_pages == s["kv_auto"]["pages"] > 1000
        # What is left is the headroom, within the graph estimate's error.
        assert KV_HEADROOM_BYTES * 0.9 < s["free_bytes_after_startup"] < KV_HEADROOM_BYTES + s["kv_auto"]["graph_reserve"] + (256 << 20)
        last = runner.info.num_pages - 64  # pages at the far end of the pool hold KV too
        table = np.arange(last, last + 64, dtype=np.int32)
        out = runner.prefill(PrefillChunk(lane=0, tokens=np.arange(40, dtype=np.int32), start=0, page_table=table,
                                          sample=SamplingRow()))
        out = runner.decode(DecodeBatch(lanes=[0], tokens=out.tokens, positions=[40], page_tables=table[None],
                                        sampling=[SamplingRow()]))
        assert 0 <= int(out.tokens[0]) < SMALL.vocab_size
    finally:
        runner.close()
