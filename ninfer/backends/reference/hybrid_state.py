"""StateImages of the reference backend: the recurrent state of every DeltaNet layer, per slot.

A slot holds one sequence's StateImage. Slots ``0 .. max_batch - 1`` are the lanes' live states
(the state a prefill chunk continues from and a decode step updates); slots from ``max_batch`` on
are extra images the engine may use to retain checkpoints on the device.

The host form of an image (``read`` / ``write``) is one float32 vector: for each DeltaNet layer in
layer order, its conv tail ``[kernel - 1, conv_dim]`` then its delta-rule state
``[v_heads, k_head_dim, v_head_dim]``, each C-order. Its length is ``HybridConfig.state_floats``.

Each slot also records how many tokens its image summarises (``length``), or -1 when unknown
(an image written from the host without a length): the runner uses it to refuse a chunk or a
decode step that does not continue the sequence the state belongs to.
"""

from __future__ import annotations

import numpy as np

from ninfer.models.hybrid import HybridConfig


class StateStore:
    def __init__(self, config: HybridConfig, slots: int):
        if slots < 1:
            raise ValueError(f"state slots must be positive, got {slots}")
        n = len(config.linear_layers)
        self.conv = [np.zeros((slots, *config.conv_state_shape), np.float32) for _ in range(n)]
        self.recurrent = [np.zeros((slots, *config.recurrent_state_shape), np.float32) for _ in range(n)]
        self.length = np.zeros(slots, dtype=np.int64)
        self.slots = slots
        self.floats = config.state_floats

    def check_slot(self, slot: int, field: str) -> int:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.slots:
            raise ValueError(f"{field} must be a state slot in [0, {self.slots}), got {slot!r}")
        return int(slot)

    def clear(self, slot: int) -> None:
        for conv, rec in zip(self.conv, self.recurrent):
            conv[slot] = 0.0
            rec[slot] = 0.0
        self.length[slot] = 0

    def read(self, slot: int) -> np.ndarray:
        slot = self.check_slot(slot, "read_state slot")
        parts = []
        for conv, rec in zip(self.conv, self.recurrent):
            parts.append(conv[slot].reshape(-1))
            parts.append(rec[slot].reshape(-1))
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def write(self, slot: int, data: np.ndarray, length: int | None = None) -> None:
        slot = self.check_slot(slot, "write_state slot")
        data = np.asarray(data)
        if data.dtype != np.float32 or data.shape != (self.floats,):
            raise ValueError(f"write_state data must be float32 [{self.floats}], got {data.dtype} {list(data.shape)}")
        offset = 0
        for conv, rec in zip(self.conv, self.recurrent):
            for array in (conv, rec):
                size = array[slot].size
                array[slot] = data[offset : offset + size].reshape(array.shape[1:])
                offset += size
        self.length[slot] = -1 if length is None else int(length)

    def copy(self, src: int, dst: int) -> None:
        src = self.check_slot(src, "copy_state src")
        dst = self.check_slot(dst, "copy_state dst")
        for conv, rec in zip(self.conv, self.recurrent):
            conv[dst] = conv[src]
            rec[dst] = rec[src]
        self.length[dst] = self.length[src]
