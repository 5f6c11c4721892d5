"""``HybridRunner``: the ModelRunner protocol for hybrid models, plus StateImage access.

It is the reference runner (same checks, sampling, BLAS limits and KV page operations) with the
hybrid forward pass; the KV pool has one layer per full-attention layer only, so ``read_pages``
returns ``[2, attention_layers, pages, page_size, kv_heads, head_dim]``. On top of the
protocol it owns ``max_batch + state_slots`` StateImage slots (``hybrid_state.py``): slot ``i <
max_batch`` is lane ``i``'s live state.

Rules the engine relies on:
- A prefill chunk with ``start == 0`` starts the lane from the zero state. A chunk with
  ``start > 0`` continues from the lane's state, which must summarise exactly ``start`` tokens
  (the previous chunk, or a checkpoint copied in with ``copy_state`` / ``write_state``).
- A decode row at position ``p`` needs the lane's state to summarise exactly ``p`` tokens.
- A state whose length is unknown (written from the host without ``length``) is trusted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ninfer.backends.reference.hybrid import HybridForward
from ninfer.backends.reference.hybrid_state import StateStore
from ninfer.backends.reference.hybrid_weights import hybrid_weights_from_mapping, load_hybrid_weights
from ninfer.backends.reference.kv_cache import PagedKVCache
from ninfer.backends.reference.runner import ReferenceRunner
from ninfer.backends.runner import DecodeBatch, PrefillChunk, RunnerInfo, StepResult
from ninfer.backends.sampling import sample_row
from ninfer.models.hybrid import ARCHITECTURES, HybridConfig


def is_hybrid_config(config: Any) -> bool:
    if isinstance(config, HybridConfig):
        return True
    return isinstance(config, dict) and config.get("architecture") in ARCHITECTURES


class HybridRunner(ReferenceRunner):
    """NumPy fp32 runner of a Qwen3-Next / Qwen3.5 hybrid with paged KV and StateImage slots."""

    def __init__(self, artifact: Any, *, page_size: int = 16, num_pages: int, max_batch: int, max_context: int,
                 blas_threads: int | None = 1, state_slots: int = 0):
        """``artifact``: an opened artifact or a path; ``state_slots``: extra StateImage slots."""
        if isinstance(artifact, (str, Path)):
            from ninfer.artifact import open_artifact

            artifact = open_artifact(artifact, components=("text",))
        config = _hybrid_config(artifact.config)
        weights = load_hybrid_weights(config, artifact.tensor)
        self._setup_hybrid(config, weights, page_size, num_pages, max_batch, max_context, blas_threads, state_slots)

    @classmethod
    def from_weights(cls, config: HybridConfig, weights: Mapping[str, np.ndarray], *, page_size: int = 16,
                     num_pages: int, max_batch: int, max_context: int, blas_threads: int | None = 1,
                     state_slots: int = 0) -> HybridRunner:
        """A runner over canonical-name tensors (``ninfer.models.hybrid.tensor_names``) in memory."""
        runner = object.__new__(cls)
        loaded = hybrid_weights_from_mapping(config, weights)
        runner._setup_hybrid(config, loaded, page_size, num_pages, max_batch, max_context, blas_threads,
                             state_slots)
        return runner

    def _setup_hybrid(self, config, weights, page_size, num_pages, max_batch, max_context, blas_threads,
                      state_slots):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        if state_slots < 0:
            raise ValueError(f"state_slots must be >= 0, got {state_slots}")
        self.config = config
        self._cache = PagedKVCache(len(config.attention_layers), num_pages, page_size, config.num_kv_heads,
                                   config.head_dim)
        self._states = StateStore(config, max_batch + state_slots)
        self._forward = HybridForward(config, weights, self._cache, self._states, max_context)
        self._counts = np.zeros((max_batch, config.vocab_size), dtype=np.int32)
        self._blas_threads = blas_threads
        from threadpoolctl import ThreadpoolController

        self._threadpools = ThreadpoolController() if blas_threads is not None else None
        self.info = RunnerInfo(page_size=page_size, num_pages=num_pages, max_batch=max_batch,
                               vocab_size=config.vocab_size, max_context=max_context, backend="reference")

    # -- StateImages --------------------------------------------------------------------------------

    @property
    def num_state_slots(self) -> int:
        """Lanes first (slot i = lane i), then the extra slots."""
        return self._states.slots

    @property
    def state_floats(self) -> int:
        """Length of the float32 vector ``read_state`` returns."""
        return self._states.floats

    def read_state(self, slot: int) -> np.ndarray:
        """A copy of the StateImage in ``slot`` (a lane or an extra slot) as float32 [state_floats]."""
        return self._states.read(slot)

    def write_state(self, slot: int, data: np.ndarray, length: int | None = None) -> None:
        """Replace the StateImage in ``slot``; ``length``: tokens it summarises (None: unknown)."""
        self._states.write(slot, data, length)

    def copy_state(self, src: int, dst: int) -> None:
        """Copy a StateImage between slots (checkpoint capture: lane -> slot; reuse: slot -> lane)."""
        self._states.copy(src, dst)

    def state_length(self, slot: int) -> int:
        """Tokens the image in ``slot`` summarises (-1: unknown)."""
        return int(self._states.length[self._states.check_slot(slot, "state_length slot")])

    # -- the protocol ---------------------------------------------------------------------------------

    def _prefill(self, chunk: PrefillChunk) -> StepResult:
        self._check_lane(chunk.lane, "prefill lane")
        tokens = self._check_tokens(np.asarray(chunk.tokens).reshape(-1), "prefill tokens")
        if tokens.size == 0:
            raise ValueError("prefill tokens: the chunk is empty")
        if chunk.start < 0:
            raise ValueError(f"prefill start must be >= 0, got {chunk.start}")
        positions = np.arange(chunk.start, chunk.start + tokens.size, dtype=np.int64)
        table = self._check_page_table(np.asarray(chunk.page_table).reshape(1, -1), [int(positions[-1]) + 1],
                                       "prefill page_table")
        lane = chunk.lane
        if chunk.start == 0:
            self._states.clear(lane)
        else:
            self._check_continues(lane, chunk.start, "prefill start")
        hidden = self._forward.hidden(tokens, positions, table, np.array([lane]), decode=False)
        self._states.length[lane] = chunk.start + tokens.size
        logits = self._forward.logits(hidden) if chunk.return_logits else None
        out = np.empty(0, dtype=np.int32)
        if chunk.sample is not None:
            last = logits[-1] if logits is not None else self._forward.logits(hidden[-1:])[0]
            out = np.array([sample_row(last, chunk.sample, self._counts[lane])], dtype=np.int32)
        return StepResult(tokens=out, logits=logits)

    def _decode(self, batch: DecodeBatch) -> StepResult:
        lanes = np.asarray(batch.lanes, dtype=np.int64).reshape(-1)
        rows = lanes.size
        if rows == 0:
            raise ValueError("decode: the batch is empty")
        if rows > self.info.max_batch:
            raise ValueError(f"decode: {rows} rows exceed max_batch {self.info.max_batch}")
        for lane in lanes:
            self._check_lane(int(lane), "decode lanes")
        if np.unique(lanes).size != rows:
            raise ValueError(f"decode lanes must be distinct, got {lanes.tolist()}")
        tokens = self._check_tokens(np.asarray(batch.tokens).reshape(-1), "decode tokens")
        positions = np.asarray(batch.positions, dtype=np.int64).reshape(-1)
        if tokens.size != rows or positions.size != rows or len(batch.sampling) != rows:
            raise ValueError(f"decode: lanes ({rows}), tokens ({tokens.size}), positions ({positions.size}) and "
                             f"sampling ({len(batch.sampling)}) must have one entry per row")
        if positions.min() < 0:
            raise ValueError(f"decode positions must be >= 0, got {positions.tolist()}")
        for lane, position in zip(lanes, positions):
            self._check_continues(int(lane), int(position), "decode position")
        tables = self._check_page_table(np.asarray(batch.page_tables).reshape(rows, -1), (positions + 1).tolist(),
                                        "decode page_tables")
        np.add.at(self._counts, (lanes, tokens), 1)
        logits = self._forward.logits(self._forward.hidden(tokens, positions, tables, lanes, decode=True))
        self._states.length[lanes] = positions + 1
        out = np.array([sample_row(logits[i], batch.sampling[i], self._counts[lanes[i]]) for i in range(rows)],
                       dtype=np.int32)
        return StepResult(tokens=out, logits=logits if batch.return_logits else None)

    def close(self) -> None:
        super().close()
        self._states = None  # type: ignore[assignment]

    def _check_continues(self, lane: int, position: int, field: str) -> None:
        have = int(self._states.length[lane])
        if have >= 0 and have != position:
            raise ValueError(f"{field} {position}: lane {lane}'s recurrent state summarises {have} tokens; "
                             f"restore the state at {position} first (copy_state / write_state)")


def _hybrid_config(config: Any) -> HybridConfig:
    if isinstance(config, HybridConfig):
        return config
    if not is_hybrid_config(config):
        raise ValueError(f"HybridRunner runs {', '.join(ARCHITECTURES)}, not {config.get('architecture')!r}")
    return HybridConfig.from_json(config)
