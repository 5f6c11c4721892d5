"""Hybrid-model weights on the device: canonical names, the upload of ``weights.py``.

Matrices stay bf16 under their artifact names (``[out, in]``; MoE experts ``[E, out, in]``).
Everything else is widened to fp32: norms, ``dt_bias``, ``A_log`` and the small depthwise ``conv``
``[conv_dim, kernel]`` (read per channel by the conv kernel). The zero-centred RMSNorm weights
(``attn_norm``, ``mlp_norm``, ``final_norm``, ``q_norm``, ``k_norm``) are stored on the device as
``1 + w``, computed in fp32 at upload as the reference backend does at load, so the dense norm
kernels apply them unchanged; ``linear_norm`` (the gated norm) is a plain weight and stays as is.
Weights made elsewhere (``from_device_weights``) must follow the same convention.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ninfer.artifact.bf16 import to_float32
from ninfer.backends.cuda import runtime as rt
from ninfer.backends.cuda import weights as wt
from ninfer.models.hybrid import HybridConfig, tensor_names

F32_ROLES = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "linear_norm", "dt_bias", "A_log", "conv")
ONE_PLUS_ROLES = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm")


def _role(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def device_layout(config: HybridConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical name -> (shape, device dtype "bf16" | "f32")."""
    return {name: (shape, "f32" if _role(name) in F32_ROLES else "bf16")
            for name, shape in tensor_names(config).items()}


def device_form(get: Callable[[str], np.ndarray]) -> Callable[[str], np.ndarray]:
    """``get`` with the zero-centred norm weights turned into ``1 + w`` (fp32)."""

    def read(name: str) -> np.ndarray:
        array = get(name)
        if _role(name) not in ONE_PLUS_ROLES:
            return array
        values = to_float32(array) if array.dtype == np.uint16 else np.asarray(array, np.float32)
        return np.float32(1.0) + values

    return read


def upload(device: rt.Device, stream, config: HybridConfig,
           get: Callable[[str], np.ndarray]) -> tuple[dict[str, rt.DevicePtr], wt.UploadReport]:
    return wt.upload(device, stream, config, device_form(get), device_layout(config))


def check_device_weights(config: HybridConfig, tensors: Mapping[str, rt.DevicePtr]) -> None:
    wt.check_device_weights(config, tensors, device_layout(config))
