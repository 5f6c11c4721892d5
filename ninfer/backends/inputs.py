"""Checks of what the engine hands a runner: lanes, token ids, positions, page tables and sampling rows.

Every backend (reference and CUDA) checks every request with these before any model math, and every
failure is a ``ValueError`` naming the field: the reference backend is how the engine's own tests
find their mistakes, and the CUDA backend must never pass a bad index to a kernel. The functions
read only the runner's ``RunnerInfo``, so they hold for every model family. They are vectorised
(a decode step of eight rows costs a few NumPy calls, not a Python loop per row, since they run on
the GPU's hot path); only a failure walks the rows, to name the first offending one.
"""

from __future__ import annotations

import collections
from typing import Sequence

import attrs
import numpy as np

from ninfer.backends.runner import DecodeBatch, PrefillChunk, RunnerInfo, SamplingRow, StepResult

TOP_K_CAP = 20  # the most candidates a sampler keeps (``top_k`` 0 selects this many)
_INT64 = (-(1 << 63), 1 << 63)


def check_lane(info: RunnerInfo, lane: int, field: str) -> None:
    if not 0 <= lane < info.max_batch:
        raise ValueError(f"{field} must lie in [0, {info.max_batch}), got {lane}")


def check_tokens(info: RunnerInfo, tokens: np.ndarray, field: str) -> np.ndarray:
    """``tokens`` as int64, every id inside the vocabulary."""
    tokens = tokens.astype(np.int64, copy=False)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= info.vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= info.vocab_size)][0]
        raise ValueError(f"{field}: token id {int(bad)} is outside the vocabulary [0, {info.vocab_size})")
    return tokens


def check_lanes(info: RunnerInfo, lanes: np.ndarray, field: str) -> None:
    if lanes.size and (lanes.min() < 0 or lanes.max() >= info.max_batch):
        check_lane(info, int(lanes[(lanes < 0) | (lanes >= info.max_batch)][0]), field)


