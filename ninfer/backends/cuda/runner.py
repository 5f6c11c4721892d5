"""``CudaRunner``: the ModelRunner protocol on one NVIDIA GPU.

Weights live in one device allocation; activations, the KV pool, RoPE tables, sampler counts and
the per-step inputs in one workspace allocation (``forward.StepBuffers``). A decode step writes its
inputs into pinned memory and replays the CUDA Graph captured for exactly that batch size (or launches
directly with ``cuda_graph=False``): the graph copies the inputs up, runs the step and copies back
only the sampled token ids. Prefill runs in sub-chunks of ``max_prefill_rows`` rows: a whole one of
at most ``PREFILL_GRAPH_MAX_ROWS`` replays the prefill graph (``cuda_graph``; ``_prefill_layers`` says
when it is captured), any other launches its kernels one by one.

Requests are validated by the checks every backend shares (``ninfer/backends/inputs.py``): a wrong
lane, token, position or page table raises ``ValueError`` naming the field before anything reaches
the GPU. Every call makes the
runner's context current first (about a microsecond), so the runner may be driven from any thread.
A sticky CUDA error (``CudaError.sticky``: the context is unusable) is logged once and then raised
by every later call without touching the device, so the Engine fails over to "unavailable" and
nothing waits on a dead context.

``num_pages="auto"`` (``--kv-capacity auto``) sizes the KV pool from the device memory left once the
weights are placed: see ``auto_kv_pages``; ``startup["kv_auto"]`` records the arithmetic.

``host_arena_bytes`` (the Engine's Host budget, ``--host-context-mib``) pins the Host backing once, at
startup (``host_arena.HostArena``): ``read_pages`` (and the hybrid runner's ``read_state``) return
arrays carved from it, filled by DMA straight from the device, and ``write_pages`` / ``write_state``
copy such arrays back directly. 0 (the default) keeps pageable arrays through a small staging buffer.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ninfer.artifact.bf16 import from_float32
from ninfer.backends.cuda import runtime as rt
from ninfer.backends.cuda.intervals import StreamIntervals
from ninfer.backends.cuda import weights as wt
from ninfer.backends.cuda.forward import (DECODE_GEMMS, FRAGMENT_ORDER, GEMV_MAX_ROWS, GRAPH_DEPTHS, PREFILL_GEMMS,
                                          PREFILL_SPLIT, Forward, StepBuffers, check_supported, fragment_bytes,
                                          fragment_tiles)
from ninfer.backends.cuda import cublaslt
from ninfer.backends.cuda.host_arena import HostArena
from ninfer.backends.inputs import check_follow, check_lane, check_tokens, decode_inputs, prefill_inputs
from ninfer.backends.runner import DecodeBatch, PrefillChunk, RunnerInfo, SamplingRow, StepResult
from ninfer.models.dense import ARCHITECTURES, DenseConfig, layer_tensor_names

_MASK64 = (1 << 64) - 1
log = logging.getLogger("ninfer.cuda")
AUTO = "auto"  # num_pages: size the KV pool from the free device memory (``auto_kv_pages``)
KV_HEADROOM_BYTES = 1 << 30  # what --kv-capacity auto leaves free (the spec's sizing headroom)
# Device memory a decode graph takes once instantiated, taken 2x for safety: the Qwen3-8B shape on the
# H200 measured 4 MiB for 8 graphs and 128 MB for 240 (a graph per batch size, side and attention
# depth: about 0.53 MiB each). The startup record shows the real figure (graph_bytes,
# free_bytes_after_startup).
GRAPH_BYTES_ESTIMATE = 1 << 20


def auto_kv_pages(device: rt.Device, probe: StepBuffers, graphs: int) -> tuple[int, dict[str, int]]:
    """KV pages for ``--kv-capacity auto``: the free memory once the weights and the workspace without
    its KV pool are placed, less the graphs still to be captured and the 1 GiB headroom. The kernel
    modules load afterwards, out of the headroom (a few MiB: 1.03 GiB stayed free in docs/benchmarks.md's
    serving run).

    ``probe`` is a workspace with a one-page pool: its size gives the fixed part; it is freed here."""
    page_bytes = probe.page_elems * probe.kv_itemsize
    fixed = probe.workspace_bytes - -(-page_bytes // 256) * 256
    device.free(probe.arena.base)
    free = device.free_memory()
    usable = free - fixed - graphs * GRAPH_BYTES_ESTIMATE - KV_HEADROOM_BYTES
    pages = usable // page_bytes
    if pages < 1:
        raise MemoryError(f"--kv-capacity auto: {free} bytes free leave no room for a KV pool after "
                          f"{fixed} bytes of workspace, the graphs and the {KV_HEADROOM_BYTES}-byte headroom")
    return int(pages), {"free_bytes": free, "workspace_without_kv": fixed, "graph_reserve": graphs * GRAPH_BYTES_ESTIMATE,
                        "headroom": KV_HEADROOM_BYTES, "page_bytes": page_bytes, "pages": int(pages)}


def _on_device(method):
    """A protocol call: make the context current first; after a sticky CUDA error (the context is
    unusable until the process ends) refuse every later call with that same error, at once."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.fault is not None:
            raise self.fault
        self.device.make_current()
        try:
            return method(self, *args, **kwargs)
        except rt.CudaError as e:
            if e.sticky:
                self.fault = e
                log.critical("CUDA error %s in %s: the GPU context is unusable; the engine stops", e.name,
                             method.__name__)
            raise
    return call


