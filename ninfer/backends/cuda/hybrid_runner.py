"""``CudaHybridRunner``: the reference ``HybridRunner``'s protocol on one NVIDIA GPU.

It is ``CudaRunner`` (same checks, sampler, decode CUDA Graph per batch size, prefill sub-chunks,
KV page operations) with the hybrid forward pass of ``hybrid_forward.py``, a KV pool for the
full-attention layers only (``read_pages`` gives ``[2, attention_layers, pages, page_size,
kv_heads, head_dim]``, as the reference does) and ``max_batch + state_slots`` StateImage slots in
device memory (``hybrid_state.py``): slot ``i < max_batch`` is lane ``i``'s live state, the rest
hold checkpoints. ``copy_state`` is a device copy; ``read_state`` / ``write_state`` are one copy,
straight into (out of) an array of the Host arena when the runner has one (``host_arena_bytes``:
spilled checkpoints and pause snapshots live there), else through pinned staging.

It pipelines decode as ``CudaRunner`` does: each lane has a second StateImage in the workspace, and a
decode step reads a lane's state from one and writes the other (``ninfer/backends/lane_slots.py``),
so the Engine's StateImage operations see a lane's state as of its last collected step even while
the next step, launched ahead, runs.

The rules the Engine relies on are the reference's: a prefill chunk with ``start == 0`` starts from
the zero state, one with ``start > 0`` and a decode row at position ``p`` need the lane's state to
summarise exactly that many tokens (a state written without a length is trusted).

``open_runner(path, ...)`` builds the right CUDA runner for an artifact, dense or hybrid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ninfer.backends.cuda import hybrid_weights as hw
from ninfer.backends.cuda import runtime as rt
from ninfer.backends.cuda.hybrid_forward import HybridBuffers, HybridForward, check_supported
from ninfer.backends.cuda.runner import CudaRunner, _on_device
from ninfer.backends.lane_slots import LaneSlots, check_continues
from ninfer.backends.reference.hybrid_runner import is_hybrid_config
from ninfer.backends.runner import DecodeBatch, PrefillChunk, StepResult
from ninfer.models.hybrid import ARCHITECTURES, HybridConfig


def open_runner(artifact: Any, *, state_slots: int = 0, **options: Any) -> CudaRunner:
    """A ``CudaHybridRunner`` for a hybrid artifact (with ``state_slots`` extra StateImages), else a
    ``CudaRunner``; ``options`` are the runners' shared keyword arguments."""
    if isinstance(artifact, (str, Path)):
        from ninfer.artifact import open_artifact

        artifact = open_artifact(artifact, components=("text",))
    if is_hybrid_config(artifact.config):
        return CudaHybridRunner(artifact, state_slots=state_slots, **options)
    return CudaRunner(artifact, **options)