def check_page_table(info: RunnerInfo, tables: np.ndarray, ends: Sequence[int] | np.ndarray,
                     field: str) -> np.ndarray:
    """Each row must cover positions [0, end) with valid page ids (entries past a row's end are not read)."""
    if tables.dtype.kind not in "iu":
        tables = tables.astype(np.int64)
    ends_list = np.asarray(ends, dtype=np.int64).reshape(-1).tolist()
    needed = [-(-end // info.page_size) for end in ends_list]
    width = max(needed)
    if max(ends_list) <= info.max_context and width <= tables.shape[1]:
        used = tables[:, :width]  # only the pages the rows reach, not the whole table
        # One comparison finds negative ids too: as unsigned they are larger than any page count.
        bad = used.view(used.dtype.str.replace("i", "u")) >= info.num_pages
        if min(needed) < width:  # shorter rows: their entries past their own end do not count
            bad &= np.arange(width) < np.array(needed)[:, None]
        if not bad.any():
            return tables  # the common case: no Python loop per row
    for row, end in enumerate(ends_list):  # find the first offending row for the message
        if end > info.max_context:
            raise ValueError(f"{field}: position {end - 1} exceeds max_context {info.max_context}")
        needed_row = -(-end // info.page_size)
        used = tables[row, :needed_row]
        if used.size < needed_row:
            raise ValueError(f"{field}: row {row} has {used.size} pages, position {end - 1} needs {needed_row}")
        if used.min() < 0 or used.max() >= info.num_pages:
            raise ValueError(f"{field}: row {row} uses page ids {used.tolist()} outside [0, {info.num_pages})")
    return tables


def check_sampling(row: SamplingRow, field: str) -> None:
    """A sampling row within what every sampler implements (the Engine resolves requests to these;
    a runner driven directly gets the same refusal instead of a silently clamped value)."""
    if not 0 <= row.top_k <= TOP_K_CAP:
        raise ValueError(f"{field}.top_k must be in 0..{TOP_K_CAP}, got {row.top_k}")
    if not 0.0 <= row.temperature < float("inf"):
        raise ValueError(f"{field}.temperature must be finite and >= 0, got {row.temperature}")
    for name in ("top_p", "min_p"):
        if not 0.0 <= getattr(row, name) <= 1.0:
            raise ValueError(f"{field}.{name} must be in [0, 1], got {getattr(row, name)}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not abs(getattr(row, name)) < float("inf"):
            raise ValueError(f"{field}.{name} must be finite, got {getattr(row, name)}")
    if not (_INT64[0] <= row.seed < _INT64[1] and 0 <= row.step < _INT64[1]):
        raise ValueError(f"{field}: seed must be a signed 64-bit integer and step >= 0, got {row.seed}, {row.step}")


def prefill_inputs(info: RunnerInfo, chunk: PrefillChunk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The checked chunk as (tokens [n], absolute positions [n], page table [1, pages])."""
    check_lane(info, chunk.lane, "prefill lane")
    tokens = check_tokens(info, np.asarray(chunk.tokens).reshape(-1), "prefill tokens")
    if tokens.size == 0:
        raise ValueError("prefill tokens: the chunk is empty")
    if chunk.start < 0:
        raise ValueError(f"prefill start must be >= 0, got {chunk.start}")
    if chunk.sample is not None:
        check_sampling(chunk.sample, "prefill sample")
    positions = np.arange(chunk.start, chunk.start + tokens.size, dtype=np.int64)
    table = check_page_table(info, np.asarray(chunk.page_table).reshape(1, -1), [int(positions[-1]) + 1],
                             "prefill page_table")
    return tokens, positions, table


def decode_inputs(info: RunnerInfo, batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The checked batch as (lanes [B], tokens [B], positions [B], page tables [B, pages]).

    The per-row checks run on Python lists (a decode step has at most ``max_batch`` rows, and each
    NumPy call costs microseconds on the GPU's hot path); NumPy only scans the page tables."""
    lanes = np.asarray(batch.lanes, dtype=np.int64).reshape(-1)
    rows = lanes.size
    if rows == 0:
        raise ValueError("decode: the batch is empty")
    if rows > info.max_batch:
        raise ValueError(f"decode: {rows} rows exceed max_batch {info.max_batch}")
    lane_list = lanes.tolist()
    if min(lane_list) < 0 or max(lane_list) >= info.max_batch:
        check_lanes(info, lanes, "decode lanes")
    if len(set(lane_list)) != rows:
        raise ValueError(f"decode lanes must be distinct, got {lane_list}")
    tokens = np.asarray(batch.tokens).reshape(-1)
    positions = np.asarray(batch.positions, dtype=np.int64).reshape(-1)
    if tokens.size != rows or positions.size != rows or len(batch.sampling) != rows:
        raise ValueError(
            f"decode: lanes ({rows}), tokens ({tokens.size}), positions ({positions.size}) and "
            f"sampling ({len(batch.sampling)}) must have one entry per row"
        )
    for row, sampling in enumerate(batch.sampling):
        check_sampling(sampling, f"decode sampling[{row}]")
    token_list, position_list = tokens.tolist(), positions.tolist()
    if min(token_list) < 0 or max(token_list) >= info.vocab_size or tokens.dtype.kind not in "iu":
        tokens = check_tokens(info, tokens, "decode tokens")
    if min(position_list) < 0:
        raise ValueError(f"decode positions must be >= 0, got {position_list}")
    tables = check_page_table(info, np.asarray(batch.page_tables).reshape(rows, -1), positions + 1,
                              "decode page_tables")
    if rows > 1:
        # Two rows writing one KV slot means a page is shared without copy-on-write.
        size = info.page_size
        pages = tables[range(rows), [p // size for p in position_list]].tolist()
        if len({page * size + p % size for page, p in zip(pages, position_list)}) != rows:
            raise ValueError("decode page_tables: two rows write the same KV slot (a shared page "
                             "needs copy_pages before it is written)")
    return lanes, tokens.astype(np.int64, copy=False), positions, tables


def check_follow(info: RunnerInfo, previous: np.ndarray | None, batch: DecodeBatch) -> None:
    """A ``launch_decode(follow=True)``: the runner pipelines decode, and the batch has the lanes
    of the step in flight before it (``previous``; None when there is none), in order."""
    if not info.pipelined_decode:
        raise ValueError("launch_decode(follow=True): this runner does not pipeline decode steps")
    if previous is None or not np.array_equal(previous, np.asarray(batch.lanes).reshape(-1)):
        raise ValueError("launch_decode(follow=True) needs the lanes of the step in flight before it, in order")
    if batch.return_logits:
        raise ValueError("launch_decode(follow=True) cannot return logits")


class DecodesAtLaunch:
    """``launch_decode`` / ``finish_decode`` for a runner that computes a step when it is launched
    (the reference backend, test runners): results wait here in launch order, and a following step
    is fed the tokens of the step before it, as the GPU feeds them on the device."""

    def __init__(self, info: RunnerInfo, decode) -> None:
        self._info, self._decode = info, decode
        self._pending: collections.deque = collections.deque()  # (lanes, result) of launched steps

    def launch(self, batch: DecodeBatch, follow: bool = False) -> None:
        if len(self._pending) >= 2:
            raise RuntimeError("launch_decode: two decode steps are in flight; finish_decode one first")
        if follow:
            previous_lanes, previous = self._pending[-1] if self._pending else (None, None)
            check_follow(self._info, previous_lanes, batch)
            batch = attrs.evolve(batch, tokens=previous.tokens)
        self._pending.append((np.asarray(batch.lanes).reshape(-1), self._decode(batch)))

    def finish(self) -> StepResult:
        if not self._pending:
            raise RuntimeError("finish_decode: no decode step is in flight")
        return self._pending.popleft()[1]
