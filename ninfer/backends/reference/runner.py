"""``ReferenceRunner``: the ModelRunner protocol over the NumPy forward pass.

It checks every request from the engine (lanes, positions, page tables, token ids) and fails with
a ``ValueError`` naming the field, because the reference backend is also how the engine's own
tests find their mistakes. Sampling uses ``ninfer.backends.sampling.sample_row`` with per-lane
generated-token counts, as the protocol defines them.

BLAS threads: OpenBLAS worker threads spin while they wait, so on a small machine shared with
anything else (the HTTP server's own threads, a second process) two of them can make a step ten
times slower than one: measured on the 2-core CI machine under load, SmolLM2 decode fell from
22 tok/s with one thread to 2.3 tok/s with two (docs/benchmarks.md). The runner therefore limits
OpenBLAS to ``blas_threads`` (default 1) around each of its steps only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from threadpoolctl import ThreadpoolController

from ninfer.backends.reference.forward import PREFILL_BLOCK, DenseForward
from ninfer.backends.reference.kv_cache import PagedKVCache
from ninfer.backends.reference.weights import ModelWeights, load_weights, weights_from_mapping
from ninfer.backends.runner import DecodeBatch, PrefillChunk, RunnerInfo, StepResult
from ninfer.backends.sampling import sample_row
from ninfer.models.dense import ARCHITECTURES, DenseConfig


class ReferenceRunner:
    """NumPy fp32 runner of a dense (Llama / Qwen3) model with a paged KV pool."""

    def __new__(cls, artifact: Any = None, **kwargs: Any):
        # Hybrid (Qwen3-Next / Qwen3.5) artifacts get the hybrid runner, a subclass of this one.
        if cls is ReferenceRunner and artifact is not None:
            from ninfer.backends.reference.hybrid_runner import HybridRunner, is_hybrid_config

            if isinstance(artifact, (str, Path)):
                from ninfer.artifact import open_artifact

                with open_artifact(artifact, components=("text",)) as opened:  # only to read the config
                    hybrid = is_hybrid_config(opened.config)
            else:
                hybrid = is_hybrid_config(artifact.config)
            if hybrid:
                return super().__new__(HybridRunner)
        return super().__new__(cls)

    def __init__(
        self,
        artifact: Any,
        *,
        page_size: int = 16,
        num_pages: int,
        max_batch: int,
        max_context: int,
        blas_threads: int | None = 1,
    ):
        """``artifact``: an opened artifact (``.config``, ``.tensor(name)``) or a path to one.

        ``blas_threads``: OpenBLAS threads during a step (None leaves the library's setting).
        """
        if isinstance(artifact, (str, Path)):
            from ninfer.artifact import open_artifact

            # The weights are copied out at load, so a file opened here is closed right after.
            with open_artifact(artifact, components=("text",)) as opened:
                self.__init__(opened, page_size=page_size, num_pages=num_pages, max_batch=max_batch,
                              max_context=max_context, blas_threads=blas_threads)
            return
        config = _dense_config(artifact.config)
        weights = load_weights(config, artifact.tensor)
        self._setup(config, weights, page_size, num_pages, max_batch, max_context, blas_threads)

    @classmethod
    def from_weights(
        cls,
        config: DenseConfig,
        weights: Mapping[str, np.ndarray],
        *,
        page_size: int = 16,
        num_pages: int,
        max_batch: int,
        max_context: int,
        blas_threads: int | None = 1,
    ) -> ReferenceRunner:
        """A runner over canonical-name tensors (``ninfer.models.dense.tensor_names``) in memory."""
        runner = cls.__new__(cls)
        loaded = weights_from_mapping(config, weights)
        runner._setup(config, loaded, page_size, num_pages, max_batch, max_context, blas_threads)
        return runner

    def _setup(self, config: DenseConfig, weights: ModelWeights, page_size, num_pages, max_batch, max_context,
               blas_threads):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        self.config = config
        cache = PagedKVCache(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
        self._forward = DenseForward(config, weights, cache, max_context)
        self._cache = cache
        # Generated-token counts per lane, for presence/frequency penalties.
        self._counts = np.zeros((max_batch, config.vocab_size), dtype=np.int32)
        self._blas_threads = blas_threads
        self._threadpools = ThreadpoolController() if blas_threads is not None else None
        self.info = RunnerInfo(
            page_size=page_size,
            num_pages=num_pages,
            max_batch=max_batch,
            vocab_size=config.vocab_size,
            max_context=max_context,
            backend="reference",
        )

    # -- the protocol -------------------------------------------------------------------------

    def bind_lane(self, lane: int, generated: Sequence[int]) -> None:
        self._check_lane(lane, "bind_lane lane")
        ids = self._check_tokens(np.asarray(generated, dtype=np.int64).reshape(-1), "bind_lane generated")
        self._counts[lane] = np.bincount(ids, minlength=self.info.vocab_size)

    def prefill(self, chunk: PrefillChunk) -> StepResult:
        with self._blas_limit():
            return self._prefill(chunk)

    def decode(self, batch: DecodeBatch) -> StepResult:
        with self._blas_limit():
            return self._decode(batch)

    def _blas_limit(self):
        if self._forward is None:
            raise RuntimeError("the reference runner is closed")
        if self._threadpools is None:
            return contextlib.nullcontext()
        return self._threadpools.limit(limits=self._blas_threads, user_api="blas")

    def _prefill(self, chunk: PrefillChunk) -> StepResult:
        self._check_lane(chunk.lane, "prefill lane")
        tokens = self._check_tokens(np.asarray(chunk.tokens).reshape(-1), "prefill tokens")
        if tokens.size == 0:
            raise ValueError("prefill tokens: the chunk is empty")
        if chunk.start < 0:
            raise ValueError(f"prefill start must be >= 0, got {chunk.start}")
        positions = np.arange(chunk.start, chunk.start + tokens.size, dtype=np.int64)
        end = int(positions[-1]) + 1
        table = self._check_page_table(np.asarray(chunk.page_table).reshape(1, -1), [end], "prefill page_table")
        hidden = np.concatenate([
            self._forward.hidden(tokens[i : i + PREFILL_BLOCK], positions[i : i + PREFILL_BLOCK], table, seqs=1)
            for i in range(0, tokens.size, PREFILL_BLOCK)
        ])
        if chunk.return_logits:
            logits = self._forward.logits(hidden)
            last = logits[-1]
        else:
            logits = None
            last = self._forward.logits(hidden[-1:])[0] if chunk.sample is not None else None
        out = np.empty(0, dtype=np.int32)
        if chunk.sample is not None:
            out = np.array([sample_row(last, chunk.sample, self._counts[chunk.lane])], dtype=np.int32)
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
            raise ValueError(
                f"decode: lanes ({rows}), tokens ({tokens.size}), positions ({positions.size}) and "
                f"sampling ({len(batch.sampling)}) must have one entry per row"
            )
        if positions.min() < 0:
            raise ValueError(f"decode positions must be >= 0, got {positions.tolist()}")
        tables = np.asarray(batch.page_tables).reshape(rows, -1)
        tables = self._check_page_table(tables, (positions + 1).tolist(), "decode page_tables")
        if rows > 1:
            # Two rows writing one KV slot means a page is shared without copy-on-write.
            targets = tables[np.arange(rows), positions // self.info.page_size] * self.info.page_size
            targets += positions % self.info.page_size
            if np.unique(targets).size != rows:
                raise ValueError("decode page_tables: two rows write the same KV slot (a shared page "
                                 "needs copy_pages before it is written)")
        # The protocol: a decode input token is the lane's previous output, counted from now on.
        np.add.at(self._counts, (lanes, tokens), 1)
        logits = self._forward.logits(self._forward.hidden(tokens, positions, tables, seqs=rows))
        out = np.array(
            [sample_row(logits[i], batch.sampling[i], self._counts[lanes[i]]) for i in range(rows)],
            dtype=np.int32,
        )
        return StepResult(tokens=out, logits=logits if batch.return_logits else None)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._cache.copy_pages(src, dst)

    def read_pages(self, pages: Sequence[int]) -> np.ndarray:
        """``[2, num_layers, len(pages), page_size, kv_heads, head_dim]`` float32: K then V."""
        return self._cache.read_pages(pages)

    def write_pages(self, pages: Sequence[int], data: np.ndarray) -> None:
        self._cache.write_pages(pages, data)

    def close(self) -> None:
        """Drop the weights and the pool; the runner is unusable afterwards."""
        self._forward = None  # type: ignore[assignment]
        self._cache = None  # type: ignore[assignment]

    # -- checks ---------------------------------------------------------------------------------

    def _check_lane(self, lane: int, field: str) -> None:
        if not 0 <= lane < self.info.max_batch:
            raise ValueError(f"{field} must lie in [0, {self.info.max_batch}), got {lane}")

    def _check_tokens(self, tokens: np.ndarray, field: str) -> np.ndarray:
        tokens = tokens.astype(np.int64, copy=False)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.info.vocab_size):
            bad = tokens[(tokens < 0) | (tokens >= self.info.vocab_size)][0]
            raise ValueError(f"{field}: token id {int(bad)} is outside the vocabulary [0, {self.info.vocab_size})")
        return tokens

    def _check_page_table(self, tables: np.ndarray, ends: Sequence[int], field: str) -> np.ndarray:
        """Each row must cover positions [0, end) with valid page ids."""
        tables = tables.astype(np.int64, copy=False)
        size = self.info.page_size
        for row, end in enumerate(ends):
            if end > self.info.max_context:
                raise ValueError(f"{field}: position {end - 1} exceeds max_context {self.info.max_context}")
            needed = -(-end // size)
            used = tables[row, :needed]
            if used.size < needed:
                raise ValueError(f"{field}: row {row} has {used.size} pages, position {end - 1} needs {needed}")
            if used.min() < 0 or used.max() >= self.info.num_pages:
                raise ValueError(f"{field}: row {row} uses page ids {used.tolist()} outside [0, {self.info.num_pages})")
        return tables


def _dense_config(config: Any) -> DenseConfig:
    if isinstance(config, DenseConfig):
        return config
    config = DenseConfig.from_json(config)
    if config.architecture not in ARCHITECTURES:
        raise ValueError(f"the reference backend runs {', '.join(ARCHITECTURES)}, not {config.architecture!r}")
    return config
