"""Checks of what the engine hands a runner: lanes, token ids, positions and page tables.

The reference backend is how the engine's own tests find their mistakes, so every request is
checked and every failure is a ``ValueError`` naming the field. The functions read only the
runner's ``RunnerInfo``, so they hold for every model family the reference backend runs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ninfer.backends.runner import DecodeBatch, PrefillChunk, RunnerInfo


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


def check_page_table(info: RunnerInfo, tables: np.ndarray, ends: Sequence[int], field: str) -> np.ndarray:
    """Each row must cover positions [0, end) with valid page ids."""
    tables = tables.astype(np.int64, copy=False)
    for row, end in enumerate(ends):
        if end > info.max_context:
            raise ValueError(f"{field}: position {end - 1} exceeds max_context {info.max_context}")
        needed = -(-end // info.page_size)
        used = tables[row, :needed]
        if used.size < needed:
            raise ValueError(f"{field}: row {row} has {used.size} pages, position {end - 1} needs {needed}")
        if used.min() < 0 or used.max() >= info.num_pages:
            raise ValueError(f"{field}: row {row} uses page ids {used.tolist()} outside [0, {info.num_pages})")
    return tables


def prefill_inputs(info: RunnerInfo, chunk: PrefillChunk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The checked chunk as (tokens [n], absolute positions [n], page table [1, pages])."""
    check_lane(info, chunk.lane, "prefill lane")
    tokens = check_tokens(info, np.asarray(chunk.tokens).reshape(-1), "prefill tokens")
    if tokens.size == 0:
        raise ValueError("prefill tokens: the chunk is empty")
    if chunk.start < 0:
        raise ValueError(f"prefill start must be >= 0, got {chunk.start}")
    positions = np.arange(chunk.start, chunk.start + tokens.size, dtype=np.int64)
    table = check_page_table(info, np.asarray(chunk.page_table).reshape(1, -1), [int(positions[-1]) + 1],
                             "prefill page_table")
    return tokens, positions, table


def decode_inputs(info: RunnerInfo, batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The checked batch as (lanes [B], tokens [B], positions [B], page tables [B, pages])."""
    lanes = np.asarray(batch.lanes, dtype=np.int64).reshape(-1)
    rows = lanes.size
    if rows == 0:
        raise ValueError("decode: the batch is empty")
    if rows > info.max_batch:
        raise ValueError(f"decode: {rows} rows exceed max_batch {info.max_batch}")
    for lane in lanes:
        check_lane(info, int(lane), "decode lanes")
    if np.unique(lanes).size != rows:
        raise ValueError(f"decode lanes must be distinct, got {lanes.tolist()}")
    tokens = check_tokens(info, np.asarray(batch.tokens).reshape(-1), "decode tokens")
    positions = np.asarray(batch.positions, dtype=np.int64).reshape(-1)
    if tokens.size != rows or positions.size != rows or len(batch.sampling) != rows:
        raise ValueError(
            f"decode: lanes ({rows}), tokens ({tokens.size}), positions ({positions.size}) and "
            f"sampling ({len(batch.sampling)}) must have one entry per row"
        )
    if positions.min() < 0:
        raise ValueError(f"decode positions must be >= 0, got {positions.tolist()}")
    tables = check_page_table(info, np.asarray(batch.page_tables).reshape(rows, -1), (positions + 1).tolist(),
                              "decode page_tables")
    if rows > 1:
        # Two rows writing one KV slot means a page is shared without copy-on-write.
        targets = tables[np.arange(rows), positions // info.page_size] * info.page_size
        targets += positions % info.page_size
        if np.unique(targets).size != rows:
            raise ValueError("decode page_tables: two rows write the same KV slot (a shared page "
                             "needs copy_pages before it is written)")
    return lanes, tokens, positions, tables
