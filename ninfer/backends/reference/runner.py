"""``ReferenceRunner``: the ModelRunner protocol over the NumPy forward pass.

It checks every request from the engine (lanes, positions, page tables, token ids: the checks all
backends share, ``ninfer/backends/inputs.py``) and fails with a ``ValueError`` naming the field, because the reference backend is also how the
engine's own tests find their mistakes. Sampling uses ``ninfer.backends.sampling.sample_row`` with per-lane
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
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from threadpoolctl import ThreadpoolController

from ninfer.backends.reference.forward import PREFILL_BLOCK, DenseForward
from ninfer.backends.inputs import DecodesAtLaunch, check_lane, check_tokens, decode_inputs, prefill_inputs
from ninfer.backends.reference.kv_cache import PagedKVCache
from ninfer.backends.reference.weights import load_weights, mapping_getter
from ninfer.backends.runner import DecodeBatch, PrefillChunk, RunnerInfo, StepResult
from ninfer.backends.sampling import sample_row
from ninfer.models.dense import ARCHITECTURES, DenseConfig


class ReferenceRunner:
    """NumPy fp32 runner of a dense (Llama / Qwen3) model with a paged KV pool.

    ``HybridRunner`` is this runner with another model: it overrides the hooks ``_parse_config``,
    ``_load_weights``, ``_build_model`` and the per-lane state ones, ``_start_prefill``,
    ``_end_prefill`` and ``_start_decode``; the protocol and its checks live here once.
    """

    PIPELINED_DECODE = True  # RunnerInfo.pipelined_decode

    def __new__(cls, artifact: Any = None, **kwargs: Any):
        # Hybrid (Qwen3-Next / Qwen3.5) artifacts get the hybrid runner, a subclass of this one.
        if cls is ReferenceRunner and artifact is not None:
            from ninfer.backends.reference.hybrid_runner import HybridRunner, is_hybrid_config

            with _opened(artifact) as opened:  # a path is opened only to read the config
                hybrid = is_hybrid_config(opened.config)
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
        self._open(artifact, page_size, num_pages, max_batch, max_context, blas_threads)

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
        runner = object.__new__(cls)
        runner._setup(config, mapping_getter(weights), page_size, num_pages, max_batch, max_context, blas_threads)
        return runner

    def _open(self, artifact: Any, *sizes: Any, **options: Any) -> None:
        # The weights are copied out at load, so a file opened here is closed right after.
        with _opened(artifact) as opened:
            self._setup(opened.config, opened.tensor, *sizes, **options)

    def _setup(self, config: Any, get: Callable[[str], np.ndarray], page_size: int, num_pages: int,
               max_batch: int, max_context: int, blas_threads: int | None, **options: Any) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if max_context < 1:
            raise ValueError(f"max_context must be positive, got {max_context}")
        self.config = self._parse_config(config)
        weights = self._load_weights(self.config, get)
        self._build_model(weights, page_size, num_pages, max_batch, max_context, **options)
        # Generated-token counts per lane, for presence/frequency penalties.
        self._counts = np.zeros((max_batch, self.config.vocab_size), dtype=np.int32)
        self._blas_threads = blas_threads
        self._threadpools = ThreadpoolController() if blas_threads is not None else None
        self.info = RunnerInfo(
            page_size=page_size,
            num_pages=num_pages,
            max_batch=max_batch,
            vocab_size=self.config.vocab_size,
            max_context=max_context,
            backend="reference",
            pipelined_decode=self.PIPELINED_DECODE,
        )
        self._launched = DecodesAtLaunch(self.info, self._blas_decode)

    # -- the model (hooks HybridRunner overrides) ------------------------------------------------

    def _parse_config(self, config: Any) -> DenseConfig:
        if isinstance(config, DenseConfig):
            return config
        config = DenseConfig.from_json(config)
        if config.architecture not in ARCHITECTURES:
            raise ValueError(f"the reference backend runs {', '.join(ARCHITECTURES)}, not {config.architecture!r}")
        return config

    def _load_weights(self, config: DenseConfig, get: Callable[[str], np.ndarray]) -> Any:
        return load_weights(config, get)

    def _build_model(self, weights: Any, page_size: int, num_pages: int, max_batch: int, max_context: int) -> None:
        c = self.config
        self._cache = PagedKVCache(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim)
        self._forward = DenseForward(c, weights, self._cache, max_context)

    def _start_prefill(self, lane: int, start: int) -> Any:
        """Before a prefill chunk of ``lane`` at ``start``: what the forward pass takes for the chunk's
        sequence (a dense model keeps no lane state: the lane)."""
        return np.array([lane])

    def _end_prefill(self, lane: int, length: int) -> None:
        """After a prefill chunk: ``lane`` now holds ``length`` tokens (a dense model keeps no lane state)."""

    def _start_decode(self, lanes: np.ndarray, positions: np.ndarray) -> Any:
        """Before a decode step (checked): what the forward pass takes for its rows (a dense model
        keeps no lane state: the lanes)."""
        return lanes

    # -- the protocol -------------------------------------------------------------------------

    def bind_lane(self, lane: int, generated: Sequence[int]) -> None:
        check_lane(self.info, lane, "bind_lane lane")
        ids = check_tokens(self.info, np.asarray(generated, dtype=np.int64).reshape(-1), "bind_lane generated")
        self._counts[lane] = np.bincount(ids, minlength=self.info.vocab_size)

    def prefill(self, chunk: PrefillChunk) -> StepResult:
        with self._blas_limit():
            return self._prefill(chunk)

    def decode(self, batch: DecodeBatch) -> StepResult:
        return self._blas_decode(batch)

    def _blas_decode(self, batch: DecodeBatch) -> StepResult:
        with self._blas_limit():
            return self._decode(batch)

    def launch_decode(self, batch: DecodeBatch, follow: bool = False) -> None:
        """The pipelined protocol, computed at once: ``finish_decode`` returns results in launch order."""
        self._launched.launch(batch, follow)

    def finish_decode(self) -> StepResult:
        return self._launched.finish()

    def _blas_limit(self):
        if self._forward is None:
            raise RuntimeError("the reference runner is closed")
        if self._threadpools is None:
            return contextlib.nullcontext()
        return self._threadpools.limit(limits=self._blas_threads, user_api="blas")

    def _prefill(self, chunk: PrefillChunk) -> StepResult:
        tokens, positions, table = prefill_inputs(self.info, chunk)
        sequence = self._start_prefill(chunk.lane, chunk.start)
        hidden = np.concatenate([
            self._forward.hidden(tokens[i : i + PREFILL_BLOCK], positions[i : i + PREFILL_BLOCK], table, sequence,
                                 decode=False)
            for i in range(0, tokens.size, PREFILL_BLOCK)
        ])
        self._end_prefill(chunk.lane, int(positions[-1]) + 1)
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
        lanes, tokens, positions, tables = decode_inputs(self.info, batch)
        rows = self._start_decode(lanes, positions)
        # The protocol: a decode input token is the lane's previous output, counted from now on.
        np.add.at(self._counts, (lanes, tokens), 1)
        logits = self._forward.logits(self._forward.hidden(tokens, positions, tables, rows, decode=True))
        out = np.array(
            [sample_row(logits[i], batch.sampling[i], self._counts[lanes[i]]) for i in range(lanes.size)],
            dtype=np.int32,
        )
        return StepResult(tokens=out, logits=logits if batch.return_logits else None)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._cache.copy_pages(src, dst)

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page (float32 K and V of every KV layer): what ``read_pages`` returns a page."""
        return self._cache.page_bytes

    def read_pages(self, pages: Sequence[int]) -> np.ndarray:
        """``[2, kv_layers, len(pages), page_size, kv_heads, head_dim]`` float32: K then V."""
        return self._cache.read_pages(pages)

    def write_pages(self, pages: Sequence[int], data: np.ndarray) -> None:
        self._cache.write_pages(pages, data)

    def close(self) -> None:
        """Drop the weights and the pool; the runner is unusable afterwards."""
        self._forward = None  # type: ignore[assignment]
        self._cache = None  # type: ignore[assignment]


def _opened(artifact: Any) -> contextlib.AbstractContextManager:
    """The artifact itself, or for a path the file opened (text component) and closed on exit."""
    if isinstance(artifact, (str, Path)):
        from ninfer.artifact import open_artifact

        return open_artifact(artifact, components=("text",))
    return contextlib.nullcontext(artifact)
