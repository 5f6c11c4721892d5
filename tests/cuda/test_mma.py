"""The tensor-core intrinsics against NumPy: numba_kernels/mma.py (one warp, one 16x8 tile) and the
warpgroup MMAs of numba_kernels/wgmma.py (one q·Kᵀ from shared memory and one P·V with P from
registers and V MN-major, through the swizzled layouts and descriptors the prefill attention uses, so
a wrong layout or descriptor field shows up here first)."""

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


def test_wgmma_products_match_numpy(gpu):
    rng = np.random.default_rng(3)
    q, k, v = (from_float32(rng.standard_normal((64, 128)).astype(np.float32)) for _ in range(3))
    s_out, o_out = gpu.empty(64 * 64 * 4), gpu.empty(64 * 128 * 4)
    gpu.launch("wgmma_check", (1,), (128,), (s_out, o_out, *(gpu.put(a.view(np.uint32)) for a in (q, k, v))))
    s = gpu.get(s_out, np.float32, (64, 64))
    want_s = to_float32(q).astype(np.float64) @ to_float32(k).astype(np.float64).T
    np.testing.assert_allclose(s, want_s, rtol=1e-4, atol=1e-3)
    o = gpu.get(o_out, np.float32, (64, 128))
    p = to_float32(from_float32(s)).astype(np.float64)  # P is the kernel's own S rounded to bf16
    np.testing.assert_allclose(o, p @ to_float32(v).astype(np.float64), rtol=1e-4, atol=1e-2)
