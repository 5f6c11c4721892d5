"""The dense decoder as a sequence of kernel launches over static device buffers.

``StepBuffers`` carves every activation, the KV pool, the RoPE tables, the sampler counts and the
per-step inputs out of one workspace allocation; addresses never change, so a captured decode graph
stays valid and the runner only rewrites the inputs (one pinned host-to-device copy per step).
``Forward`` enqueues the launches of one step on a stream: it is the same code whether it runs
directly or under CUDA Graph capture.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ninfer.backends.cuda import runtime as rt
from ninfer.backends.reference.rope import rope_tables
from ninfer.models.dense import DenseConfig

GEMV_MAX_ROWS = 8
GEMV_VARIANT = "_c4"  # 4 columns per block: faster than 8 at every M on the H200 (tools/gpu_bench.py)
# Keys per attention split. The split length is a step input (device memory), so one captured
# graph serves every context: decode picks a split length per step (``decode_split``), prefill has
# many rows and bounds its partials with long splits.
MIN_SPLIT = 32
MAX_GRID_Y = 65535  # CUDA's limit on a grid's y and z
MAX_DECODE_SPLITS = 64
# Shallower decode graphs than the full depth (Forward.decode_depths). Dense at the short end: batch 8
# at 512 keys needs 5 splits, and a depth-8 grid (512 blocks of decode_attention, more than the 396
# that fit the H200 at once) measured as slow as the full depth (5.62 against 5.50 ms a step).
GRAPH_DEPTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48)
PREFILL_SPLIT = 256
# The dense decode attention's split policy: about DECODE_ATTENTION_BLOCKS blocks (rows x KV heads x
# splits), the 396 that fit the H200 at once (3 an SM) less some slack. With the tensor-core key phase
# (``decode_attention_*_bf16``) a long split costs little more than a short one, so long contexts too
# take one wave of blocks rather than splits of a fixed length (tools/bench_decode_step.py, Qwen3-8B,
# ms a step, the best split lengths against this policy's): b1/8192 192-224 keys (4.509; the policy:
# 224), b4/8192 1024 (6.264; 832), b8/2048 384 (5.741; 416), b8/4096 768-1024 (6.344; 832), b8/8192
# 2048 (7.485; 1664); at 512 keys every length from 32 to 128 is within 1%. (The CUDA-core kernel
# wanted splits of at most 512 keys at long contexts: 12.05 against 14.14 ms at b8/8192.)
DECODE_ATTENTION_BLOCKS = 320


# Rows a thread of the chunked rope takes in turn (its block loops along y): a row is only 64 bytes
# in and out a thread, so one row a block was mostly block start-up. 8192 x (32 + 2 x 8) heads of 128
# on the H200 (the prefill's rope, alone): 71.4 us at one row, 64.5 at two, 62.4 at four.
ROPE_ROWS_PER_THREAD = 4


def rope_chunks_grid(meta: dict, rows: int, heads: int, head_dim: int) -> tuple[int, int]:
    """The grid of the chunked rope (``rope_kv_bf16_qkv_bf16``, its ``meta``): blocks along x over a
    row's ``heads`` (q, k and v) of ``head_dim``, along y over the rows, ROPE_ROWS_PER_THREAD rows a
    block (it loops over them; at most CUDA's 65535 blocks)."""
    return (-(-(heads * head_dim // meta["dims_per_thread"]) // meta["threads"]),
            min(-(-rows // ROPE_ROWS_PER_THREAD), MAX_GRID_Y))


def split_length(length: int, splits: int) -> int:
    """The shortest multiple of MIN_SPLIT that cuts ``length`` keys into at most ``splits`` splits
    (and never more than MAX_DECODE_SPLITS, the decode grid's depth)."""
    splits = max(1, min(MAX_DECODE_SPLITS, splits))
    return max(MIN_SPLIT, -(-length // (splits * MIN_SPLIT)) * MIN_SPLIT)


def decode_split(length: int, row_blocks: int) -> int:
    """``decode_attention``'s split length for a step whose longest row has ``length`` keys and whose
    launch has ``row_blocks`` blocks per split (rows x KV heads)."""
    return split_length(length, -(-DECODE_ATTENTION_BLOCKS // max(1, row_blocks)))


# A decode step whose keys and values (one layer, every row) take at most this many bytes has
# ``decode_attention`` ask L2 for them before it waits for the q/k/v GEMM: the old keys stream in while
# that GEMM finishes, and the key loop then waits on L2 instead of DRAM. L2 holds 50 MiB on the H200;
# more would evict the prefetched pages before they are read.
KV_PREFETCH_BYTES = 32 << 20
PREFETCH_KEYS, PREFETCH_O = 1, 2  # bits of a decode step's ``inputs.split[1]`` (Forward.decode_prefetch)
# The most bytes one L2 prefetch request (numba_kernels/common.py ``prefetch_l2``, one a block) may ask for:
# on an H100 a request of 1020 KiB was fetched and ones of 1 MiB and 1028 KiB did nothing at all (the
# 35B-A3B router's CudaMoe.next_prefetch over its 16 blocks, docs/benchmarks.md).
L2_PREFETCH_MAX = (1 << 20) - 16


def prefetch_bytes(nbytes: int, blocks: int) -> int:
    """``nbytes`` to ask L2 for over a grid of ``blocks`` blocks, each asking for its share in one request
    (``prefetch_block_share``): capped so that no share passes L2_PREFETCH_MAX; whole 16-byte units."""
    return min(nbytes, blocks * L2_PREFETCH_MAX) // 16 * 16


def attention_splits(max_context: int) -> dict[str, int]:
    """The attention grid's depth (splits per row) in each mode. A decode step never has more than
    MAX_DECODE_SPLITS (``decode_split``): a deeper grid only adds blocks that exit at once, which cost
    microseconds per launch at short contexts. Prefill splits are PREFILL_SPLIT keys long."""
    return {"decode": min(MAX_DECODE_SPLITS, -(-max_context // MIN_SPLIT)), "prefill": -(-max_context // PREFILL_SPLIT)}


# The prefill attention kernel by head_dim where one faster than ``prefill_attention_d{D}`` (mma.sync)
# exists: the warpgroup-MMA kernel (numba_kernels/prefill_attention_wgmma.py; sm_90a).
PREFILL_ATTENTION = {64: "prefill_attention_d64_wgmma", 128: "prefill_attention_d128_wgmma"}


def prefill_attention_grid(meta: dict, heads: int, rows: int, sm_count: int) -> tuple[int, ...]:
    """The grid of a prefill attention kernel (``meta``) over ``rows`` rows: a block per (head, row
    tile), or, for a kernel whose blocks take item after item (``meta["persistent"]``: blocks an SM),
    as many blocks as the GPU holds at once."""
    tiles = -(-rows // meta["rows"])
    if meta.get("persistent"):
        return (min(heads * tiles, sm_count * meta["persistent"]),)
    return (heads, tiles)


def flash_prefill(kv_dtype: str) -> bool:
    """Whether prefill rows take the tensor-core flash kernel (bf16 pool; numba_kernels/prefill_attention.py)
    instead of the split decode kernel, which stays for the f32 pool's bit-comparable parity runs."""
    return kv_dtype == "bf16"


# The decode GEMM of each matrix by row count (tools/bench_decode_gemm.py and bench_decode_step.py on
# the H200): "fp32" is the CUDA-core GEMV (``gemv_<fusion>_m<rows>``), anything else names a
# tensor-core ``mma_gemv_<fusion>_<shape>`` shape: tiles of 16 weight rows per block, warps
# splitting K, 32-k steps in flight per warp, bf16 parts per activation.
DECODE_FUSIONS = {"qkv": ("store", True), "o": ("residual", False), "gate_up": ("swiglu", True),
                  "down": ("residual", False), "lm_head": ("store", True)}  # (epilogue, normed)
# GB/s on the H200 (rows 1 / 2 / 8): qkv 3622 fp32 / 3331 fp32 / 2518, o 3506 fp32 / 2981 / 2877,
# gate_up 4207 fp32 / 3998 fp32 / 3591, down 4080 fp32 / 3514 / 3246, LM head 4445 fp32 / 4408 fp32
# / 3794. At two rows a step of fp32 GEMVs only (launches overlapped) beat the mix: 4.57 ms against 4.96.
_MMA_FROM_3 = {"qkv": "t1w8u2s3", "o": "t1w16u4s3", "gate_up": "t4w4u1s3", "down": "t1w16u4s3",
               "lm_head": "t4w8u1s3"}
DECODE_GEMMS = {matrix: {rows: "fp32" if rows <= 2 else shape for rows in range(1, GEMV_MAX_ROWS + 1)}
                for matrix, shape in _MMA_FROM_3.items()}
# down and o through the ring of shared memory (``mma_gemv`` RING shapes) from 7 rows. down: a step of 7 /
# 8 rows at 512 keys 5.371 -> 5.355 / 5.432 -> 5.404 ms, 8 rows at 4096 keys 9.006 -> 8.960; 5 and 6
# rows lose 0.8-1.8% (tools/bench_decode_step.py --gemms down=t1w8u1s3r3, two runs). o (H100, three
# calls): 8 rows at 512 keys 6.168-6.175 -> 6.120-6.134 ms, 7 rows 6.114-6.119 -> 6.077-6.084, 8 rows at
# 2048 / 4096 keys 6.802 -> 6.774 / 7.612 -> 7.590; 3-6 rows lose 0.2-0.5%; rings of 2 or 4 slots, or of
# 16 or 4 warps, did less.
for _matrix in ("down", "o"):
    DECODE_GEMMS[_matrix].update({7: "t1w8u1s3r3", 8: "t1w8u1s3r3"})
PRELOADED_O_GEMV = "gemv_residual_m1p4"  # Forward.preload_o (numba_kernels/gemm.py make_gemv's PRELOAD)


# Bytes of the next GEMM's weights a batched decode GEMM asks L2 for at its tail (numba_kernels/gemm.py
# NEXT builds), by matrix and row count: they stream while the GEMM's last blocks finish and the next
# one launches. o and gate/up ask for the next GEMM's first 8 MiB, down for the next layer's q/k/v's.
# H100, ms a step (tools/bench_decode_step.py --gemm-prefetch), none -> 8 MiB at o, gate/up and down:
# b3/512 6.216 -> 6.149, b4/512 6.262 -> 6.195, b6/512 6.342 -> 6.292, b8/512 6.534 -> 6.495, b8/2048
# 7.209 -> 7.145, b8/4096 8.017 -> 7.939 (4 and 16 MiB did less). From 7 rows (down's ring shape)
# without gate/up's: b8/512 6.460, b8/2048 7.133. A dense step's staged down (Forward.staged) copies its
# own first weights over gate/up's tail: there gate/up asks for nothing (Forward.gemm_prefetch), and down
# asks for 16 MiB at 7 and 8 rows: H100, b8/512 6.066-6.074 -> 6.034-6.041 ms in four calls, b7/512 6.005
# -> 5.994 (o asking for 16 as well did no better).
MIB = 1 << 20
GEMM_PREFETCH = {"o": {rows: 8 * MIB for rows in range(3, 9)}, "gate_up": {rows: 8 * MIB for rows in range(3, 7)},
                 "down": {rows: (16 if rows >= 7 else 8) * MIB for rows in range(3, 9)}}
# The ring shape (numba_kernels/gemm.py RING_SHAPES) a staged decode GEMM launches (Forward.staged).
STAGED_SHAPE = "t1w8u1s3r3"
# The matrices whose batched decode GEMMs read a second copy of their weights in fragment order
# (numba_kernels/gemm.py ``FRAG`` builds, ``fragment_order``), made at load where a step may run them
# (CudaRunner): a warp step's weights then come in whole contiguous lines instead of 64 bytes of each
# of 16 T rows. H100, ms a step at 8 rows and 512 keys (tools/bench_decode_step.py --gemms
# qkv=t1w8u2s3f+gate_up=t4w4u1s3f): 6.054-6.062 -> 5.751. o and down's staged ring shapes copy a
# slot's 2 KB whole from theirs. H100, tools/bench_decode_step.py --only row-major, each copy left out
# in turn (ms, two calls): b8/512 5.747-5.771 with all four, 6.056-6.063 with none; without q/k/v's
# 5.807-5.827, o's 5.771-5.782, gate/up's 5.986-5.990, down's 5.789-5.806; b4/512 5.595 against
# 5.893 (o's 5.632, down's 5.647); b8/2048 6.378 against 6.674 (o's 6.397, down's 6.421).
FRAGMENT_ORDER = ("qkv", "o", "gate_up", "down")


def fragment_tiles(matrix: str) -> int:
    """The tiles a block of ``matrix``'s batched decode GEMM takes (its tensor-core shape's T): the
    grouping of its fragment-order copy."""
    return int(_MMA_FROM_3[matrix][1:].split("w")[0])


def fragment_bytes(rows: int, k: int, tiles: int, swiglu: bool) -> int:
    """Bytes of a [rows, k] matrix's fragment-order copy for blocks of ``tiles`` tiles: whole blocks of
    16 ``tiles`` weight rows (8 gate and 8 up rows a tile for swiglu) by whole 32-k steps."""
    cols = rows // 2 if swiglu else rows
    return -(-cols // (tiles * (8 if swiglu else 16))) * -(-k // 32) * tiles * 1024


# The chained norm (numba_kernels/gemm.py ``make_mma_gemv``'s ``chain``) of a step whose GEMMs are all
# on the tensor cores: the residual GEMMs (o, down) write the next norm's input, x * weight, and each
# block's sums of squares, so the normed GEMMs after them (q/k/v, gate/up, LM head) hold no norm weights
# (the normed q/k/v shape takes 104 registers at 16 warps, the plain one 48). The shapes those read with:
CHAIN_IN_GEMMS = {"qkv": "t1w8u2s3", "gate_up": "t4w4u1s3h", "lm_head": "t4w4u1s3h"}
# the ring shape's epilogue is the slower one with the chain (down), and it has no chained build (o)
CHAIN_OUT_GEMMS = {"down": "t1w16u4s3", "o": "t1w16u4s3"}
CHAIN_PRODUCERS = {"qkv": "down", "gate_up": "o", "lm_head": "down"}  # whose partial sums each reads


def decode_gemm_name(matrix: str, epilogue: str, normed: bool, rows: int, chain: str = "",
                     shape: str | None = None) -> str:
    """The kernel a decode step of ``rows`` rows launches for ``matrix``; ``chain``: "out" for a residual
    GEMM writing the next norm's input, "in" for a normed GEMM reading it; ``shape``: a tensor-core shape
    in place of DECODE_GEMMS' choice (a staged GEMM's, ``Forward.staged``)."""
    choice = shape or DECODE_GEMMS[matrix][rows]
    if chain == "in":
        return f"mma_gemv_normin_{epilogue}_{CHAIN_IN_GEMMS[matrix]}"
    if chain == "out":
        return f"mma_gemv_{epilogue}_normout_{CHAIN_OUT_GEMMS.get(matrix, choice)}"
    fusion = f"{'normed_' if normed else ''}{epilogue}"
    return f"gemv_{fusion}_m{rows}" if choice == "fp32" else f"mma_gemv_{fusion}_{choice}"


def chains_norms(rows: int) -> bool:
    """Whether a decode step of ``rows`` rows chains its norms: where every decode GEMM is on the tensor cores."""
    return all(DECODE_GEMMS[matrix][rows] != "fp32" for matrix in DECODE_GEMMS)


KV_DTYPES = {"bf16": 2, "f32": 4}
HEAD_DIMS = (64, 128)
GROUPS = (1, 2, 4, 8)
LT_WORKSPACE_BYTES = 32 << 20
PREFILL_GEMMS = ("fp32", "cublaslt", "cublaslt-tuned")  # -tuned: algorithms timed at startup (CudaRunner)
# ``Forward.layers``' outputs: the rows of a pass whose hidden states are read (as logits) afterwards.
OUTPUTS = ("all", "last", "none")
SAMPLE_PARTS, SAMPLE_TOP_K = 64, 20  # the sampler's candidate buffers (manifest meta of "sample")
SAMPLE_MAX_VOCAB = 262144  # the sampler's slices are held in registers (manifest meta "max_vocab")
NORM_THREADS = 1024  # one block per row: a decode step's few rows need wide blocks
PREFILL_NORM_THREADS = 512  # a prefill's thousands of rows fill the GPU anyway; 4096 wide rows stay in registers


def norm_threads(rows: int) -> int:
    """Threads of a norm kernel's block (one row each) in a launch of ``rows`` rows."""
    return PREFILL_NORM_THREADS if rows > GEMV_MAX_ROWS else NORM_THREADS


def sampler_regions(max_batch: int, vocab: int) -> dict[str, int]:
    """Bytes of the sampler's workspace regions: a row of logits and of token counts (penalties) per
    lane, each vocabulary slice's top-k candidates (values, ids), the sampled ids."""
    candidates = max_batch * SAMPLE_PARTS * SAMPLE_TOP_K * 4
    return {"logits": max_batch * vocab * 4, "counts": max_batch * vocab * 4, "part_v": candidates, "part_i": candidates,
            "out": max_batch * 4}


def check_vocab(vocab_size: int) -> None:
    """Reject a vocabulary the sampler's slices cannot hold (dense and hybrid models alike)."""
    if vocab_size > SAMPLE_MAX_VOCAB:
        raise ValueError(f"the CUDA backend's sampler takes a vocab_size of at most {SAMPLE_MAX_VOCAB}, "
                         f"the model has {vocab_size}")


def check_supported(config: DenseConfig, kv_dtype: str) -> None:
    """Reject shapes the kernels were not built for, naming the field."""
    if config.head_dim not in HEAD_DIMS:
        raise ValueError(f"the CUDA backend supports head_dim {HEAD_DIMS}, the model has {config.head_dim}")
    if config.num_heads % config.num_kv_heads or config.num_heads // config.num_kv_heads not in GROUPS:
        raise ValueError(f"the CUDA backend supports num_heads / num_kv_heads in {GROUPS}, the model has "
                         f"{config.num_heads} / {config.num_kv_heads}")
    for field in ("hidden_size", "intermediate_size"):
        if getattr(config, field) % 8:  # 16-byte vector loads in the GEMV
            raise ValueError(f"the CUDA backend needs {field} divisible by 8, got {getattr(config, field)}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    check_vocab(config.vocab_size)


class Inputs:
    """The per-step inputs: a device block fed from one of two pinned host blocks (sides).

    The field attributes (``tokens``, ``positions``, ...) are NumPy views of the selected side, the
    ``d_`` ones the device block's. Two sides let the host fill a step's inputs while the step
    before it, launched from the other side, has not yet copied its own (``CudaRunner.launch_decode``).
    """

    def __init__(self, device: rt.Device, arena: rt.Arena, rows: int, max_batch: int, max_pages: int):
        fields = [("tokens", np.int32, rows), ("positions", np.int32, rows), ("row_table", np.int32, rows),
                  ("lanes", np.int32, max_batch), ("page_tables", np.int32, max_batch * max_pages),
                  # a hybrid's StateImage slot each sequence reads and writes (lane_slots.py)
                  ("state_in", np.int32, max_batch), ("state_out", np.int32, max_batch),
                  ("iparams", np.int32, 2 * max_batch), ("fparams", np.float32, 5 * max_batch),
                  ("keys", np.uint64, 2 * max_batch), ("split", np.int32, 2), ("follow", np.int32, 1)]
        offsets, size = {}, 0
        for name, dtype, count in fields:
            size = -(-size // 8) * 8
            offsets[name] = (size, dtype, count)
            size += np.dtype(dtype).itemsize * count
        self.nbytes = size
        self.device = arena.take(size, "inputs")
        self._sides = []
        for _ in range(2):
            host = device.pinned(size)
            views = {"host": host}
            for name, (offset, dtype, count) in offsets.items():
                views[name] = host[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)
            views["page_tables"] = views["page_tables"].reshape(max_batch, max_pages)
            views["follow"][0] = 0
            self._sides.append(views)
        for name, (offset, dtype, count) in offsets.items():
            setattr(self, "d_" + name, self.device.at(offset, np.dtype(dtype).itemsize * count))
        self.select(0)

    def select(self, side: int) -> None:
        """Point the host field views at pinned block ``side`` (0 or 1)."""
        self.side = side
        self.__dict__.update(self._sides[side])

    def upload(self, stream) -> None:
        rt.copy_h2d(self.device, self.host, stream)


def tensor_core_regions(rows: int, widest: int) -> dict[str, int]:
    """bf16 copies of prefill activations (``widest`` values a row) and cuBLASLt's workspace."""
    return {"x_bf16": rows * widest * 2, "lt_workspace": LT_WORKSPACE_BYTES}


def carve_workspace(buffers: Any, device: rt.Device, plan: dict[str, int], rows: int, max_batch: int) -> None:
    """The spec's single workspace: one allocation holding every region of ``plan`` (each becomes an
    attribute of ``buffers``) and the step inputs, 256-byte aligned; ``buffers.max_pages`` sizes the
    page tables."""
    inputs_bytes = 8 * (3 * rows + max_batch * (buffers.max_pages + 12)) + 256
    buffers.workspace_bytes = sum(-(-n // 256) * 256 for n in plan.values()) + inputs_bytes + 4096
    buffers.arena = rt.Arena(device.alloc(buffers.workspace_bytes, "workspace"))
    for name, nbytes in plan.items():
        setattr(buffers, name, buffers.arena.take(nbytes, name))
    buffers.inputs = Inputs(device, buffers.arena, rows, max_batch, buffers.max_pages)


class StepBuffers:
    def __init__(self, device: rt.Device, config: DenseConfig, *, page_size: int, num_pages: int,
                 max_batch: int, max_context: int, max_rows: int, kv_dtype: str, tensor_core_prefill: bool = False):
        c = config
        self.rows = max(max_rows, max_batch)
        self.max_pages = -(-max_context // page_size)
        self.splits = attention_splits(max_context)
        self.kv_itemsize = KV_DTYPES[kv_dtype]
        self.flash_prefill = flash_prefill(kv_dtype)
        self.kv_layers = c.num_layers  # layers with a KV cache (every one of a dense model)
        self.layer_elems = 2 * c.num_kv_heads * page_size * c.head_dim
        self.page_elems = self.kv_layers * self.layer_elems
        self.logit_rows = max_batch
        f32 = 4
        R = self.rows
        plan = {
            "x": R * c.hidden_size * f32, "h": R * c.hidden_size * f32, "delta": R * c.hidden_size * f32,
            "qkv": R * c.qkv_size * f32, "attn": R * c.q_size * f32,
            # the chained norm's input and partial sums (8 rows a producer block of 16 columns)
            "xn": GEMV_MAX_ROWS * c.hidden_size * f32, "norm_part": 8 * -(-c.hidden_size // 16) * f32,
            "gate_up": R * 2 * c.intermediate_size * f32, "act": R * c.intermediate_size * f32,
            "part_o": self._cells(c, R, max_batch) * c.head_dim * f32,
            "counters": max_batch * c.num_kv_heads * 4,  # decode attention's split tickets, zero between launches
            "part_ml": self._cells(c, R, max_batch) * 2 * f32,
            **sampler_regions(max_batch, c.vocab_size),
            "cos": max_context * c.head_dim // 2 * f32, "sin": max_context * c.head_dim // 2 * f32,
            "kv": num_pages * self.page_elems * self.kv_itemsize,
        }
        if tensor_core_prefill:
            plan.update(tensor_core_regions(R, max(c.hidden_size, c.intermediate_size, c.q_size)))
        carve_workspace(self, device, plan, R, max_batch)
        cos, sin = rope_tables(config, max_context)
        self._tables = (np.ascontiguousarray(cos), np.ascontiguousarray(sin))  # alive until copied

    def _cells(self, c: DenseConfig, rows: int, max_batch: int) -> int:
        """(row, head, split) cells of the attention partials, the larger of decode and prefill."""
        prefill = rows * self.splits["prefill"] if not self.flash_prefill else 0  # the flash kernel needs none
        return c.num_heads * max(max_batch * max(self.splits.values()), prefill)

    def init(self, stream) -> None:
        rt.copy_h2d(self.cos, self._tables[0], stream)
        rt.copy_h2d(self.sin, self._tables[1], stream)
        for region in (self.counts, self.counters, self.kv):
            rt.memset32(region, 0, region.nbytes // 4, stream)
        rt.synchronize(stream)
        self._tables = None


class Forward:
    """Enqueues the launches of one step; reads inputs and weights only from static addresses."""

    def __init__(self, kernels: rt.Kernels, config: DenseConfig, weights: dict[str, rt.DevicePtr],
                 buffers: StepBuffers, *, page_size: int, kv_dtype: str, lt=None,
                 fragments: dict[str, rt.DevicePtr] | None = None):
        self.lt = lt  # cublaslt.LtMatmul for prefill GEMMs on the tensor cores, or None (fp32 tiled kernel)
        self.k = kernels
        self.c = config
        self.w = weights
        # Fragment-order copies (FRAGMENT_ORDER) by weight name: every layer's, or none.
        self.fragments = dict(fragments or {})
        self.fragment_matrices = {name.rsplit(".", 1)[1] for name in self.fragments}
        self.b = buffers
        self.page_size = page_size
        self.page_shift = page_size.bit_length() - 1  # page_size is a power of two (checked by the runner)
        group = config.num_heads // config.num_kv_heads
        self.attention_name = f"attention_g{group}_d{config.head_dim}_{kv_dtype}"
        self.rope_name = f"rope_kv_{kv_dtype}"
        self.decode_attention_name = f"decode_attention_g{group}_d{config.head_dim}_{kv_dtype}"
        self.scale = float(np.float32(config.head_dim ** -0.5))
        self.prefill_attention_name = (PREFILL_ATTENTION.get(config.head_dim, f"prefill_attention_d{config.head_dim}")
                                       if flash_prefill(kv_dtype) else None)
        self.lm_head = weights["lm_head"] if "lm_head" in weights else weights["embed"]
        meta = kernels["sample"].meta
        if (meta["max_parts"], meta["top_k_cap"], meta["max_vocab"]) != (SAMPLE_PARTS, SAMPLE_TOP_K, SAMPLE_MAX_VOCAB):
            raise RuntimeError(f"ptx/ sampler was built for {meta}; the buffers expect {SAMPLE_PARTS} x {SAMPLE_TOP_K} "
                               f"and a vocabulary of up to {SAMPLE_MAX_VOCAB}")
        self.fused_decode = True  # False: decode through the prefill kernels (tools/bench_decode_step.py)
        self.fused_attention = True  # False: decode attention in the prefill path's three launches
        self.overlap = True  # decode launches overlap their predecessor (runtime.Kernels.overlapped)
        # ``decode_attention`` overlaps the q/k/v GEMM even in steps whose other launches do not
        # (``overlaps``: the tensor-core GEMMs): its blocks stage their first keys before they wait.
        # tools/bench_decode_step.py, ms a step: b4/512 5.056 -> 4.996, b8/512 5.256 -> 5.180, b8/4096
        # 6.323 -> 6.223, b4/8192 6.225 -> 6.154 (every launch overlapped at b8/512: 8.14).
        self.attention_overlap = True
        # Tensor-core decode steps pass each norm on from a residual GEMM (``chains``). Off: an earlier
        # form (shared-memory sums) measured b8/512 5.074 ms a step against 5.143 unchained on the H200,
        # but this one lost on an H100 (b3/512 6.337 vs 6.309 ms, b8/512 6.671 vs 6.567; its kernels'
        # GPU tests pass; tools/bench_decode_step.py --only 'norms chained', docs/benchmarks.md).
        self.chain_norm = False
        # The step's keys asked of L2 before attention waits, where a layer of them fits kv_prefetch_bytes.
        # Off: on an H100 (tools/bench_decode_step.py, ms a step) b4/512 6.121 -> 6.093, b8/512 6.394 ->
        # 6.385, b8 at 2048 keys forced on 6.972 -> 7.077, b1 level; with attention_prefetch on, b8/512
        # 6.380 -> 6.344 without it.
        self.kv_prefetch = False
        self.kv_prefetch_bytes = KV_PREFETCH_BYTES
        # The share of each layer's o projection weights that its decode_attention grid asks L2 for after
        # its wait, while attention leaves DRAM mostly idle; the o GEMV then finds them there. 0: never.
        # H100, ms a step, the keys asked for and no o -> 0.25 and no keys: b1/512 5.324 -> 5.291, b2/512
        # 5.737 -> 5.707, b4/512 6.121 -> 6.054, b8/512 6.394 -> 6.344, b1/2048 5.418 -> 5.410 (H200: b1/512
        # 4.030 -> 4.020, b8/512 5.120 -> 5.110); 0.125 and 0.375 did no better, the whole matrix worse.
        self.attention_prefetch = 0.25
        # gate/up asks for nothing where down is staged (``staged``): down's blocks copy their own first
        # weights over gate/up's tail. H100 (the second card below), ms a step, gate/up's 8 MiB -> none,
        # o and down staged: b3/512 6.098-6.107 -> 6.048-6.049, b4/512 6.111-6.114 -> 6.071-6.074, b6/512
        # 6.208-6.209 -> 6.169-6.172, b4/4096 6.847-6.849 -> 6.805-6.810.
        self.gemm_prefetch = {matrix: dict(table) for matrix, table in GEMM_PREFETCH.items() if matrix != "gate_up"}
        # A one-row step's o projection holds its first four steps of weights before its wait
        # (PRELOADED_O_GEMV), while the kernel before it (attention, the delta rule) leaves DRAM idle.
        # Off for the dense model: Qwen3-8B b1 on an H100 5.443 -> 5.451 ms at 512 keys, 5.696 -> 5.674
        # at 4096 (tools/bench_decode_step.py); on for MoE hybrids (HybridForward).
        self.preload_o = False
        # A dense step of tensor-core rows (one that does not overlap every launch) launches the GEMMs of
        # these matrices in this ring shape (``mma_gemv`` RING), overlapping the kernel before them: their
        # blocks copy their first slots of weights into shared memory on the SMs that kernel leaves, and
        # stream while its last blocks finish. H100, ms a step (tools/bench_decode_step.py --staged),
        # none -> o and down, both in STAGED_SHAPE:
        # - from 7 rows, where DECODE_GEMMS has that shape anyway (eight calls on one card, two on another):
        #   b8/512 6.124-6.155 -> 6.050-6.074 and 6.316-6.318 -> 6.243-6.250, b7/512 6.070-6.088 ->
        #   5.991-6.031 and 6.263-6.269 -> 6.190-6.196, b8/2048 6.784-6.793 -> 6.654-6.683;
        # - at 3-6 rows, against DECODE_GEMMS' t1w16u4s3 unstaged (the second card, two runs): b4/512
        #   6.151-6.154 -> 6.111-6.114, b6/512 6.254-6.255 -> 6.208-6.209, b4/4096 6.989-6.991 ->
        #   6.847-6.849, b3/512 level (6.103-6.104 against 6.098-6.107).
        # Staged q/k/v and gate/up (ring shapes, or builds loading their first round before the wait) were
        # slower: an SM keeps its split of L1 and shared memory while any block is resident, so their
        # blocks ran with a ring kernel's small L1 (b8/512 6.34-8.08). So were o's two-tile rings holding
        # half its weights, and asking for a larger shared-memory carveout (docs/benchmarks.md).
        self.staged = {"o": STAGED_SHAPE, "down": STAGED_SHAPE}
        self.layer_kv_bytes_per_key = 2 * config.num_kv_heads * config.head_dim * KV_DTYPES[kv_dtype]

    def kernel_names(self) -> list[str]:
        names = ["embed", "rmsnorm", "add_rmsnorm", "silu_mul", "count_tokens", "sample_partial", "sample", "to_bf16",
                 "rmsnorm_bf16", "add_rmsnorm_bf16", "rmsnorm_rows_bf16", "rmsnorm_block_bf16", "silu_mul_bf16",
                 "attention_combine", "gemm_tiled", self.attention_name, self.rope_name, self.decode_attention_name]
        if self.prefill_attention_name:
            names += [self.prefill_attention_name, self.prefill_attention_name + "_bf16", self.rope_name + "_qkv_bf16"]
        names += [decode_gemm_name(matrix, epilogue, normed, m) for m in range(1, GEMV_MAX_ROWS + 1)
                  for matrix, (epilogue, normed) in DECODE_FUSIONS.items()]
        names += [decode_gemm_name(matrix, epilogue, normed, m, "in" if normed else "out")
                  for m in range(1, GEMV_MAX_ROWS + 1) if chains_norms(m)
                  for matrix, (epilogue, normed) in DECODE_FUSIONS.items()]
        names += [decode_gemm_name(matrix, *DECODE_FUSIONS[matrix], GEMV_MAX_ROWS, shape=shape)
                  for matrix, shape in self.staged.items()]
        names += [decode_gemm_name(matrix, *DECODE_FUSIONS[matrix], m) + "f" for m in range(1, GEMV_MAX_ROWS + 1)
                  for matrix in self.fragment_matrices if self.reads_fragments(matrix, m)]
        names += [name + "n" for name in names if name + "n" in self.k.entries]  # the NEXT builds
        return names + [f"gemv_m{m}{GEMV_VARIANT}" for m in range(1, GEMV_MAX_ROWS + 1)] + [PRELOADED_O_GEMV]

    def matmul(self, y: rt.DevicePtr, x: rt.DevicePtr, w: rt.DevicePtr, rows: int, n: int, k: int, stream) -> None:
        if rows <= GEMV_MAX_ROWS:
            kernel = self.k[f"gemv_m{rows}{GEMV_VARIANT}"]
            kernel.launch((-(-n // kernel.meta["cols"]),), (kernel.meta["threads"],), (y, x, w, rows, n, k, n), stream)
        elif self.lt is not None:
            xb = self.b.x_bf16
            self.k["to_bf16"].launch((-(-(rows * k) // 256),), (256,), (xb, x, rows * k), stream)
            self.lt.matmul(y, xb, w, rows, n, k, stream)
        else:
            self.k["gemm_tiled"].launch((-(-n // 64), -(-rows // 64)), (256,), (y, x, w, rows, n, k, n), stream)

    def decode_split(self, length: int, rows: int) -> int:
        """The split length of a decode step of ``rows`` rows whose longest has ``length`` keys."""
        return decode_split(length, rows * self.c.num_kv_heads)

    def overlaps(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` rows overlaps its launches (``overlap`` is the master switch):
        where its GEMMs are the fp32 GEMV, which issues its first weight loads before waiting (one or two rows),
        and where the step chains its norms (``chains``). The tensor-core GEMMs load after the wait: with
        the normed ones overlapping measured 0.6-1.5% slower (b8/512 8.14 ms with every launch overlapped),
        with the chained ones 0.2-0.8% faster (b8/512 5.032-5.042 ms against 5.067-5.074)."""
        fp32_only = all(DECODE_GEMMS[matrix][rows] == "fp32" for matrix in DECODE_GEMMS)
        return self.overlap and (fp32_only or self.chains(rows))

    def staged_shape(self, matrix: str, rows: int) -> str | None:
        """The ring shape a decode step of ``rows`` rows launches its ``matrix`` GEMM in to overlap the
        kernel before it (``staged``), or None: not at the fp32 GEMV's rows, nor inside a step that
        overlaps every launch (one or two rows, chained norms, the hybrids')."""
        if matrix not in self.staged or not self.overlap or self.k.overlap.on or DECODE_GEMMS[matrix][rows] == "fp32":
            return None
        return self.staged[matrix]

    def next_weights(self, i: int, rows: int, blocks: int) -> tuple[rt.DevicePtr, int]:
        """(pointer, bytes) of what layer ``i``'s ``decode_attention`` grid of ``blocks`` blocks may ask L2
        for in a step of ``rows`` rows: the first ``attention_prefetch`` of the o projection's bf16
        weights that step streams."""
        total = self.c.hidden_size * self.c.q_size * 2
        o = self.decode_weights("o", i, rows, "out" if self.chains(rows) else "")
        return o, prefetch_bytes(int(total * self.attention_prefetch), blocks)

    def decode_prefetch(self, keys: int) -> int:
        """What ``decode_attention`` asks L2 for in a step of ``keys`` keys (summed over its rows), as the
        step input's bits: the keys where ``kv_prefetch`` is on and one layer of them fits
        ``kv_prefetch_bytes``; the o projection's first share wherever ``attention_prefetch`` is set."""
        fits = self.kv_prefetch and keys * self.layer_kv_bytes_per_key <= self.kv_prefetch_bytes
        return (PREFETCH_KEYS if fits else 0) | (PREFETCH_O if self.attention_prefetch else 0)

    def n_splits(self, rows: int, decode: bool = False) -> int:
        """The attention grid's depth; ``inputs.split`` holds the actual split length. A decode step's
        rows need at most ``splits["decode"]``; other launches of a few rows may be a short prefill
        chunk (PREFILL_SPLIT keys a split) or a decode step through the prefill kernels."""
        s = self.b.splits
        if decode:
            return s["decode"]
        return max(s["decode"], s["prefill"]) if rows <= self.b.inputs.lanes.size else s["prefill"]

    def attend(self, i: int, rows: int, n_splits: int, stream, decode: bool = False,
               bf16: bool = False, first: int = 0) -> rt.DevicePtr | None:
        """Layer ``i``: rope (+ q/k norm, bias) on ``qkv``, append K/V to the pool, attention into ``attn``
        (or, with ``bf16``, only where the tensor-core prefill kernel runs: from a bf16 ``qkv``, into
        ``x_bf16`` in bf16); returns where the output went. ``first`` (prefill): every row's K/V, the
        attention of rows ``first``.. only, into the output's first rows (between 0 and ``rows``,
        where the tensor-core prefill kernel runs); ``rows``: the append only, and None.

        ``decode``: every row is its own sequence, so one ``decode_attention`` launch does it all;
        else rows of one sequence read each other's keys and the append runs first, alone."""
        assert first == 0 or not decode, "a decode step reads every row's attention"
        c, b, w, k, inp = self.c, self.b, self.w, self.k, self.b.inputs
        H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
        p = f"layers.{i}."
        bias = w.get(p + "qkv_bias", b.cos)
        q_norm, k_norm = w.get(p + "q_norm", b.cos), w.get(p + "k_norm", b.cos)
        layer_kv = b.kv.at(i * b.layer_elems * b.kv_itemsize)
        flags = (int(c.attention_bias), int(c.qk_norm), float(c.rms_norm_eps))
        if decode and self.fused_attention:
            fused = k[self.decode_attention_name]
            alone = self.attention_overlap and self.overlap and not k.overlap.on
            with k.overlapped() if alone else contextlib.nullcontext():
                fused.launch((KV, rows, n_splits), (fused.meta["threads"],),
                             (b.qkv, bias, q_norm, k_norm, b.cos, b.sin, layer_kv, layer_kv, b.page_elems,
                              inp.d_page_tables, b.max_pages, inp.d_row_table, inp.d_positions, b.attn, b.part_o,
                              b.part_ml, b.counters, H, KV, self.page_shift, inp.d_split, n_splits, self.scale,
                              *flags, *self.next_weights(i, rows, KV * rows * n_splits)), stream)
            return b.attn
        rope_args = (b.qkv, bias, q_norm, k_norm, b.cos, b.sin, layer_kv, b.page_elems, inp.d_page_tables,
                     b.max_pages, inp.d_row_table, inp.d_positions, H, KV, D, self.page_size, *flags)
        if bf16:  # a thread per 16 dims of a head (rope.py, rope_kv_chunks_bf16)
            rope = k[self.rope_name + "_qkv_bf16"]
            rope.launch(rope_chunks_grid(rope.meta, rows, H + 2 * KV, D), (rope.meta["threads"],), (*rope_args, rows),
                        stream)
        else:
            rope = k[self.rope_name]
            rope.launch((rows, -(-(H + 2 * KV) // rope.meta["heads_per_block"])), (rope.meta["threads"],), rope_args,
                        stream)
        if first == rows:
            return None
        if self.prefill_attention_name and rows > inp.lanes.size:
            return self.prefill_attention(layer_kv, rows, stream, bf16, first)
        assert not bf16, "the split attention kernels read fp32 q"
        assert first == 0, "the split attention kernels run every row"
        attention, combine = k[self.attention_name], k["attention_combine"]
        attention.launch(
            (KV, rows, n_splits), (attention.meta["threads"],),
            (b.qkv, layer_kv, b.page_elems, inp.d_page_tables, b.max_pages, inp.d_row_table,
             inp.d_positions, b.part_o, b.part_ml, H, KV, self.page_shift, inp.d_split, n_splits,
             self.scale), stream)
        combine.launch((H, rows), (D * combine.meta["threads_per_dim"],),
                       (b.attn, b.part_o, b.part_ml, inp.d_positions, H, n_splits, D, inp.d_split), stream)
        return b.attn

    def layers(self, rows: int, stream, outputs: str = "all") -> None:
        """Hidden states of ``rows`` input rows, final norm applied, into ``buffers.h``.

        ``outputs``: the rows whose hidden states the caller reads (OUTPUTS). The last layer's
        attention, o projection and MLP and the final norm feed only ``h``, so past the last layer's
        K/V append they run for those rows alone: none (a prefill sub-chunk in a prompt's middle: an
        8192-token Qwen3-8B prefill in 1024-token chunks takes 2.1% less time on an H100), or the last
        (the sub-chunk that samples: a 1024-token prompt's prefill 1.6% less; where the tensor-core
        prefill attention runs, else every row).

        Where cuBLASLt runs the GEMMs (prefill), they read bf16 activations: the norms and SiLU-mul
        then write theirs straight into ``x_bf16`` (rounded as ``to_bf16`` would), one pass instead of
        an fp32 write, a read and a conversion; and the o and down GEMMs add into the residual stream
        themselves (beta 1), so the norm after them reads ``x`` once instead of adding ``delta``."""
        c, b, w, k = self.c, self.b, self.w, self.k
        inp = b.inputs
        n_splits = self.n_splits(rows)
        eps = float(c.rms_norm_eps)
        bf16 = self.lt is not None and rows > GEMV_MAX_ROWS
        # qkv too, where the tensor-core prefill attention reads q (it rounds q to bf16 for its MMAs anyway).
        bf16_qkv = bf16 and self.prefill_attention_name is not None and rows > inp.lanes.size
        normed, act, kind = (b.x_bf16, b.x_bf16, "_bf16") if bf16 else (b.h, b.act, "")
        threads = norm_threads(rows)
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs must be one of {', '.join(OUTPUTS)}, got {outputs!r}")
        # The last layer past its K/V runs for rows ``first``.. only (into the first rows of the
        # activation buffers; ``x`` and ``h`` are seen from row ``first`` on).
        first = rows if outputs == "none" else rows - 1 if outputs == "last" and bf16_qkv else 0
        n, x, h = rows, b.x, b.h  # rows in flight, the residual stream's and the hidden states' first
        pending = False  # whether ``delta`` holds a product the residual stream has not taken yet
        block_norm = k["rmsnorm_block_bf16"]  # a block a row from registers (rows up to its max_hidden)

        def norm(out: rt.DevicePtr, weight: rt.DevicePtr, kind: str) -> None:
            if pending:  # (never past ``first``: the fp32 GEMMs run every row)
                k["add_rmsnorm" + kind].launch((n,), (threads,), (x, b.delta, out, weight, c.hidden_size, eps),
                                               stream)
            elif kind == "_bf16" and c.hidden_size % 8 == 0 and c.hidden_size <= block_norm.meta["max_hidden"]:
                block_norm.launch((min(n, block_norm.meta["blocks"]),), (block_norm.meta["threads"],),
                                  (out, x, weight, n, c.hidden_size, eps), stream)
            elif kind == "_bf16" and c.hidden_size % 4 == 0:  # a warp a row keeps more loads in flight
                rows_norm = k["rmsnorm_rows_bf16"]
                blocks = min(-(-n // rows_norm.meta["rows"]), rows_norm.meta["blocks"])
                rows_norm.launch((blocks,), (rows_norm.meta["threads"],),
                                 (out, x, weight, n, c.hidden_size, eps), stream)
            else:
                k["rmsnorm" + kind].launch((n,), (threads,), (out, x, weight, c.hidden_size, eps), stream)

        def matmul(y: rt.DevicePtr, a: rt.DevicePtr, weight: rt.DevicePtr, cols: int, width: int,
                   out_bf16: bool = False) -> None:
            if bf16 and a is b.x_bf16:
                self.lt.matmul(y, a, weight, n, cols, width, stream, out_bf16=out_bf16)
            else:
                self.matmul(y, a, weight, n, cols, width, stream)

        def residual(a: rt.DevicePtr, weight: rt.DevicePtr, width: int) -> None:
            """The residual stream takes ``a @ weight.T``: now (cuBLASLt, beta 1) or at the next norm."""
            nonlocal pending
            pending = not (bf16 and a is b.x_bf16)
            if pending:
                self.matmul(b.delta, a, weight, n, c.hidden_size, width, stream)
            else:
                self.lt.matmul(x, a, weight, n, c.hidden_size, width, stream, accumulate=True)

        k["embed"].launch((-(-c.hidden_size // 256), rows), (256,), (b.x, w["embed"], inp.d_tokens, c.hidden_size),
                          stream)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            norm(normed, w[p + "attn_norm"], kind)
            matmul(b.qkv, normed, w[p + "qkv"], c.qkv_size, c.hidden_size, out_bf16=bf16_qkv)
            last = i == c.num_layers - 1
            attention = self.attend(i, rows, n_splits, stream, bf16=bf16_qkv, first=first if last else 0)
            if last and first == rows:
                return
            if last and first:
                n, x, h = rows - first, b.x.at(first * c.hidden_size * 4), b.h.at(first * c.hidden_size * 4)
            residual(attention, w[p + "o"], c.q_size)
            norm(normed, w[p + "mlp_norm"], kind)
            # Under cuBLASLt gate and up come out in bf16 (as a bf16 checkpoint's own MLP has them).
            matmul(b.gate_up, normed, w[p + "gate_up"], 2 * c.intermediate_size, c.hidden_size, out_bf16=bf16)
            silu = k["silu_mul" + kind]
            silu.launch((-(-c.intermediate_size // (256 * silu.meta["items"])), n), (256,),
                        (act, b.gate_up, c.intermediate_size), stream)
            residual(act, w[p + "down"], c.intermediate_size)
        norm(h, w["final_norm"], "")

    def chains(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` rows chains its norms (``chain_norm``, ``chains_norms``)."""
        return self.chain_norm and chains_norms(rows)

    def decode_gemm(self, matrix: str, y: rt.DevicePtr, x: rt.DevicePtr, w: rt.DevicePtr, rows: int, n: int,
                    k: int, stream, norm: rt.DevicePtr | None = None, chain: str = "",
                    then: rt.DevicePtr | None = None, ask: int | None = None) -> None:
        """A decode GEMM with its fusion (DECODE_FUSIONS): "normed" = rmsnorm(x) * ``norm`` first;
        epilogue "store" y = ., "residual" y += ., "swiglu" y = silu(gate) * up (W is [gate | up]).
        ``chain`` "out" (a residual GEMM): also write the next norm's input into ``xn`` (``norm``: that
        norm's weights) and its partial sums; "in" (a normed GEMM): read them instead of x and ``norm``.
        ``then``: the next GEMM's weights, whose first ``gemm_prefetch[matrix][rows]`` bytes (``ask``
        bytes, where given) a GEMM with a ``NEXT`` build asks L2 for at its tail."""
        epilogue, normed = DECODE_FUSIONS[matrix]
        staged = self.staged_shape(matrix, rows)
        name = decode_gemm_name(matrix, epilogue, normed, rows, chain, staged)
        if self.reads_fragments(matrix, rows, chain):  # ``w``: the copy ``decode_weights`` gave
            name += "f"
        if self.preload_o and matrix == "o" and name == "gemv_residual_m1":
            name = PRELOADED_O_GEMV
        asked = self.gemm_prefetch.get(matrix, {}).get(rows, 0) if ask is None else ask
        name, ahead = self.next_build(name, then, asked)
        kernel = self.k[name]
        blocks = -(-n // kernel.meta["cols"])
        b, eps = self.b, float(self.c.rms_norm_eps)
        args = (y, x, w, norm if normed or chain == "out" else b.cos, rows, n, k, n, eps)
        if ahead:
            args += (then, prefetch_bytes(ahead, blocks))
        if chain == "out":
            args += (b.xn, b.norm_part)
        elif chain == "in":  # the producer wrote one partial per block (of the hidden size's columns)
            producer = CHAIN_PRODUCERS[matrix]
            producer = self.k[decode_gemm_name(producer, *DECODE_FUSIONS[producer], rows, "out")]
            args = (y, b.xn, w, b.cos, rows, n, k, n, eps, b.norm_part, -(-k // producer.meta["cols"]))
        with self.k.overlapped() if staged else contextlib.nullcontext():
            kernel.launch((blocks,), (kernel.meta["threads"],), args, stream)

    def reads_fragments(self, matrix: str, rows: int, chain: str = "") -> bool:
        """Whether a decode step of ``rows`` rows runs ``matrix``'s GEMM as a ``FRAG`` build over its
        fragment-order copy: where there is one and the kernel it would run has such a build, grouping
        the copy's tiles as the build does (``fragment_tiles``)."""
        if matrix not in self.fragment_matrices:
            return False
        name = decode_gemm_name(matrix, *DECODE_FUSIONS[matrix], rows, chain, self.staged_shape(matrix, rows))
        build = self.k.entries.get(name + "f")
        return build is not None and build["meta"]["tiles"] == fragment_tiles(matrix)

    def decode_weights(self, matrix: str, layer: int, rows: int, chain: str = "") -> rt.DevicePtr:
        """The weights layer ``layer``'s ``matrix`` GEMM streams in a decode step of ``rows`` rows (and
        what the GEMM before it asks L2 for): its fragment-order copy where ``reads_fragments``."""
        name = f"layers.{layer}.{matrix}"
        return self.fragments[name] if self.reads_fragments(matrix, rows, chain) else self.w[name]

    def next_build(self, name: str, then: rt.DevicePtr | None, asked: int) -> tuple[str, int]:
        """``name``'s ``n`` build and the bytes of ``then`` it asks L2 for at its tail (at most ``asked``,
        whole 16-byte units), where it has one and there is something to ask; else ``name`` and 0."""
        ahead = min(asked, then.nbytes) // 16 * 16 if then is not None else 0
        if ahead and name + "n" in self.k.entries:
            return name + "n", ahead
        return name, 0

    def decode_depths(self) -> tuple[int, ...]:
        """The attention grid depths (splits per row) a decode step is captured at, shallowest first:
        those of GRAPH_DEPTHS below the full depth, and the full depth. A step runs at the shallowest
        that holds its splits (``decode_depth``): blocks past a row's splits exit at once, but
        scheduling them cost batch 8 at 512 keys 2% of its step (tools/bench_decode_step.py)."""
        full = self.n_splits(1, decode=True)
        return tuple(d for d in GRAPH_DEPTHS if d < full) + (full,)

    def decode_depth(self, split: int, length: int) -> int:
        """The captured depth for a step whose longest row has ``length`` keys in splits of ``split``."""
        needed = -(-length // split)
        return next(d for d in self.decode_depths() if d >= needed)

    def decode_layers(self, rows: int, stream, depth: int | None = None) -> None:
        """Decode rows through every layer, leaving the residual stream (not normalised) in ``buffers.x``.

        Five launches a layer: the RMSNorms ride in the GEMMs that consume them, the residual adds
        in the GEMMs that produce them, SiLU-mul in the gate/up GEMM's epilogue, and one
        ``decode_attention`` does rope, the KV append and attention (``attend``)."""
        c, b, w = self.c, self.b, self.w
        n_splits = depth or self.n_splits(rows, decode=True)
        out, into = ("out", "in") if self.chains(rows) else ("", "")
        self.k["embed"].launch((-(-c.hidden_size // 256), rows), (256,),
                               (b.x, w["embed"], b.inputs.d_tokens, c.hidden_size), stream)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            chain_qkv = into if i else ""  # the embedding: no chain
            qkv, o, gate_up, down = (self.decode_weights(matrix, i, rows, chain) for matrix, chain in
                                     (("qkv", chain_qkv), ("o", out), ("gate_up", into), ("down", out)))
            self.decode_gemm("qkv", b.qkv, b.x, qkv, rows, c.qkv_size, c.hidden_size, stream,
                             norm=w[p + "attn_norm"], chain=chain_qkv, then=o)
            self.attend(i, rows, n_splits, stream, decode=True)
            self.decode_gemm("o", b.x, b.attn, o, rows, c.hidden_size, c.q_size, stream,
                             norm=w[p + "mlp_norm"], chain=out, then=gate_up)
            self.decode_gemm("gate_up", b.act, b.x, gate_up, rows, c.intermediate_size, c.hidden_size,
                             stream, norm=w[p + "mlp_norm"], chain=into, then=down)
            following = w[f"layers.{i + 1}.attn_norm"] if i + 1 < c.num_layers else w["final_norm"]
            self.decode_gemm("down", b.x, b.act, down, rows, c.hidden_size, c.intermediate_size,
                             stream, norm=following, chain=out, then=self.first_weights(i + 1, rows, into))

    def first_weights(self, layer: int, rows: int = 1, chain: str = "") -> rt.DevicePtr:
        """The weights the first GEMM of ``layer`` streams in a decode step of ``rows`` rows (``chain``:
        its norm's), or past the last layer the LM head's: what a layer's down GEMM asks L2 for at its
        tail (``gemm_prefetch``)."""
        return self.lm_head if layer == self.c.num_layers else self.decode_weights("qkv", layer, rows, chain)

    def prefill_attention(self, layer_kv: rt.DevicePtr, rows: int, stream, bf16: bool = False,
                          first: int = 0) -> rt.DevicePtr:
        """Causal attention of prefill rows ``first`` .. ``rows`` - 1 on the tensor cores, straight into
        ``attn``'s first rows, or with ``bf16`` from a bf16 ``qkv`` (as the qkv cuBLASLt GEMM wrote it) as
        bf16 into ``x_bf16`` (the o projection's cuBLASLt GEMM reads it; no ``to_bf16``). Returns where
        the output went."""
        b, inp = self.b, self.b.inputs
        kernel = self.k[self.prefill_attention_name + ("_bf16" if bf16 else "")]
        out = b.x_bf16 if bf16 else b.attn
        qkv = b.qkv.at(first * self.c.qkv_size * (2 if bf16 else 4))
        scale_log2 = float(self.c.head_dim ** -0.5 * np.log2(np.e))  # the kernel's softmax runs in exp2
        kernel.launch(prefill_attention_grid(kernel.meta, self.c.num_heads, rows - first, self.k.device.sm_count),
                      (kernel.meta["threads"],),
                      (qkv, layer_kv, b.page_elems, inp.d_page_tables, b.max_pages, inp.d_row_table.at(4 * first),
                       inp.d_positions.at(4 * first), out, rows - first, self.c.num_heads, self.c.num_kv_heads,
                       self.page_shift, scale_log2), stream)
        return out

    def logits(self, first_row: int, rows: int, stream) -> None:
        """LM head of ``h[first_row : first_row + rows]`` into ``logits[:rows]``."""
        x = self.b.h.at(first_row * self.c.hidden_size * 4)
        self.matmul(self.b.logits, x, self.lm_head, rows, self.c.vocab_size, self.c.hidden_size, stream)

    def sample(self, rows: int, stream) -> None:
        """Token ids of ``logits[:rows]`` into ``out``: each row's vocabulary is cut into ``parts``
        slices whose best candidates one block each finds, then one block per row merges and draws."""
        b, inp, vocab = self.b, self.b.inputs, self.c.vocab_size
        partial, final = self.k["sample_partial"], self.k["sample"]
        threads = final.meta["threads"]
        parts = max(1, min(SAMPLE_PARTS, -(-vocab // threads)))
        partial.launch((parts, rows), (threads,),
                       (b.part_v, b.part_i, b.logits, b.counts, inp.d_fparams, inp.d_iparams, vocab, parts), stream)
        final.launch((rows,), (threads,),
                     (b.out, b.part_v, b.part_i, inp.d_fparams, inp.d_iparams, inp.d_keys, vocab, parts), stream)

    def unfused_layers(self, rows: int, stream) -> None:
        """A decode step's layers through the prefill kernels (``fused_decode`` off)."""
        self.layers(rows, stream)

    def decode(self, rows: int, stream, depth: int | None = None) -> None:
        """One decode step of ``rows`` rows: count inputs, forward, LM head, sample (graph body);
        ``depth``: the attention grid's (``decode_depths``; None: the full depth)."""
        inp = self.b.inputs
        self.k["count_tokens"].launch((-(-rows // 32),), (32,), (self.b.counts, inp.d_lanes, inp.d_tokens, self.b.out,
                                                             inp.d_follow, rows, self.c.vocab_size), stream)
        if not self.fused_decode:  # the prefill kernels, for comparison (tools/bench_decode_step.py)
            self.unfused_layers(rows, stream)
            self.logits(0, rows, stream)
            self.sample(rows, stream)
            return
        # After count_tokens (a kernel: the first overlapped launch must follow one), each kernel's
        # blocks may be scheduled while the one before finishes.
        with self.k.overlapped() if self.overlaps(rows) else contextlib.nullcontext():
            self.decode_layers(rows, stream, depth)
            self.decode_gemm("lm_head", self.b.logits, self.b.x, self.lm_head, rows, self.c.vocab_size,
                             self.c.hidden_size, stream, norm=self.w["final_norm"],
                             chain="in" if self.chains(rows) else "")
            self.sample(rows, stream)


def kv_page_bytes(config: DenseConfig, page_size: int, kv_dtype: str) -> int:
    return config.num_layers * 2 * config.num_kv_heads * page_size * config.head_dim * KV_DTYPES[kv_dtype]


__all__ = ["Forward", "StepBuffers", "check_supported", "kv_page_bytes"]
