"""The warpgroup MMA intrinsics (numba_kernels/wgmma.py) against NumPy (GPU only): one q·Kᵀ from shared
memory and one P·V with P from registers and V MN-major, through the swizzled layouts and descriptors
the tensor-core prefill attention uses, so a wrong layout or descriptor field shows up here first."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from ninfer.artifact.bf16 import from_float32, to_float32  # noqa: E402


@pytest.fixture(scope="module")
def gpu():
    from cuda_helpers import Gpu

    g = Gpu()
    yield g
    g.device.close()


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
