"""The tensor-core intrinsics of numba_kernels/mma.py against NumPy (one warp, one 16x8 tile)."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer.artifact.bf16 import from_float32, to_float32

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu():
    from cuda_helpers import Gpu

    g = Gpu()
    yield g
    g.device.close()


def _run(gpu, a: np.ndarray, b: np.ndarray, split: int) -> np.ndarray:
    a_bits = from_float32(a).view(np.uint32)  # 16 x 16 bf16 = 128 packed pairs, row-major
    out = gpu.empty(16 * 8 * 4)
    gpu.launch("mma_check", (1,), (32,), (out, gpu.put(a_bits), gpu.put(np.ascontiguousarray(b.T)), split))
    return gpu.get(out, np.float32, (16, 8))


def test_mma_fragment_layout_is_exact_on_bf16_inputs(gpu):
    rng = np.random.default_rng(0)
    a = to_float32(from_float32(rng.standard_normal((16, 16)).astype(np.float32)))
    b = to_float32(from_float32(rng.standard_normal((16, 8)).astype(np.float32)))
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(_run(gpu, a, b, 0), want, rtol=0, atol=1e-5)


def test_split_activations_keep_fp32_precision(gpu):
    rng = np.random.default_rng(1)
    a = to_float32(from_float32(rng.standard_normal((16, 16)).astype(np.float32)))
    b = rng.standard_normal((16, 8)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    plain = np.abs(_run(gpu, a, b, 0) - want).max()
    split = np.abs(_run(gpu, a, b, 1) - want).max()
    assert split < 1e-4 * np.abs(want).max()
    assert split < plain / 50  # the bf16-rounded B is visibly worse; the split recovers it
