"""StateImages of the CUDA hybrid runner: every slot in device memory, one contiguous block each.

A slot's block is the host form of ``ninfer.backends.reference.hybrid_state`` exactly: for each
DeltaNet layer in layer order its conv tail ``[kernel - 1, conv_dim]`` then its delta-rule state
``[v_heads, k_head_dim, v_head_dim]``, float32. So ``read`` / ``write`` are one copy through pinned
staging, ``copy`` one device-to-device copy and ``clear`` one memset; the kernels address layer
``l`` of slot ``s`` as ``base + s * floats + layer_offset(l)``.

Slots ``0 .. max_batch - 1`` are the lanes' live states; the rest hold checkpoints. ``length``
(host side) records how many tokens each image summarises, -1 when unknown (written from the
host without a length), as the reference runner does.
"""

from __future__ import annotations

import numpy as np

from ninfer.backends.cuda import runtime as rt
from ninfer.models.hybrid import HybridConfig


def layer_offsets(config: HybridConfig) -> dict[int, int]:
    """DeltaNet layer index -> float offset of its conv tail inside one StateImage."""
    return {layer: i * config.state_floats_per_layer for i, layer in enumerate(config.linear_layers)}


class DeviceStates:
    def __init__(self, device: rt.Device, block: rt.DevicePtr, config: HybridConfig, slots: int):
        self.floats = config.state_floats
        if block.nbytes < slots * self.floats * 4:
            raise ValueError(f"{block.label}: {block.nbytes} bytes hold fewer than {slots} StateImages")
        self.block = block
        self.slots = slots
        self.length = np.zeros(slots, dtype=np.int64)
        self._staging = device.pinned(max(1, self.floats) * 4).view(np.float32)[: self.floats]

    def check_slot(self, slot: int, field: str) -> int:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.slots:
            raise ValueError(f"{field} must be a state slot in [0, {self.slots}), got {slot!r}")
        return int(slot)

    def image(self, slot: int) -> rt.DevicePtr:
        return self.block.at(slot * self.floats * 4, self.floats * 4)

    def clear(self, slot: int, stream) -> None:
        if self.floats:
            rt.memset32(self.image(slot), 0, self.floats, stream)
        self.length[slot] = 0

    def read(self, slot: int, stream) -> np.ndarray:
        slot = self.check_slot(slot, "read_state slot")
        if self.floats:
            rt.copy_d2h(self._staging, self.image(slot), stream)
            rt.synchronize(stream)
        return self._staging.copy()

    def write(self, slot: int, data: np.ndarray, length: int | None, stream) -> None:
        slot = self.check_slot(slot, "write_state slot")
        data = np.asarray(data)
        if data.dtype != np.float32 or data.shape != (self.floats,):
            raise ValueError(f"write_state data must be float32 [{self.floats}], got {data.dtype} {list(data.shape)}")
        if self.floats:
            self._staging[:] = data
            rt.copy_h2d(self.image(slot), self._staging, stream)
            rt.synchronize(stream)  # the staging buffer is reused by the next call
        self.length[slot] = -1 if length is None else int(length)

    def copy(self, src: int, dst: int, stream) -> None:
        src = self.check_slot(src, "copy_state src")
        dst = self.check_slot(dst, "copy_state dst")
        if self.floats and src != dst:
            rt.copy_d2d(self.image(dst), self.image(src), self.floats * 4, stream)  # ordered with the steps
        self.length[dst] = self.length[src]
