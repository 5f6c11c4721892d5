"""Rotary position embedding: inverse frequencies, the attention factor and cos/sin tables.

The formulas are Hugging Face's (``modeling_rope_utils``) for the scaling kinds our configs carry:
``none``, ``linear``, ``llama3`` and ``yarn``. They are computed in float64 and rounded once to
float32 in the tables, so the tables are the most accurate fp32 values of each angle.
The rotation is the "rotate half" form: dimension ``i`` pairs with ``i + head_dim / 2``.
"""

from __future__ import annotations

import math

import numpy as np

from ninfer.models.dense import DenseConfig, RopeScaling


def base_inverse_frequencies(theta: float, dim: int) -> np.ndarray:
    """float64 [dim / 2] unscaled inverse frequencies ``theta ** (-2i / dim)``."""
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _llama3(inv_freq: np.ndarray, s: RopeScaling, max_position: int) -> np.ndarray:
    old_context = s.original_max_position or max_position
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by the full factor, short ones kept; the band between
    # them blends the two linearly in 1/wavelength.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, blended, scaled)


def _yarn_correction_dim(rotations: float, dim: int, theta: float, max_position: int) -> float:
    """The dimension index whose wavelength completes ``rotations`` turns over ``max_position``."""
    return (dim * math.log(max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def _yarn(inv_freq: np.ndarray, s: RopeScaling, theta: float, dim: int, max_position: int) -> np.ndarray:
    original = s.original_max_position or max_position
    low = math.floor(_yarn_correction_dim(s.beta_fast, dim, theta, original))
    high = math.ceil(_yarn_correction_dim(s.beta_slow, dim, theta, original))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # 1 keeps the original frequency, 0 interpolates fully
    return (inv_freq / s.factor) * (1.0 - extrapolation) + inv_freq * extrapolation


def inverse_frequencies(config: DenseConfig) -> np.ndarray:
    """float64 [head_dim / 2] inverse frequencies after rope scaling."""
    s, dim = config.rope_scaling, config.head_dim
    inv_freq = base_inverse_frequencies(config.rope_theta, dim)
    if s.kind == "none":
        return inv_freq
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "llama3":
        return _llama3(inv_freq, s, config.max_position_embeddings)
    if s.kind == "yarn":
        return _yarn(inv_freq, s, config.rope_theta, dim, config.max_position_embeddings)
    raise ValueError(f"rope_scaling.kind {s.kind!r} is not supported (none, linear, llama3, yarn)")


def attention_factor(config: DenseConfig) -> float:
    """The factor HF multiplies into cos and sin (so q·k scales by its square); 1 except YaRN."""
    s = config.rope_scaling
    if s.kind != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    return 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0


def cos_sin_tables(inv_freq: np.ndarray, max_positions: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``scale * cos`` and ``scale * sin`` [max_positions, len(inv_freq)] of every angle."""
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(angles) * scale).astype(np.float32), (np.sin(angles) * scale).astype(np.float32)


def rope_tables(config: DenseConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin [max_positions, head_dim / 2], attention factor included."""
    return cos_sin_tables(inverse_frequencies(config), max_positions, attention_factor(config))


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x`` [rows, heads, head_dim] by per-row ``cos``/``sin`` [rows, head_dim / 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., :half] = x1 * c - x2 * s
    out[..., half:] = x2 * c + x1 * s
    return out
