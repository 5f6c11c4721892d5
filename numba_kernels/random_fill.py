"""Normal random fill of device tensors: synthetic weights made on the GPU, with no file and no torch.

Element ``i`` of a tensor is ``shift + scale * z`` (times ``boost`` in the first ``boost_rows``
rows of ``row_len`` elements), where ``z`` is a standard normal drawn by Box-Muller from
``splitmix64(seed ^ i * golden)``: a pure function of ``(seed, i)``, so the values do not depend
on the grid, and the same seed gives the same tensor on every run.

Launch: grid ``(ceil(n / 256),)`` capped at a few thousand blocks (the loop strides over the rest),
block 256.
"""

from __future__ import annotations

import math

from numba import cuda, float32, int64, uint64

from numba_kernels.common import F32P, U16P, f32_to_bf16
from numba_kernels.sampling import GOLDEN, splitmix64

TWO_PI = float32(6.283185307179586)
INV_2_24 = float32(1.0 / 16777216.0)


@cuda.jit(device=True, inline=True)
def normal(seed, i):
    """A standard normal from 48 random bits: two 24-bit uniforms, u1 in (0, 1], u2 in [0, 1)."""
    x = splitmix64(seed ^ (uint64(i) * GOLDEN))
    u1 = (float32(x >> uint64(40)) + float32(1.0)) * INV_2_24
    u2 = float32((x >> uint64(16)) & uint64(0xFFFFFF)) * INV_2_24
    return math.sqrt(float32(-2.0) * math.log(u1)) * math.cos(TWO_PI * u2)


@cuda.jit(device=True, inline=True)
def value(i, seed, scale, shift, row_len, boost_rows, boost):
    v = shift + scale * normal(seed, i)
    if i // row_len < boost_rows:
        v = v * boost
    return v


def fill_normal_bf16(out, n, seed, scale, shift, row_len, boost_rows, boost):
    i = int64(cuda.grid(1))
    stride = int64(cuda.gridsize(1))
    while i < n:
        out[i] = f32_to_bf16(value(i, seed, scale, shift, row_len, boost_rows, boost))
        i += stride


def fill_normal_f32(out, n, seed, scale, shift, row_len, boost_rows, boost):
    i = int64(cuda.grid(1))
    stride = int64(cuda.gridsize(1))
    while i < n:
        out[i] = value(i, seed, scale, shift, row_len, boost_rows, boost)
        i += stride


_PARAMS = (int64, uint64, float32, float32, int64, int64, float32)
KERNELS = {
    "fill_normal_bf16": (fill_normal_bf16, (U16P, *_PARAMS)),
    "fill_normal_f32": (fill_normal_f32, (F32P, *_PARAMS)),
}