class CudaRunner:
    """A dense (Llama / Qwen3) model on the GPU; see the module docstring."""

    PIPELINED_DECODE = True  # RunnerInfo.pipelined_decode
    # Whole prefill sub-chunks of up to this many rows replay a graph where ``cuda_graph`` is on: a graph
    # saves the gaps between a pass's launches (1024-row passes of the Qwen3-8B shape 2-2.6% faster on
    # an H100, 2048 and 4096 level), which a larger pass has fewer of for its time; one 8192-row pass
    # measured 2% slower as a graph, twice, for reasons not found (docs/benchmarks.md).
    PREFILL_GRAPH_MAX_ROWS = 2048

    def __init__(self, artifact: Any, *, page_size: int = 16, num_pages: int | str, max_batch: int,
                 max_context: int, device: int | rt.Device = 0, kv_dtype: str = "bf16",
                 cuda_graph: bool = True, max_prefill_rows: int = 512, prefill_gemm: str = "fp32",
                 host_arena_bytes: int = 0, host_arena_state_images: int = 0):
        """``artifact``: an opened artifact (``.config``, ``.tensor(name)``) or a path to one.
        ``host_arena_bytes``: the pinned Host backing (0: none); ``host_arena_state_images``: StateImages
        it holds on top (the spec's default budget adds eight; a dense model's images are empty)."""
        if isinstance(artifact, (str, Path)):
            from ninfer.artifact import open_artifact

            artifact = open_artifact(artifact, components=("text",))
        config = _dense_config(artifact.config)
        check_supported(config, kv_dtype)
        dev = device if isinstance(device, rt.Device) else rt.Device(device)
        stream = dev.stream()
        weights, report = wt.upload(dev, stream, config, artifact.tensor)
        self._setup(config, dev, stream, weights, page_size=page_size, num_pages=num_pages,
                    max_batch=max_batch, max_context=max_context, kv_dtype=kv_dtype,
                    cuda_graph=cuda_graph, max_prefill_rows=max_prefill_rows, prefill_gemm=prefill_gemm,
                    host_arena_bytes=host_arena_bytes, host_arena_state_images=host_arena_state_images)
        self.startup["weights_bytes"] = report.nbytes
        self.startup["weights_upload_gb_per_s"] = round(report.gb_per_s, 2)

    @classmethod
    def from_device_weights(cls, config: DenseConfig, weights: Mapping[str, rt.DevicePtr], *,
                            device: rt.Device, page_size: int = 16, num_pages: int | str, max_batch: int,
                            max_context: int, kv_dtype: str = "bf16", cuda_graph: bool = True,
                            max_prefill_rows: int = 512, prefill_gemm: str = "fp32", host_arena_bytes: int = 0,
                            host_arena_state_images: int = 0) -> CudaRunner:
        """A runner over weights already on ``device`` in the layout of ``weights.device_layout``."""
        check_supported(config, kv_dtype)
        wt.check_device_weights(config, weights)
        runner = cls.__new__(cls)
        runner._setup(config, device, device.stream(), dict(weights), page_size=page_size,
                      num_pages=num_pages, max_batch=max_batch, max_context=max_context,
                      kv_dtype=kv_dtype, cuda_graph=cuda_graph, max_prefill_rows=max_prefill_rows,
                      prefill_gemm=prefill_gemm, host_arena_bytes=host_arena_bytes,
                      host_arena_state_images=host_arena_state_images)
        return runner

    def _setup(self, config, device, stream, weights, *, page_size, num_pages, max_batch, max_context,
               kv_dtype, cuda_graph, max_prefill_rows, prefill_gemm, host_arena_bytes=0, host_arena_state_images=0):
        if prefill_gemm not in PREFILL_GEMMS:
            raise ValueError(f"prefill_gemm must be one of {', '.join(PREFILL_GEMMS)}, got {prefill_gemm!r}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        if num_pages != AUTO and (not isinstance(num_pages, int) or num_pages < 1):
            raise ValueError(f"num_pages must be a positive int or {AUTO!r}, got {num_pages!r}")
        for name, value in (("max_batch", max_batch), ("max_context", max_context),
                            ("max_prefill_rows", max_prefill_rows)):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if max_batch > GEMV_MAX_ROWS:
            raise ValueError(f"max_batch {max_batch}: the CUDA backend's decode GEMVs take at most {GEMV_MAX_ROWS} rows")
        if host_arena_bytes < 0 or host_arena_state_images < 0:
            raise ValueError(f"host_arena_bytes and host_arena_state_images must be >= 0, got "
                             f"{host_arena_bytes} and {host_arena_state_images}")
        self.config = config
        self.device = device
        self.stream = stream
        self.fault: rt.CudaError | None = None  # the sticky error that ended this runner, if any
        self.host_arena: HostArena | None = None  # the pinned Host backing (attach_host_arena)
        self.kv_dtype = kv_dtype
        self.kernels = rt.Kernels(device)

        def buffers(pages: int) -> StepBuffers:
            return self._make_buffers(page_size=page_size, num_pages=pages, max_batch=max_batch,
                                      max_context=max_context, max_rows=max_prefill_rows, kv_dtype=kv_dtype,
                                      tensor_core_prefill=prefill_gemm != "fp32")

        kv_sizing = None
        graphs = 2 * max_batch * (len(GRAPH_DEPTHS) + 1) + 1 if cuda_graph else 0  # sides x depths, prefill
        graph_reserve = graphs * GRAPH_BYTES_ESTIMATE + KV_HEADROOM_BYTES
        if num_pages == AUTO:  # whatever else the workspace holds comes first; the pool gets the rest
            # (the fragment-order copies too: they leave at least a GiB for the workspace's other parts)
            self.fragments = self._fragment_copies(weights, max_batch, keep_free=graph_reserve + (1 << 30))
            num_pages, kv_sizing = auto_kv_pages(device, buffers(1), graphs=graphs)
        self.buffers = buffers(num_pages)
        if kv_sizing is None:  # a pool of the size asked for is in place: the copies take what is left
            self.fragments = self._fragment_copies(weights, max_batch, keep_free=graph_reserve)
        self.buffers.init(stream)
        self._lt = None
        if prefill_gemm != "fp32":
            self._lt = cublaslt.LtMatmul(self.buffers.lt_workspace)
        self.forward = self._make_forward(weights, page_size=page_size, kv_dtype=kv_dtype)
        for name in self.forward.kernel_names():  # module loads are not allowed during capture
            self.kernels[name]
        self.info = RunnerInfo(page_size=page_size, num_pages=num_pages, max_batch=max_batch,
                               vocab_size=config.vocab_size, max_context=max_context, backend="cuda",
                               pipelined_decode=self.PIPELINED_DECODE, times_device=True)
        self._intervals = StreamIntervals(device)
        self._outs = [device.pinned(4 * max_batch).view(np.int32) for _ in range(2)]  # a side each
        self._out = self._outs[0]  # a prefill's sampled token
        self._done = [device.event() for _ in range(2)]  # a side's step has finished
        self._uploaded = device.event()  # a prefill sub-chunk's inputs have been copied (unrecorded: no wait)
        self._pending: collections.deque = collections.deque()  # (side, lanes, logits) of launched steps
        self._launched = 0
        self._decode_rows = np.arange(max_batch, dtype=np.int32)  # a decode step's row r is sequence r
        self._count_staging = device.pinned(4 * config.vocab_size).view(np.int32)
        self._page_staging = device.pinned(self.buffers.page_elems * self.buffers.kv_itemsize)
        self.startup: dict[str, Any] = {"device": device.name, "sync": device.sync, "kv_dtype": kv_dtype,
                                        "prefill_gemm": prefill_gemm, "kv_pages": num_pages,
                                        "workspace_bytes": self.buffers.workspace_bytes}
        self.startup["fragment_bytes"] = sum(ptr.nbytes for ptr in self.fragments.values())
        self.startup.update(self._startup_details())
        if kv_sizing is not None:
            self.startup["kv_auto"] = kv_sizing
        # rows -> attention depth -> the graph of each side
        self.graphs: dict[int, dict[int, tuple[rt.Graph, rt.Graph]]] = {}
        if cuda_graph:
            free_before = device.free_memory()
            start = time.perf_counter()
            for rows in range(1, max_batch + 1):
                self.graphs[rows] = self._capture_decode(rows)
            self.startup["graph_capture_s"] = round(time.perf_counter() - start, 3)
            self.startup["graph_bytes"] = free_before - device.free_memory()
            self.startup["graph_nodes"] = next(iter(self.graphs[1].values()))[0].nodes
            self.startup["graph_count"] = sum(2 * len(by_depth) for by_depth in self.graphs.values())
        # The sub-chunk size whose passes replay the prefill graph (None: none do); tools may change it.
        graphed = cuda_graph and self.buffers.rows <= self.PREFILL_GRAPH_MAX_ROWS
        self.graph_prefill_rows = self.buffers.rows if graphed else None
        # Prefill graphs by (rows, outputs, GEMM generation): passes whose every row's, last row's or no
        # row's hidden states leave (``Forward.layers``).
        self._prefill_graphs: dict[tuple[int, str, int], rt.Graph] = {}
        self._prefill_warmed: set[tuple[int, str, int]] = set()  # keys whose pass ran kernel by kernel
        if prefill_gemm == "cublaslt-tuned":
            self.startup["prefill_gemm_tuning"] = self.tune_prefill_gemms()
        if self.graph_prefill_rows:
            self.startup["prefill_graph"] = self._capture_prefill()
        self.startup["host_arena_bytes"] = 0
        if host_arena_bytes:  # 0: --host-context-mib 0, no Host backing at all
            self.attach_host_arena(host_arena_bytes + host_arena_state_images * self.state_bytes)
        self.startup["free_bytes_after_startup"] = device.free_memory()

    @_on_device
    def tune_prefill_gemms(self, rows: int | None = None, min_rows: int | None = None) -> dict[str, Any]:
        """Prefill ``rows`` tokens (default: a whole sub-chunk) in one pass, token 0 in lane 0 over
        the first pages, with cuBLASLt noting its GEMMs; then time each GEMM's algorithms over the
        model's weights (``LtMatmul.tune``): prefills of that many rows run the fastest from then on.
        Fewer than ``min_rows`` rows (default ``cublaslt.TUNE_MIN_ROWS``, which says why) keep the
        heuristic's picks. The startup of a ``cublaslt-tuned`` runner calls it, before any request:
        the pass writes KV pages and a lane that no request holds. Returns what was timed and chosen,
        and the seconds."""
        if self._lt is None:
            raise RuntimeError("tune_prefill_gemms: this runner's prefill GEMMs are not cuBLASLt's")
        info = self.info
        rows = min(rows or self.buffers.rows, self.buffers.rows, info.max_context, info.num_pages * info.page_size)
        if rows < (cublaslt.TUNE_MIN_ROWS if min_rows is None else min_rows):
            return {"rows": rows, "seconds": 0.0, "gemms": {}}
        start = time.perf_counter()
        graph_rows, self.graph_prefill_rows = self.graph_prefill_rows, None  # recording needs the launches
        try:
            with self._lt.recording():
                self._startup_prefill(rows)
        finally:
            self.graph_prefill_rows = graph_rows
        events = (self.device.event(timing=True), self.device.event(timing=True))
        gemms = self._lt.tune_recorded(self.stream, events)
        for event in events:
            rt.check(rt.cu.cuEventDestroy(event), "cuEventDestroy")
        return {"rows": rows, "seconds": round(time.perf_counter() - start, 3), "gemms": gemms}

    def _capture_prefill(self) -> dict[str, Any]:
        """Capture the prefill graphs before any request: for a sub-chunk in the middle of a prompt
        (no outputs) and one that ends it (its last row sampled), two whole sub-chunks of token 0 in
        lane 0 over the first pages each, the first launched kernel by kernel, the second captured and
        replayed (``_prefill_layers``; like the tuning's pass they write KV pages and a lane that no
        request holds). A pass with every row's logits (tests, parity tools) is captured when first
        met. Returns the rows, the nodes of each graph and the seconds all took; nothing where a whole
        sub-chunk is longer than a sequence may be."""
        info, rows = self.info, self.graph_prefill_rows
        if rows > min(info.max_context, info.num_pages * info.page_size):
            return {}
        start = time.perf_counter()
        for sample in (None, SamplingRow()):
            for _ in range(2):
                self._startup_prefill(rows, sample)
        rt.synchronize(self.stream)
        nodes = {outputs: graph.nodes for (_, outputs, _), graph in self._prefill_graphs.items()}
        return {"rows": rows, "nodes": nodes["last"], "kv_only_nodes": nodes["none"],
                "seconds": round(time.perf_counter() - start, 3)}

    def _startup_prefill(self, rows: int, sample: SamplingRow | None = None) -> None:
        """The pass that tuning and the graph's capture make: ``rows`` tokens 0 in lane 0 over the first
        pages (at startup no request holds them), its last row sampled with ``sample``."""
        pages = np.arange(-(-rows // self.info.page_size), dtype=np.int32)
        self.prefill(PrefillChunk(lane=0, tokens=np.zeros(rows, np.int32), start=0, page_table=pages, sample=sample))

    def _prefill_layers(self, rows: int, stream, outputs: str = "all") -> None:
        """One sub-chunk's layers (``outputs``: as ``Forward.layers``). A sub-chunk of
        ``graph_prefill_rows`` rows (by default a whole one) replays a prefill graph: the pass's
        launches recorded once, so the device goes from kernel to kernel without the host launching
        each (the gaps between kernels halve: 2% of a 1024-row prefill of the Qwen3-8B shape on an
        H100). A graph keeps the cuBLASLt algorithms it was captured with, so after they change
        (``LtMatmul.generation``), or the rows do, the first such sub-chunk runs kernel by kernel,
        which also loads the kernels of any new algorithm (no module may load during a capture), and
        the next is captured anew."""
        if rows != self.graph_prefill_rows:
            self.forward.layers(rows, stream, outputs)
            return
        key = self._graph_key(rows, outputs)
        if key not in self._prefill_graphs:
            if key not in self._prefill_warmed:
                self.forward.layers(rows, stream, outputs)
                self._prefill_warmed = {k for k in self._prefill_warmed if self._current(k)} | {key}
                return
            self._drop_prefill_graphs(stale_only=True)
            graph = rt.Graph.capture(stream, lambda: self.forward.layers(rows, stream, outputs))
            key = self._graph_key(rows, outputs)  # read after: a plan made during it counts
            self._prefill_graphs[key] = graph
        self._prefill_graphs[key].launch(stream)

    def _graph_key(self, rows: int, outputs: str) -> tuple[int, str, int]:
        """What a prefill graph depends on: its rows, its outputs, and the generation of cuBLASLt's
        algorithms."""
        return rows, outputs, self._lt.generation if self._lt is not None else 0

    def _current(self, key: tuple[int, str, int]) -> bool:
        """Whether a prefill graph of ``key`` could be replayed now: the rows and algorithms hold."""
        return key[0] == self.graph_prefill_rows and key == self._graph_key(key[0], key[1])

    def forget_prefill_graph(self) -> None:
        """For tools that change the forward's options (its kernels, its GEMM engine) between prefills,
        which the graphs do not see: the next whole sub-chunk of each kind runs kernel by kernel,
        loading any new kernel, and the one after is captured anew."""
        self._drop_prefill_graphs()
        self._prefill_warmed = set()

    def _drop_prefill_graphs(self, stale_only: bool = False) -> None:
        """Destroy the prefill graphs (``stale_only``: those that could not be replayed now)."""
        graphs = getattr(self, "_prefill_graphs", {})
        stale = [key for key in graphs if not (stale_only and self._current(key))]
        if stale:
            rt.synchronize(self.stream)  # a replay still in flight finishes before its graph goes
        for key in stale:
            graphs.pop(key).destroy()

    # -- what a model family changes: its buffers, its forward pass, its start-up figures --------

    def _make_buffers(self, **shape: Any) -> StepBuffers:
        return StepBuffers(self.device, self.config, **shape)

    def _make_forward(self, weights: Mapping[str, rt.DevicePtr], **options: Any) -> Forward:
        return Forward(self.kernels, self.config, weights, self.buffers, lt=self._lt, fragments=self.fragments,
                       **options)

    def _fragment_copies(self, weights: Mapping[str, rt.DevicePtr], max_batch: int,
                         keep_free: int = 0) -> dict[str, rt.DevicePtr]:
        """Every layer's FRAGMENT_ORDER matrices in fragment order (``Forward.fragments``), reordered on
        the device, where a decode step may run them on the tensor cores (3 rows or more): a second copy
        beside the row-major weights that prefill and the one-row GEMVs read (for the Qwen3-8B shape
        13.9 GB: q/k/v, o, gate/up and down). None where a row is not whole 16-byte chunks, or where
        they would leave less than ``keep_free`` bytes free (the batched GEMVs then read the row-major
        weights)."""
        c = self.config
        layer = layer_tensor_names(c, 0)
        shapes = {matrix: layer[f"layers.0.{matrix}"] + (fragment_tiles(matrix),) for matrix in FRAGMENT_ORDER}
        if any(k % 8 for _, k, _ in shapes.values()) or all(
                DECODE_GEMMS[matrix][rows] == "fp32" for matrix in shapes for rows in range(1, max_batch + 1)):
            return {}
        sizes = {matrix: fragment_bytes(rows, k, tiles, matrix == "gate_up")
                 for matrix, (rows, k, tiles) in shapes.items()}
        total = c.num_layers * sum(sizes.values())
        if total > self.device.free_memory() - keep_free:
            log.warning("batched decode reads the row-major weights: their fragment-order copies (%.2f GiB) "
                        "do not fit", total / 2**30)
            return {}
        kernel = self.kernels["fragment_order_bf16"]
        copies = {}
        for i in range(c.num_layers):
            for matrix, (rows, k, tiles) in shapes.items():
                name = f"layers.{i}.{matrix}"
                swiglu = matrix == "gate_up"
                copy = self.device.alloc(sizes[matrix], f"{name} fragments")
                chunks = copy.nbytes // 16
                kernel.launch((-(-chunks // kernel.meta["threads"]),), (kernel.meta["threads"],),
                              (copy, weights[name], rows, k, tiles, int(swiglu), chunks), self.stream)
                copies[name] = copy
        rt.synchronize(self.stream)
        return copies

    def _startup_details(self) -> dict[str, Any]:
        return {}

    def _fill_state_rows(self, inp, lanes: np.ndarray, positions: np.ndarray) -> None:
        """A checked decode step is being launched: a runner with recurrent state fills the
        slots its rows read and write (``Inputs.state_in`` / ``state_out``); a dense model has none."""

    # -- the protocol -------------------------------------------------------------------------

    @_on_device
    def bind_lane(self, lane: int, generated: Sequence[int]) -> None:
        self._check_lane(lane, "bind_lane lane")
        ids = check_tokens(self.info, np.asarray(generated, dtype=np.int64).reshape(-1), "bind_lane generated")
        self._count_staging[:] = np.bincount(ids, minlength=self.info.vocab_size)
        row = self.buffers.counts.at(lane * self.info.vocab_size * 4, self.info.vocab_size * 4)
        rt.copy_h2d(row, self._count_staging, self.stream)
        rt.synchronize(self.stream)

    @_on_device
    def prefill(self, chunk: PrefillChunk) -> StepResult:
        if self._pending:  # its pinned inputs may still be waiting to be copied
            raise RuntimeError("prefill: a decode step is in flight; finish_decode it first")
        tokens, positions, table = prefill_inputs(self.info, chunk)
        inp, b, stream = self.buffers.inputs, self.buffers, self.stream
        logits = np.empty((tokens.size, self.info.vocab_size), np.float32) if chunk.return_logits else None
        interval = self._intervals.begin(stream)  # the call's stream interval (request_done work)
        for first in range(0, tokens.size, b.rows):
            n = min(b.rows, tokens.size - first)
            # The pinned inputs are rewritten only once the device has copied them in (not once the
            # sub-chunk before has run): the device goes on from one sub-chunk to the next, and into
            # the sampling, without waiting for the host.
            rt.wait_event(self._uploaded)
            inp.tokens[:n] = tokens[first:first + n]
            inp.positions[:n] = positions[first:first + n]
            inp.row_table[:n] = 0
            inp.split[0] = PREFILL_SPLIT
            self._fill_table(0, table[0])
            inp.upload(stream)
            rt.check(rt.cu.cuEventRecord(self._uploaded, stream), "cuEventRecord")
            # Hidden states leave only as logits: all rows' where asked, else the last row's where
            # this sub-chunk ends a prompt that samples.
            ends = chunk.sample is not None and first + n == tokens.size
            outputs = "all" if logits is not None else "last" if ends else "none"
            self._prefill_layers(n, stream, outputs)
            if logits is not None:
                for r in range(0, n, b.logit_rows):
                    m = min(b.logit_rows, n - r)
                    self.forward.logits(r, m, stream)
                    rt.copy_d2h(logits[first + r:first + r + m], b.logits, stream)
                rt.synchronize(stream)  # into the caller's (pageable) array
        rt.wait_event(self._uploaded)  # the inputs are free for the sampling's, or the next call's
        out = np.empty(0, dtype=np.int32)
        if chunk.sample is not None:
            self._fill_sampling(0, chunk.lane, chunk.sample)
            inp.upload(stream)
            self.forward.logits(n - 1, 1, stream)
            self.forward.sample(1, stream)
            rt.copy_d2h(self._out[:1], b.out, stream)
        device_interval = self._intervals.end(interval, stream)
        if chunk.sample is not None:
            rt.synchronize(stream)
            out = self._out[:1].copy()
        return StepResult(tokens=out, logits=logits, device_interval=device_interval)

    @_on_device
    def decode(self, batch: DecodeBatch) -> StepResult:
        self.launch_decode(batch)
        return self.finish_decode()

    @_on_device
    def launch_decode(self, batch: DecodeBatch, follow: bool = False) -> None:
        """Enqueue a decode step and return without waiting for it; ``finish_decode`` collects it.

        Steps alternate between the two pinned input and output blocks, so a step may be launched
        while the one before it still runs. ``follow``: the rows are the previous launched step's
        rows, in order, and each input token is that step's sampled token, read on the device
        (``batch.tokens`` is ignored): the step can be queued before the host has seen them."""
        if len(self._pending) >= 2:
            raise RuntimeError("launch_decode: two decode steps are in flight; finish_decode one first")
        if follow:
            check_follow(self.info, self._pending[-1][1] if self._pending else None, batch)
        lanes, tokens, positions, tables = decode_inputs(self.info, batch)
        rows = lanes.size
        side = self._launched % 2
        inp, stream = self.buffers.inputs, self.stream
        inp.select(side)
        if not follow:
            inp.tokens[:rows] = tokens
        inp.follow[0] = follow
        inp.positions[:rows] = positions
        inp.row_table[:rows] = self._decode_rows[:rows]
        inp.lanes[:rows] = lanes
        self._fill_state_rows(inp, lanes, positions)
        position_list = positions.tolist()
        longest = max(position_list) + 1
        inp.split[0] = split = self.forward.decode_split(longest, rows)
        inp.split[1] = self.forward.decode_prefetch(sum(position_list) + rows)  # keys of the step
        width = min(tables.shape[1], self.buffers.max_pages)
        inp.page_tables[:rows, :width] = tables[:, :width]
        self._fill_sampling_rows(lanes, batch.sampling)
        depth = self.forward.decode_depth(split, longest)
        if rows in self.graphs:
            self.graphs[rows][depth][side].launch(stream)
        else:
            self._decode_step(rows, depth)
        logits = None
        if batch.return_logits:
            logits = np.empty((rows, self.info.vocab_size), np.float32)
            rt.copy_d2h(logits, self.buffers.logits, stream)
        rt.check(rt.cu.cuEventRecord(self._done[side], stream), "cuEventRecord")
        self._launched += 1
        self._pending.append((side, lanes, logits))

    @_on_device
    def finish_decode(self) -> StepResult:
        """Wait for the oldest decode step in flight and return its tokens."""
        if not self._pending:
            raise RuntimeError("finish_decode: no decode step is in flight")
        side, lanes, logits = self._pending.popleft()
        rt.wait_event(self._done[side])
        return StepResult(tokens=self._outs[side][:lanes.size].copy(), logits=logits)

    def _decode_step(self, rows: int, depth: int | None = None) -> None:
        """A decode step's device work, the body of its CUDA Graph: the selected side's pinned inputs
        up, the forward pass (attention ``depth`` splits deep) and the sampler, the token ids down to
        that side's pinned outputs. The copies ride in the graph (pinned buffers at fixed addresses)
        so a step costs the host one graph launch and one wait."""
        side = self.buffers.inputs.side
        self.buffers.inputs.upload(self.stream)
        self.forward.decode(rows, self.stream, depth)
        rt.copy_d2h(self._outs[side][:rows], self.buffers.out, self.stream)

    def replay_graph(self, rows: int) -> rt.Graph:
        """The side-0 decode graph of ``rows`` rows at the depth side 0's current inputs need: what
        tools replay back to back for a step's device time alone."""
        inp = self.buffers.inputs
        inp.select(0)
        return self.graphs[rows][self.forward.decode_depth(int(inp.split[0]), int(inp.positions[:rows].max()) + 1)][0]

    def _capture_decode(self, rows: int) -> dict[int, tuple[rt.Graph, rt.Graph]]:
        """The decode graphs of ``rows`` rows: per attention depth, one per input/output side."""
        graphs = {}
        for depth in self.forward.decode_depths():
            pair = []
            for side in (0, 1):
                self.buffers.inputs.select(side)
                pair.append(rt.Graph.capture(self.stream, lambda: self._decode_step(rows, depth)))
            graphs[depth] = (pair[0], pair[1])
        self.buffers.inputs.select(0)
        return graphs

    @_on_device
    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        src_i, dst_i = self._pages(src), self._pages(dst)
        if len(src_i) != len(dst_i):
            raise ValueError(f"copy_pages: {len(src_i)} source pages but {len(dst_i)} destination pages")
        if set(src_i.tolist()) & set(dst_i.tolist()):
            # Overlapping lists must read every source before any write, as the reference does.
            self.write_pages(dst_i, self.read_pages(src_i))
            return
        size = self.buffers.page_elems * self.buffers.kv_itemsize
        for s, d in zip(src_i, dst_i):
            rt.copy_d2d(self.buffers.kv.at(int(d) * size, size), self.buffers.kv.at(int(s) * size, size), size, self.stream)
        rt.synchronize(self.stream)

    @_on_device
    def read_pages(self, pages: Sequence[int]) -> np.ndarray:
        """``[2, kv_layers, len(pages), page_size, kv_heads, head_dim]``, the reference layout, in the
        pool's storage type (bf16 bit patterns as uint16, or float32): a pause snapshot holds
        ``page_bytes`` a page on the Host, not a widened copy, and ``write_pages`` restores it bit-exact.

        With a Host arena the array lies in it: each page is one DMA straight from the pool, and the
        memory keeps the pool's page order, so the array is the reference-layout *view* of it (not
        C-contiguous; ``write_pages`` copies it back page by page, again without a host copy). Without
        an arena, or when it is full, a contiguous pageable array filled through staging."""
        idx = self._pages(pages)
        raw = self._host_empty((len(idx), self.buffers.page_elems), self._pool_dtype())
        if self._in_arena(raw):
            for i, page in enumerate(idx):
                rt.copy_d2h(raw[i], self._page(int(page)), self.stream)
            rt.synchronize(self.stream)  # the pages have landed before the Engine may drop or reuse them
            return self._reference_order(raw)
        for i, page in enumerate(idx):
            rt.copy_d2h(self._page_staging, self._page(int(page)), self.stream)
            rt.synchronize(self.stream)
            raw[i] = self._page_staging.view(self._pool_dtype())
        return np.ascontiguousarray(self._reference_order(raw))

    @_on_device
    def write_pages(self, pages: Sequence[int], data: np.ndarray) -> None:
        """``read_pages``' array back as is; float values (the reference's KV) are narrowed to bf16.
        An array of the Host arena in pool order (as ``read_pages`` returns) is copied up directly."""
        idx = self._pages(pages)
        c = self.config
        expected = (2, self.buffers.kv_layers, len(idx), self.info.page_size, c.num_kv_heads, c.head_dim)
        if data.shape != expected:
            raise ValueError(f"write_pages: data shape {data.shape}, expected {expected}")
        pool = np.asarray(data).transpose(2, 1, 0, 4, 3, 5)  # pool order: a view, no copy
        if pool.dtype == self._pool_dtype() and self._in_arena(pool):
            pool = pool.reshape(len(idx), -1)  # C-contiguous in the arena: still a view
            for i, page in enumerate(idx):
                rt.copy_h2d(self._page(int(page)), pool[i], self.stream)
            rt.synchronize(self.stream)  # the caller may drop the array (and its block) on return
            return
        pool = np.ascontiguousarray(self._as_pool(data).transpose(2, 1, 0, 4, 3, 5)).reshape(len(idx), -1)
        for i, page in enumerate(idx):
            self._page_staging.view(self._pool_dtype())[:] = pool[i]
            rt.copy_h2d(self._page(int(page)), self._page_staging, self.stream)
            rt.synchronize(self.stream)

    # -- the Host backing -----------------------------------------------------------------------

    @_on_device
    def attach_host_arena(self, nbytes: int) -> None:
        """Pin ``nbytes`` of host memory as the Host backing (``host_arena.HostArena``); 0 detaches
        (pageable arrays again). Pinning is paid once, here: about a second per 8 GiB."""
        if nbytes < 0:
            raise ValueError(f"host arena size must be >= 0, got {nbytes}")
        self.host_arena = None  # a previous arena's memory stays pinned until the device closes
        self.startup["host_arena_bytes"] = 0
        if nbytes == 0:
            return
        start = time.perf_counter()
        try:
            self.host_arena = HostArena(self.device, nbytes)
        except rt.CudaError as e:
            # The budget still holds (the Engine accounts it); its arrays are pageable, copied through
            # staging: slower pauses, not a reason to refuse to serve.
            if e.sticky:
                raise
            log.warning("cannot pin %d bytes of Host backing (--host-context-mib): %s; snapshots and spilled "
                        "StateImages use pageable memory", nbytes, e)
            self.startup["host_arena_error"] = str(e)
            return
        seconds = time.perf_counter() - start
        self.startup["host_arena_bytes"] = nbytes
        self.startup["host_arena_pin_s"] = round(seconds, 3)
        log.info("Host backing: %.2f GiB pinned in %.2f s", nbytes / 2**30, seconds)

    @property
    def host_arena_fallbacks(self) -> int:
        """Host arrays the arena had no room for (made pageable instead); 0 without an arena."""
        return self.host_arena.fallbacks if self.host_arena is not None else 0

    @property
    def state_bytes(self) -> int:
        """Bytes of one StateImage (none for a dense model)."""
        return 0

    def _host_empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised host array: from the Host arena when there is one and it has room."""
        arena = self.host_arena
        if arena is None:
            return np.empty(shape, dtype)
        fallbacks = arena.fallbacks
        array = arena.array(shape, dtype)
        if arena.fallbacks != fallbacks:
            level = logging.WARNING if fallbacks == 0 else logging.DEBUG  # once, then quietly
            log.log(level, "Host arena full (%d of %d bytes in use): %d bytes pageable instead "
                    "(%d fallbacks so far)", arena.used, arena.capacity, array.nbytes, arena.fallbacks)
        return array

    def _in_arena(self, array: np.ndarray) -> bool:
        return self.host_arena is not None and self.host_arena.contains(array)

    def close(self) -> None:
        if self.fault is not None:  # the context is unusable: even a synchronize would fail again
            return
        if self._lt is not None:
            self._lt.close()
        rt.synchronize(self.stream)  # a step still in flight finishes before its graph goes
        self._pending.clear()
        self._intervals.close()
        self._drop_prefill_graphs()
        for by_depth in self.graphs.values():
            for pair in by_depth.values():
                for graph in pair:
                    graph.destroy()
        self.graphs = {}
        # The arena's pinned memory goes with the device: arrays still holding blocks (snapshots the
        # Engine drops with the runner) must not be read after this.
        self.host_arena = None
        self.device.close()

    # -- helpers --------------------------------------------------------------------------------

    def _pool_dtype(self):
        return np.uint16 if self.kv_dtype == "bf16" else np.float32

    def _reference_order(self, raw: np.ndarray) -> np.ndarray:
        """Pages ``[page][layer][K|V][kv_head][slot][dim]`` (the pool's order, one page a row) as the
        reference layout ``[K|V][layer][page][slot][kv_head][dim]``: a view."""
        c = self.config
        raw = raw.reshape(raw.shape[0], self.buffers.kv_layers, 2, c.num_kv_heads, self.info.page_size, c.head_dim)
        return raw.transpose(2, 1, 0, 4, 3, 5)

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page in the pool (every layer, K and V, at ``kv_dtype``)."""
        return self.buffers.page_elems * self.buffers.kv_itemsize

    def _as_pool(self, data: np.ndarray) -> np.ndarray:
        """KV values in the pool's storage type: its own bit patterns pass unchanged."""
        data = np.asarray(data)
        if data.dtype == self._pool_dtype():
            return data
        return from_float32(data) if self.kv_dtype == "bf16" else data.astype(np.float32)

    def _page(self, page: int) -> rt.DevicePtr:
        size = self.buffers.page_elems * self.buffers.kv_itemsize
        return self.buffers.kv.at(page * size, size)

    def _fill_table(self, row: int, table: np.ndarray) -> None:
        width = min(table.size, self.buffers.max_pages)
        self.buffers.inputs.page_tables[row, :width] = table[:width]

    def _fill_sampling_rows(self, lanes: np.ndarray, rows: Sequence[SamplingRow]) -> None:
        """All rows at once: per-row NumPy slicing costs microseconds a row on the hot path."""
        inp, n = self.buffers.inputs, len(rows)
        inp.fparams[:5 * n] = [v for s in rows for v in (s.temperature, s.top_p, s.min_p, s.presence_penalty,
                                                         s.frequency_penalty)]
        inp.iparams[:2 * n] = [v for s, lane in zip(rows, lanes.tolist())
                               for v in (s.top_k, lane)]  # checked: 0..20, 0 = the cap
        inp.keys[:2 * n] = [v for s in rows for v in (s.seed & _MASK64, s.step & _MASK64)]

    def _fill_sampling(self, row: int, lane: int, s: SamplingRow) -> None:
        inp = self.buffers.inputs
        inp.fparams[5 * row:5 * row + 5] = (s.temperature, s.top_p, s.min_p, s.presence_penalty, s.frequency_penalty)
        inp.iparams[2 * row:2 * row + 2] = (s.top_k, lane)
        inp.keys[2 * row:2 * row + 2] = (s.seed & _MASK64, s.step & _MASK64)

    def _check_lane(self, lane: int, field: str) -> None:
        check_lane(self.info, lane, field)

    def _pages(self, pages: Sequence[int]) -> np.ndarray:
        idx = np.asarray(pages, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.info.num_pages):
            raise ValueError(f"page ids must lie in [0, {self.info.num_pages}), got {idx.tolist()}")
        return idx


def _dense_config(config: Any) -> DenseConfig:
    if isinstance(config, DenseConfig):
        architecture = config.architecture
    else:  # artifact JSON: name the architecture before a hybrid config fails to parse as dense
        architecture = config.get("architecture")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"the CUDA backend runs {', '.join(ARCHITECTURES)}, not {architecture!r}")
    return config if isinstance(config, DenseConfig) else DenseConfig.from_json(config)
