"""A simulated ModelRunner: deterministic fake logits, for scheduler tests and the engine bench.

``verify=True`` keeps token ids in its KV "pages" and derives each next token from the context
it reads back through the page table (and from the lane's penalty counts when penalties are on),
so a wrong page table, a bad copy-on-write, a lost snapshot or a stale ``bind_lane`` changes the
output exactly as it would on a real model. ``verify=False`` is the zero-cost runner of
``ninfer bench engine``: it does no per-token work at all, so the bench measures the Engine only.
"""

from __future__ import annotations

import collections
import zlib
from typing import Sequence

import numpy as np

from ninfer.backends.runner import DecodeBatch, PrefillChunk, RunnerInfo, SamplingRow, StepResult
from ninfer.backends.sampling import uniform


class SimulatedRunner:
    def __init__(self, *, page_size: int = 16, num_pages: int = 64, max_batch: int = 8,
                 max_context: int = 1024, vocab_size: int = 64, verify: bool = True,
                 page_bytes: int | None = None) -> None:
        self.info = RunnerInfo(page_size=page_size, num_pages=num_pages, max_batch=max_batch,
                               vocab_size=vocab_size, max_context=max_context, backend="simulated")
        self.verify = verify
        self.kv = np.full((num_pages, page_size), -1, dtype=np.int64)
        # The KV page size it reports; a real model's pages are bigger than these token ids, so a
        # test can tell the reported size (which the Engine must count) from the Host array's.
        self.page_bytes = self.kv[0].nbytes if page_bytes is None else page_bytes
        self.counts: list[collections.Counter] = [collections.Counter() for _ in range(max_batch)]
        self.calls = collections.Counter()
        self.closed = False

    def bind_lane(self, lane: int, generated: Sequence[int]) -> None:
        self.calls["bind_lane"] += 1
        self.counts[lane] = collections.Counter(int(t) for t in generated)

    def prefill(self, chunk: PrefillChunk) -> StepResult:
        self.calls["prefill"] += 1
        if not self.verify:
            tokens = np.array([1], np.int32) if chunk.sample else np.empty(0, np.int32)
            return StepResult(tokens=tokens)
        end = chunk.start + len(chunk.tokens)
        self._write(chunk.page_table, chunk.start, chunk.tokens)
        if chunk.sample is None:
            return StepResult(tokens=np.empty(0, np.int32))
        token = self._next(chunk.page_table, end, chunk.sample, self.counts[chunk.lane], chunk.lane)
        return StepResult(tokens=np.array([token], np.int32))

    def decode(self, batch: DecodeBatch) -> StepResult:
        self.calls["decode"] += 1
        if not self.verify:
            return StepResult(tokens=(batch.tokens + 1) % self.info.vocab_size)
        out = np.empty(len(batch.lanes), np.int32)
        for i, lane in enumerate(batch.lanes.tolist()):
            table = batch.page_tables[i]
            pos = int(batch.positions[i])
            token = int(batch.tokens[i])
            self.counts[lane][token] += 1  # a decode input is the previous committed output
            self._write(table, pos, [token])
            out[i] = self._next(table, pos + 1, batch.sampling[i], self.counts[lane], lane)
        return StepResult(tokens=out)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.calls["copy_pages"] += 1
        self.kv[list(dst)] = self.kv[list(src)]

    def read_pages(self, pages: Sequence[int]) -> np.ndarray:
        self.calls["read_pages"] += 1
        return self.kv[list(pages)].copy()

    def write_pages(self, pages: Sequence[int], data: np.ndarray) -> None:
        self.calls["write_pages"] += 1
        self.kv[list(pages)] = data

    def close(self) -> None:
        self.closed = True

    # -- fake model -----------------------------------------------------------------------

    def _write(self, table: np.ndarray, start: int, tokens) -> None:
        ps = self.info.page_size
        for i, t in enumerate(np.asarray(tokens).tolist()):
            pos = start + i
            page = int(table[pos // ps])
            assert page >= 0, f"write at position {pos} without a page"
            self.kv[page, pos % ps] = t

    def _context(self, table: np.ndarray, n: int) -> np.ndarray:
        ps = self.info.page_size
        pages = [int(p) for p in table[: -(-n // ps)]]
        assert all(p >= 0 for p in pages), "page table does not cover the context"
        ctx = self.kv[pages].reshape(-1)[:n]
        assert (ctx >= 0).all(), "context position read before it was written"
        return ctx

    def _salt(self, lane: int) -> int:
        return 0  # no recurrent state

    def _next(self, table: np.ndarray, n: int, row: SamplingRow, counts: collections.Counter, lane: int) -> int:
        h = zlib.crc32(self._context(table, n).tobytes(), self._salt(lane))
        if row.temperature > 0:
            h = zlib.crc32(np.float64(uniform(row.seed, row.step)).tobytes(), h)
        if row.presence_penalty or row.frequency_penalty:
            h = zlib.crc32(repr(sorted(counts.items())).encode(), h)
        return h % self.info.vocab_size


class SimulatedHybridRunner(SimulatedRunner):
    """A simulated runner with StateImages, as a hybrid model has (``HybridRunner``'s rules).

    Each slot's image is a running hash of the tokens fed to it plus their count; slot ``i <
    max_batch`` is lane ``i``. A prefill at ``start == 0`` starts from the zero state, a later
    chunk or a decode must continue a state of exactly that many tokens (else ``ValueError``),
    and every sampled token also depends on the state, so a lost, stale or misplaced image
    changes the output exactly as it would on a real model.
    """

    state_floats = 2  # [hash (24 bits, exact in float32), tokens summarised]

    def __init__(self, *, state_slots: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.num_state_slots = self.info.max_batch + state_slots
        self.states = np.zeros((self.num_state_slots, 2), dtype=np.int64)

    def prefill(self, chunk: PrefillChunk) -> StepResult:
        if chunk.start == 0:
            self.states[chunk.lane] = 0
        self._continue(chunk.lane, chunk.start, "prefill start")
        self._feed(chunk.lane, chunk.tokens)
        return super().prefill(chunk)

    def decode(self, batch: DecodeBatch) -> StepResult:
        for lane, pos, token in zip(batch.lanes.tolist(), batch.positions.tolist(), batch.tokens.tolist()):
            self._continue(lane, pos, "decode position")
            self._feed(lane, [token])
        return super().decode(batch)

    def read_state(self, slot: int) -> np.ndarray:
        self.calls["read_state"] += 1
        return self.states[slot].astype(np.float32)

    def write_state(self, slot: int, data: np.ndarray, length: int | None = None) -> None:
        self.calls["write_state"] += 1
        self.states[slot] = [int(data[0]), -1 if length is None else length]

    def copy_state(self, src: int, dst: int) -> None:
        self.calls["copy_state"] += 1
        self.states[dst] = self.states[src]

    def state_length(self, slot: int) -> int:
        return int(self.states[slot, 1])

    def _continue(self, lane: int, position: int, field: str) -> None:
        have = int(self.states[lane, 1])
        if have >= 0 and have != position:
            raise ValueError(f"{field} {position}: lane {lane}'s state summarises {have} tokens")

    def _feed(self, lane: int, tokens) -> None:
        h = int(self.states[lane, 0])
        for t in np.asarray(tokens).tolist():
            h = zlib.crc32(int(t).to_bytes(4, "little"), h) % (1 << 24)
        self.states[lane] = [h, int(self.states[lane, 1]) + len(tokens)]

    def _salt(self, lane: int) -> int:
        return int(self.states[lane, 0])
