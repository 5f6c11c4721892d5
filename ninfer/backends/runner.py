"""The ModelRunner protocol: the only thing the engine knows about a backend.

A runner owns the model weights and the physical KV pool (``num_pages`` pages of ``page_size``
tokens, every layer). The engine owns *which* pages a sequence uses (page tables, reference
counts, prefix sharing); the runner only reads and writes the pages it is told to.

Lanes are the engine's resident execution slots ``0..max_batch-1``. A runner keeps per-lane
sampler state (the penalty counts): ``bind_lane`` resets it, and every decode input token of that
lane is counted as generated output afterwards (a decode input is always the previously committed
output token). Backends see token ids, positions, page tables and sampling rows; nothing else.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import attrs
import numpy as np


@attrs.frozen(kw_only=True)
class SamplingRow:
    """Fully resolved sampler parameters of one row. ``temperature == 0`` means greedy argmax."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 selects the cap of 20 candidates; 1..20 narrows it
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0  # signed 64-bit
    step: int = 0  # index of the output token being sampled (0 = first); keys the RNG


@attrs.frozen(kw_only=True)
class RunnerInfo:
    page_size: int  # tokens per KV page, a power of two
    num_pages: int  # capacity of the physical KV pool
    max_batch: int  # lanes: the largest decode batch
    vocab_size: int
    max_context: int  # longest sequence (prompt + output) a lane may hold
    backend: str  # "reference" or "cuda"
    # launch_decode / finish_decode may keep a second step in flight that follows the first on the
    # device (a dense model; a recurrent one would advance its lanes' state past a finished request)
    pipelined_decode: bool = False
    # prefill results carry ``device_interval`` (the CUDA backend's timing events; the reference
    # backend has no device, and its requests report no GPU seconds)
    times_device: bool = False


@attrs.frozen(kw_only=True)
class PrefillChunk:
    """Tokens ``[start, start + len(tokens))`` of one sequence, whose KV is written to its pages.

    ``page_table`` lists the sequence's pages from position 0 and covers the chunk's end. Positions
    before ``start`` are already in those pages (an earlier chunk, or a reused prefix).
    ``sample`` is set only on the chunk that ends the prompt: the runner then samples the first
    output token from the last position's logits.
    """

    lane: int
    tokens: np.ndarray  # int32 [n]
    start: int
    page_table: np.ndarray  # int32 [pages]
    sample: SamplingRow | None = None
    return_logits: bool = False  # tests and parity tools: also return the chunk's logits


@attrs.frozen(kw_only=True)
class DecodeBatch:
    """One token per row: row ``i`` of lane ``lanes[i]`` feeds ``tokens[i]`` at ``positions[i]``."""

    lanes: np.ndarray  # int32 [B]
    tokens: np.ndarray  # int32 [B]
    positions: np.ndarray  # int32 [B]; the new token's position = context length before it
    page_tables: np.ndarray  # int32 [B, max_pages_per_seq], unused entries -1
    sampling: Sequence[SamplingRow]
    return_logits: bool = False


@attrs.frozen(kw_only=True)
class StepResult:
    tokens: np.ndarray  # int32 [rows]; empty for a prefill chunk that does not sample
    logits: np.ndarray | None = None  # float32 [rows or chunk tokens, vocab] when asked for
    # A prefill's stream interval where ``info.times_device``: its ``seconds()`` (float, or None where
    # it cannot be read) waits for the work to end, which the call itself may not have.
    device_interval: Any = None


class ModelRunner(Protocol):
    info: RunnerInfo

    def bind_lane(self, lane: int, generated: Sequence[int]) -> None:
        """Start sampler state of ``lane`` for a sequence that has already generated ``generated``."""

    def prefill(self, chunk: PrefillChunk) -> StepResult: ...

    def decode(self, batch: DecodeBatch) -> StepResult: ...

    # Where ``info.pipelined_decode``: ``decode`` in two halves, so the host can queue the next
    # step before it has read this one's tokens. At most two steps are in flight.

    def launch_decode(self, batch: DecodeBatch, follow: bool = False) -> None:
        """Start a decode step. ``follow``: the step has the rows (lanes, in order) of the step
        launched before it, and each row's input token is that step's sampled token, taken on the
        device; ``batch.tokens`` is not used."""

    def finish_decode(self) -> StepResult:
        """The result of the oldest launched step, once it has finished."""

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole KV pages (copy-on-write of a shared tail page)."""

    @property
    def page_bytes(self) -> int:
        """Bytes one KV page (every layer, K and V) occupies in the pool: what a page copy moves,
        and what a pause snapshot holds on the Host per page."""

    def read_pages(self, pages: Sequence[int]) -> np.ndarray:
        """KV of ``pages`` as one host array in the pool's storage type (pause snapshots: bf16
        stays bf16, as uint16 bit patterns); ``write_pages`` takes it back bit-exact."""

    def write_pages(self, pages: Sequence[int], data: np.ndarray) -> None: ...

    def close(self) -> None: ...
