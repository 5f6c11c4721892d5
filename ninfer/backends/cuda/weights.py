"""Model weights on the device: one allocation, filled from the artifact through pinned staging.

Matrices stay bf16 (``uint16`` bit patterns, ``[out, in]`` as in the artifact); norm weights and
biases are widened to fp32 on the host first (they are tiny, and the kernels read them as fp32).
Upload streams each tensor from the mmap through two pinned buffers in turn, so the copy of one
buffer overlaps the host filling the other; ``UploadReport`` gives the achieved GB/s.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import attrs
import numpy as np

from ninfer.artifact.bf16 import to_float32
from ninfer.backends.cuda import runtime as rt
from ninfer.models.dense import DenseConfig, tensor_names

STAGING_BYTES = 64 << 20
MATRIX_ROLES = ("embed", "qkv", "o", "gate_up", "down", "lm_head")


@attrs.frozen
class UploadReport:
    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def is_matrix(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in MATRIX_ROLES


def device_layout(config: DenseConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical name -> (shape, device dtype "bf16" | "f32")."""
    return {name: (shape, "bf16" if is_matrix(name) else "f32")
            for name, shape in tensor_names(config).items()}


def _host_form(name: str, array: np.ndarray, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"tensor {name}: shape {tuple(array.shape)}, expected {tuple(shape)}")
    if kind == "bf16":
        if array.dtype != np.uint16:
            raise ValueError(f"tensor {name}: the CUDA backend runs bf16 matrices, the artifact has "
                             f"{array.dtype} (convert with --dtype bf16)")
        return array
    if array.dtype == np.uint16:
        return to_float32(array)
    return np.asarray(array, dtype=np.float32)


def upload(device: rt.Device, stream, config: DenseConfig, get: Callable[[str], np.ndarray],
           layout: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
           ) -> tuple[dict[str, rt.DevicePtr], UploadReport]:
    """``layout``: name -> (shape, "bf16" | "f32"); ``device_layout(config)`` unless given (hybrids)."""
    layout = device_layout(config) if layout is None else layout
    sizes = {name: int(np.prod(shape)) * (2 if kind == "bf16" else 4) for name, (shape, kind) in layout.items()}
    total = sum(-(-n // 256) * 256 for n in sizes.values())
    arena = rt.Arena(device.alloc(total, "weights"))
    staging = [device.pinned(STAGING_BYTES), device.pinned(STAGING_BYTES)]
    done = [device.event(), device.event()]
    pending = [False, False]
    which = 0
    tensors: dict[str, rt.DevicePtr] = {}
    start = time.perf_counter()
    for name, (shape, kind) in layout.items():
        flat = np.ascontiguousarray(_host_form(name, get(name), shape, kind)).reshape(-1).view(np.uint8)
        dst = tensors[name] = arena.take(sizes[name], name)
        for offset in range(0, flat.nbytes, STAGING_BYTES):
            piece = flat[offset:offset + STAGING_BYTES]
            if pending[which]:  # the previous copy out of this buffer must have finished
                rt.check(rt.cu.cuEventSynchronize(done[which]), "cuEventSynchronize")
            buf = staging[which][:piece.nbytes]
            buf[:] = piece
            rt.copy_h2d(dst.at(offset, piece.nbytes), buf, stream)
            rt.check(rt.cu.cuEventRecord(done[which], stream), "cuEventRecord")
            pending[which] = True
            which ^= 1
    rt.synchronize(stream)
    return tensors, UploadReport(total, time.perf_counter() - start)


def check_device_weights(config: DenseConfig, tensors: Mapping[str, rt.DevicePtr],
                         layout: Mapping[str, tuple[tuple[int, ...], str]] | None = None) -> None:
    """Weights made elsewhere (e.g. random on the GPU by the benchmark) must match the layout."""
    for name, (shape, kind) in (device_layout(config) if layout is None else layout).items():
        if name not in tensors:
            raise ValueError(f"device weights lack tensor {name}")
        need = int(np.prod(shape)) * (2 if kind == "bf16" else 4)
        if tensors[name].nbytes < need:
            raise ValueError(f"device tensor {name}: {tensors[name].nbytes} bytes, needs {need} ({kind} {shape})")
