"""A real sticky CUDA error (GPU only): a kernel writes to an unmapped address inside a CudaRunner.

The context dies for the whole process, so the case runs in a subprocess: the next runner call
raises ``CudaError`` CUDA_ERROR_ILLEGAL_ADDRESS (sticky), every later call re-raises it at once
without touching the device, and ``close`` returns instead of failing or hanging.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import time
import numpy as np
from ninfer.backends.cuda import CudaRunner, runtime as rt
from ninfer.backends.cuda.random_weights import random_device_weights
from ninfer.backends.runner import DecodeBatch, SamplingRow
from ninfer.models.dense import DenseConfig

config = DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=2048, hidden_size=256, intermediate_size=384,
                     num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, qk_norm=True)
device = rt.Device(0)
weights, _ = random_device_weights(device, device.stream(), config)
runner = CudaRunner.from_device_weights(config, weights, device=device, num_pages=8, max_batch=1, max_context=128)
batch = DecodeBatch(lanes=[0], tokens=[5], positions=[3], page_tables=[[0]], sampling=[SamplingRow()])
print("before", int(runner.decode(batch).tokens[0]) >= 0)
unmapped = rt.DevicePtr(0x10, 1 << 20, "unmapped")
runner.kernels["fill_normal_f32"].launch((1,), (32,), (unmapped, 32, 0, 1.0, 0.0, 32, 0, 1.0), runner.stream)
try:
    runner.decode(batch)
except rt.CudaError as e:
    print("first", e.name, e.sticky)
t0 = time.perf_counter()
try:
    runner.decode(batch)
except rt.CudaError as e:
    print("again", e is runner.fault, round(time.perf_counter() - t0, 3) < 0.01)
runner.close()
print("closed")
"""


def test_sticky_error_latches_and_close_returns():
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = r.stdout.splitlines()
    assert lines == ["before True", "first CUDA_ERROR_ILLEGAL_ADDRESS True", "again True True", "closed"], \
        r.stdout + r.stderr[-3000:]
    assert "CUDA error CUDA_ERROR_ILLEGAL_ADDRESS in decode" in r.stderr  # the one log record