class CudaHybridRunner(CudaRunner):
    """A Qwen3-Next / Qwen3.5 hybrid on the GPU; see the module docstring."""

    PIPELINED_DECODE = True  # RunnerInfo.pipelined_decode: a lane's two images (lane_slots.py)

    def __init__(self, artifact: Any, *, page_size: int = 16, num_pages: int | str, max_batch: int, max_context: int,
                 device: int | rt.Device = 0, kv_dtype: str = "bf16", cuda_graph: bool = True,
                 max_prefill_rows: int = 512, prefill_gemm: str = "fp32", state_slots: int = 0,
                 host_arena_bytes: int = 0, host_arena_state_images: int = 0):
        """``artifact``: an opened artifact or a path; ``state_slots``: extra StateImage slots; the Host
        arena as ``CudaRunner``'s."""
        if isinstance(artifact, (str, Path)):
            from ninfer.artifact import open_artifact

            artifact = open_artifact(artifact, components=("text",))
        config = _hybrid_config(artifact.config)
        check_supported(config, kv_dtype)
        dev = device if isinstance(device, rt.Device) else rt.Device(device)
        stream = dev.stream()
        weights, report = hw.upload(dev, stream, config, artifact.tensor)
        self._setup(config, dev, stream, weights, page_size=page_size, num_pages=num_pages, max_batch=max_batch,
                    max_context=max_context, kv_dtype=kv_dtype, cuda_graph=cuda_graph,
                    max_prefill_rows=max_prefill_rows, prefill_gemm=prefill_gemm, state_slots=state_slots,
                    host_arena_bytes=host_arena_bytes, host_arena_state_images=host_arena_state_images)
        self.startup["weights_bytes"] = report.nbytes
        self.startup["weights_upload_gb_per_s"] = round(report.gb_per_s, 2)

    @classmethod
    def from_device_weights(cls, config: HybridConfig, weights: Mapping[str, rt.DevicePtr], *,
                            device: rt.Device, page_size: int = 16, num_pages: int | str, max_batch: int,
                            max_context: int, kv_dtype: str = "bf16", cuda_graph: bool = True,
                            max_prefill_rows: int = 512, prefill_gemm: str = "fp32",
                            state_slots: int = 0, host_arena_bytes: int = 0,
                            host_arena_state_images: int = 0) -> CudaHybridRunner:
        """A runner over weights already on ``device`` in the layout of ``hybrid_weights.device_layout``
        (zero-centred norm weights stored as ``1 + w``)."""
        check_supported(config, kv_dtype)
        hw.check_device_weights(config, weights)
        runner = cls.__new__(cls)
        runner._setup(config, device, device.stream(), dict(weights), page_size=page_size, num_pages=num_pages,
                      max_batch=max_batch, max_context=max_context, kv_dtype=kv_dtype, cuda_graph=cuda_graph,
                      max_prefill_rows=max_prefill_rows, prefill_gemm=prefill_gemm, state_slots=state_slots,
                      host_arena_bytes=host_arena_bytes, host_arena_state_images=host_arena_state_images)
        return runner

    def _setup(self, config, device, stream, weights, *, state_slots=0, **options):
        if state_slots < 0:
            raise ValueError(f"state_slots must be >= 0, got {state_slots}")
        self._state_slots = state_slots
        self.lane_slots = LaneSlots(options["max_batch"], state_slots)
        super()._setup(config, device, stream, weights, **options)

    # The StateImages are part of the workspace, so with num_pages="auto" the KV pool gets what they leave.
    def _make_buffers(self, **shape: Any) -> HybridBuffers:
        return HybridBuffers(self.device, self.config, state_slots=self._state_slots, **shape)

    def _make_forward(self, weights: Mapping[str, rt.DevicePtr], **options: Any) -> HybridForward:
        return HybridForward(self.kernels, self.config, weights, self.buffers, lt=self._lt, **options)

    def _fragment_copies(self, weights: Mapping[str, rt.DevicePtr], max_batch: int,
                         keep_free: int = 0) -> dict[str, rt.DevicePtr]:
        return {}  # the hybrids' decode GEMMs read the row-major weights (CudaRunner._fragment_copies)

    @property
    def states(self):
        """The StateImage slots (``hybrid_state.DeviceStates``) in the workspace."""
        return self.buffers.state_slots

    def _startup_details(self) -> dict[str, Any]:
        return {"state_slots": self.lane_slots.visible, "state_bytes": self.state_bytes,
                "pipeline_state_images": self.lane_slots.physical - self.lane_slots.visible}

    @property
    def state_bytes(self) -> int:
        """Bytes of one StateImage (float32)."""
        return 4 * self.config.state_floats

    # -- the protocol: CudaRunner's, with the lanes' recurrent state kept in step ----------------

    @_on_device
    def prefill(self, chunk: PrefillChunk) -> StepResult:
        self._check_lane(chunk.lane, "prefill lane")
        if self._pending:
            raise RuntimeError("prefill: a decode step is in flight; finish_decode it first")
        slot = self.lane_slots.slot(chunk.lane)
        if chunk.start == 0:
            self.states.clear(slot, self.stream)
        else:
            self._check_continues(chunk.lane, chunk.start, "prefill start")
        inp = self.buffers.inputs
        inp.state_in[0] = inp.state_out[0] = slot  # the chunk continues the lane's state in place
        result = super().prefill(chunk)
        self.states.length[slot] = chunk.start + np.asarray(chunk.tokens).size
        return result

    @_on_device
    def launch_decode(self, batch: DecodeBatch, follow: bool = False) -> None:
        lanes = np.asarray(batch.lanes, dtype=np.int64).reshape(-1)
        positions = np.asarray(batch.positions, dtype=np.int64).reshape(-1)
        if lanes.size == positions.size and lanes.size and 0 <= lanes.min() and lanes.max() < self.info.max_batch:
            for lane, position in zip(lanes.tolist(), positions.tolist()):
                self._check_continues(lane, position, "decode position", launched=True)
        super().launch_decode(batch, follow)  # validates the rest before anything runs

    def _fill_state_rows(self, inp, lanes: np.ndarray, positions: np.ndarray) -> None:
        read, write = self.lane_slots.launch(lanes)
        inp.state_in[:lanes.size] = read
        inp.state_out[:lanes.size] = write
        self.states.length[write] = positions + 1

    @_on_device
    def finish_decode(self) -> StepResult:
        result = super().finish_decode()
        self.lane_slots.collect()
        return result

    def _check_continues(self, lane: int, position: int, field: str, launched: bool = False) -> None:
        check_continues(self.lane_slots, self.states.length, lane, position, field, launched)

    # -- StateImages ----------------------------------------------------------------------------

    @property
    def num_state_slots(self) -> int:
        """Lanes first (slot i = lane i), then the extra slots."""
        return self.lane_slots.visible

    @property
    def state_floats(self) -> int:
        """Length of the float32 vector ``read_state`` returns."""
        return self.states.floats

    @_on_device
    def read_state(self, slot: int) -> np.ndarray:
        """A copy of the StateImage in ``slot`` as float32 [state_floats]: with a Host arena, an array
        of it filled by one DMA; else (no arena, or no room) a pageable copy through staging."""
        slot = self.lane_slots.slot(slot, "read_state slot")
        if self.host_arena is not None:
            image = self._host_empty((self.states.floats,), np.float32)
            if self._in_arena(image):
                rt.copy_d2h(image, self.states.image(slot), self.stream)
                rt.synchronize(self.stream)
                return image
        return self.states.read(slot, self.stream)

    @_on_device
    def write_state(self, slot: int, data: np.ndarray, length: int | None = None) -> None:
        """Replace the StateImage in ``slot``; ``length``: tokens it summarises (None: unknown). An
        image in the Host arena is copied up directly; any other goes through staging."""
        data = np.asarray(data)
        slot = self.lane_slots.writable(slot, "write_state slot")
        if data.dtype == np.float32 and data.shape == (self.states.floats,) and self._in_arena(data):
            rt.copy_h2d(self.states.image(slot), data, self.stream)
            rt.synchronize(self.stream)  # the caller may drop the image (and its block) on return
            self.states.length[slot] = -1 if length is None else int(length)
            return
        self.states.write(slot, data, length, self.stream)

    @_on_device
    def copy_state(self, src: int, dst: int) -> None:
        """Copy a StateImage between slots on the device (checkpoint capture or reuse)."""
        self.states.copy(self.lane_slots.slot(src, "copy_state src"), self.lane_slots.writable(dst, "copy_state dst"),
                         self.stream)

    def state_length(self, slot: int) -> int:
        """Tokens the image in ``slot`` summarises (-1: unknown)."""
        return int(self.states.length[self.lane_slots.slot(slot, "state_length slot")])


def _hybrid_config(config: Any) -> HybridConfig:
    if isinstance(config, HybridConfig):
        return config
    if not is_hybrid_config(config):
        raise ValueError(f"CudaHybridRunner runs {', '.join(ARCHITECTURES)}, not {config.get('architecture')!r}")
    return HybridConfig.from_json(config)
