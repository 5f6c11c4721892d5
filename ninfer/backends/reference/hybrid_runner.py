"""``HybridRunner``: the ModelRunner protocol for hybrid models, plus StateImage access.

It is the reference runner (same checks, sampling, BLAS limits and KV page operations) with the
hybrid forward pass; the KV pool has one layer per full-attention layer only, so ``read_pages``
returns ``[2, attention_layers, pages, page_size, kv_heads, head_dim]``. On top of the
protocol it owns ``max_batch + state_slots`` StateImage slots (``hybrid_state.py``): slot ``i <
max_batch`` is lane ``i``'s live state.

It pipelines decode: each lane has a second image, and a decode step reads a lane's state from one
and writes the other (``ninfer/backends/lane_slots.py``), so every StateImage operation sees a
lane's state as of its last collected step, even while the Engine has the next step in flight.

Rules the engine relies on:
- A prefill chunk with ``start == 0`` starts the lane from the zero state. A chunk with
  ``start > 0`` continues from the lane's state, which must summarise exactly ``start`` tokens
  (the previous chunk, or a checkpoint copied in with ``copy_state`` / ``write_state``).
- A decode row at position ``p`` needs the lane's state to summarise exactly ``p`` tokens.
- A state whose length is unknown (written from the host without ``length``) is trusted.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from ninfer.backends.lane_slots import LaneSlots, check_continues
from ninfer.backends.reference.hybrid import HybridForward, StateRows
from ninfer.backends.reference.hybrid_state import StateStore
from ninfer.backends.reference.hybrid_weights import HybridWeights, load_hybrid_weights
from ninfer.backends.reference.kv_cache import PagedKVCache
from ninfer.backends.reference.runner import ReferenceRunner
from ninfer.backends.runner import DecodeBatch, StepResult
from ninfer.backends.reference.weights import mapping_getter
from ninfer.models.hybrid import ARCHITECTURES, HybridConfig


def is_hybrid_config(config: Any) -> bool:
    if isinstance(config, HybridConfig):
        return True
    return isinstance(config, dict) and config.get("architecture") in ARCHITECTURES


class HybridRunner(ReferenceRunner):
    """NumPy fp32 runner of a Qwen3-Next / Qwen3.5 hybrid with paged KV and StateImage slots."""

    PIPELINED_DECODE = True  # RunnerInfo.pipelined_decode: a lane's two images (lane_slots.py)

    def __init__(self, artifact: Any, *, page_size: int = 16, num_pages: int, max_batch: int, max_context: int,
                 blas_threads: int | None = 1, state_slots: int = 0):
        """``artifact``: an opened artifact or a path; ``state_slots``: extra StateImage slots."""
        self._open(artifact, page_size, num_pages, max_batch, max_context, blas_threads, state_slots=state_slots)

    @classmethod
    def from_weights(cls, config: HybridConfig, weights: Mapping[str, np.ndarray], *, page_size: int = 16,
                     num_pages: int, max_batch: int, max_context: int, blas_threads: int | None = 1,
                     state_slots: int = 0) -> HybridRunner:
        """A runner over canonical-name tensors (``ninfer.models.hybrid.tensor_names``) in memory."""
        runner = object.__new__(cls)
        runner._setup(config, mapping_getter(weights), page_size, num_pages, max_batch, max_context, blas_threads,
                      state_slots=state_slots)
        return runner

    # -- the model ----------------------------------------------------------------------------------

    def _parse_config(self, config: Any) -> HybridConfig:
        if isinstance(config, HybridConfig):
            return config
        if not is_hybrid_config(config):
            raise ValueError(f"HybridRunner runs {', '.join(ARCHITECTURES)}, not {config.get('architecture')!r}")
        return HybridConfig.from_json(config)

    def _load_weights(self, config: HybridConfig, get: Callable[[str], np.ndarray]) -> HybridWeights:
        return load_hybrid_weights(config, get)

    def _build_model(self, weights: HybridWeights, page_size: int, num_pages: int, max_batch: int,
                     max_context: int, state_slots: int = 0) -> None:
        if state_slots < 0:
            raise ValueError(f"state_slots must be >= 0, got {state_slots}")
        c = self.config
        self._cache = PagedKVCache(len(c.attention_layers), num_pages, page_size, c.num_kv_heads, c.head_dim)
        self.lane_slots = LaneSlots(max_batch, state_slots)
        self._states = StateStore(c, self.lane_slots.physical)
        self._forward = HybridForward(c, weights, self._cache, self._states, max_context)

    def _start_prefill(self, lane: int, start: int) -> StateRows:
        slot = np.array([self.lane_slots.writable(lane, "prefill lane")])
        if start == 0:
            self._states.clear(int(slot[0]))
        else:
            self._check_continues(lane, start, "prefill start")
        return StateRows(read=slot, write=slot)

    def _end_prefill(self, lane: int, length: int) -> None:
        self._states.length[self.lane_slots.slot(lane)] = length

    def _start_decode(self, lanes: np.ndarray, positions: np.ndarray) -> StateRows:
        for lane, position in zip(lanes, positions):
            self._check_continues(int(lane), int(position), "decode position", launched=True)
        read, write = self.lane_slots.launch(lanes)
        self._states.length[write] = positions + 1
        return StateRows(read=read, write=write)

    def decode(self, batch: DecodeBatch) -> StepResult:
        self.launch_decode(batch)
        return self.finish_decode()

    def finish_decode(self) -> StepResult:
        result = super().finish_decode()
        self.lane_slots.collect()
        return result

    def _check_continues(self, lane: int, position: int, field: str, launched: bool = False) -> None:
        check_continues(self.lane_slots, self._states.length, lane, position, field, launched)

    # -- StateImages --------------------------------------------------------------------------------

    @property
    def num_state_slots(self) -> int:
        """Lanes first (slot i = lane i), then the extra slots."""
        return self.lane_slots.visible

    @property
    def state_floats(self) -> int:
        """Length of the float32 vector ``read_state`` returns."""
        return self._states.floats

    def read_state(self, slot: int) -> np.ndarray:
        """A copy of the StateImage in ``slot`` (a lane or an extra slot) as float32 [state_floats]."""
        return self._states.read(self.lane_slots.slot(slot, "read_state slot"))

    def write_state(self, slot: int, data: np.ndarray, length: int | None = None) -> None:
        """Replace the StateImage in ``slot``; ``length``: tokens it summarises (None: unknown)."""
        self._states.write(self.lane_slots.writable(slot, "write_state slot"), data, length)

    def copy_state(self, src: int, dst: int) -> None:
        """Copy a StateImage between slots (checkpoint capture: lane -> slot; reuse: slot -> lane)."""
        self._states.copy(self.lane_slots.slot(src, "copy_state src"), self.lane_slots.writable(dst, "copy_state dst"))

    def state_length(self, slot: int) -> int:
        """Tokens the image in ``slot`` summarises (-1: unknown)."""
        return int(self._states.length[self.lane_slots.slot(slot, "state_length slot")])

    def close(self) -> None:
        super().close()
        self._states = None  # type: ignore[assignment]
