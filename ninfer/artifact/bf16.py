"""bfloat16 as raw ``uint16`` bit patterns (the artifact's in-memory form; no ml_dtypes needed).

bf16 is the top half of an IEEE f32, so widening is a shift. Narrowing rounds to nearest, ties to
even, the rule PyTorch and the GPU conversion instructions use, so converted weights match theirs.
"""

from __future__ import annotations

import numpy as np


def to_float32(bits: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns (any shape, uint16) to float32 exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 bit patterns must be uint16, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def from_float32(values: np.ndarray) -> np.ndarray:
    """Narrow float32 (or anything castable to it) to bf16 bit patterns, round to nearest even.

    NaNs stay NaNs (quiet, sign kept); the rounding add could otherwise carry a NaN's payload
    into the exponent and turn it into infinity.
    """
    f = np.ascontiguousarray(values, dtype=np.float32)
    u = f.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases towards an even mantissa.
    # Done in place on one temporary: this runs over every weight of an f32/f16 checkpoint.
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u
    r >>= 16
    out = r.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return out
