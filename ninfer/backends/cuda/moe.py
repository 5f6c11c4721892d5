"""The sparse MoE block of a hybrid layer on the GPU: routing and grouped expert GEMMs on the device.

``y = sum_k p_k * expert_{e_k}(x) + sigmoid(shared_gate . x) * shared(x)`` for every row, as the
reference backend's ``HybridModel._moe`` computes it (softmax router in fp32, the ``top_k`` most
probable experts with ties to the lower id, weights renormalised when ``norm_topk_prob``).

Routing never leaves the device, so a decode step's MoE can be captured in a CUDA Graph:

1. router logits ``[rows, E]``: the tensor-core decode GEMM (``mma_gemv``, fp32-faithful) for up to
   8 rows (with ``router_gemv`` one row's is an fp32 GEMV), the grouped GEMM's dense form
   (``moe_router_*``, also three bf16 parts) for prefill rows;
2. ``moe_topk`` (one warp a row): softmax, top-k, renormalisation, and the shared-expert gate
   ``sigmoid(shared_gate . x)``;
3. ``moe_plan`` (one block): the (row, slot) pairs sorted by expert and cut into chunks of at most
   ``chunk`` pairs of one expert; the shared expert's rows follow as chunks of expert -1
   (decode runs 2 and 3 as one launch, ``moe_route``; with ``fold_route`` the normalising router
   GEMM's last block to finish runs them, ``moe_router_route``);
4. ``moe_gate_up_*`` then ``moe_down_*``: one block per (chunk, output tile), so each distinct
   expert's weights are streamed once per chunk (once a step in decode, where a chunk holds all its
   rows); mma.sync with fp32-faithful split activations; the down epilogue scales by the pair weight
   (a step of at most ``gemv_rows`` rows: fp32 GEMVs on the CUDA cores, ``GEMV_GEMMS``);
5. ``moe_combine``: each row sums its k routed pairs in slot order plus its shared pair (with
   ``fold_combine`` a decode step's down GEMM does it, each column tile's last block:
   ``DOWN_COMBINE_GEMM``).

A one-row decode step (the default ``routed_gate_up`` / ``combined_down``) is three launches: the
router, a gate/up GEMV that also does 2 and 3 (the one row's plan is fixed but for the experts), and
a down GEMV that also does 5.

Weights are read under their canonical artifact names (``hybrid_weights.device_layout``: bf16
``router [E, H]``, ``experts.gate_up [E, 2I, H]``, ``experts.down [E, H, I]``, ``shared.gate_up
[2S, H]``, ``shared.down [H, S]``, ``shared_gate [1, H]``). Scratch is one region carved at
construction; addresses never change.
"""

from __future__ import annotations

from ninfer.backends.cuda import runtime as rt
from ninfer.backends.cuda.forward import GEMV_MAX_ROWS, prefetch_bytes
from ninfer.models.hybrid import MOE, HybridConfig

# The grouped GEMMs (gate_up, down) and pairs per chunk of each mode (numba_kernels/moe.py
# GROUPED_SHAPES: a chunk holds 8 * P pairs; both kernels of a mode read the same plan).
DECODE_GEMMS = ("moe_gate_up_t1w8u2p1s3", "moe_down_t1w4u2p1s3", 8)
PREFILL_GEMMS = ("moe_gate_up_t4w4u1p2s2", "moe_down_t4w4u1p2s2", 16)  # H200, 512 rows: 670 us a layer vs 792 (t2 p4)
# The fp32 grouped GEMVs (numba_kernels/moe.py make_grouped_gemv) of a decode step of 1 or 2 rows, where
# ``CudaMoe.gemv_rows`` allows them: (gate_up, down) by row count.
GEMV_GEMMS = {1: ("moe_gate_up_gemv_m1c4x128", "moe_down_gemv_m1c8x64"),
              2: ("moe_gate_up_gemv_m2c4x128", "moe_down_gemv_m2c8x64")}
MIN_CHUNK = 8  # P >= 1: the most chunks a plan can hold is bounded with 8 pairs a chunk
MAX_EXPERTS = 1024  # moe_plan's shared-memory tables
MAX_TOP_K = 32  # moe_topk: one lane of the row's warp per pick
# The most experts of each build of moe_route / moe_router_route (numba_kernels/moe.py: a lane of a
# row's warp holds experts / 32 probabilities, and every pick round walks all of them).
ROUTE_EXPERTS = (256, MAX_EXPERTS)
ROUTER_PREFILL_GEMM = "moe_router_t4w4u1p2s3"  # the grouped GEMM over plain rows, three parts
# Router logits of up to 8 rows: numba_kernels/gemm.py's tensor-core GEMM, one 16-expert tile per
# block, three bf16 parts per activation (fp32-faithful: a near tie must break as in the reference).
ROUTER_DECODE_GEMM = "mma_gemv_store_t1w8u2s3"
# The same from the residual stream: it normalises the rows itself (and keeps them for the routing and
# the expert GEMMs), so a decode step's MoE layer needs no norm launch before it. 16 warps of 4 k-steps
# read a row in one round of loads (this GEMM is all latency: 1 MB of weights).
ROUTER_NORMED_DECODE_GEMM = "mma_gemv_normed_keep_store_t1w16u4s3"
# Its build that loads the router's weights before waiting for the kernel before it (CudaMoe.early_router),
# and that build asking L2 for the next layer's first weights (CudaMoe.next_prefetch).
EARLY_ROUTER_GEMM = ROUTER_NORMED_DECODE_GEMM + "e"
NEXT_ROUTER_GEMM = EARLY_ROUTER_GEMM + "n"
# The one-row router as an fp32 GEMV of 2 or 4 experts a block (CudaMoe.router_gemv; numba_kernels/gemm.py
# ROUTER_GEMV_COLS): it normalises, keeps the row and asks L2 for the next layer as NEXT_ROUTER_GEMM does.
ROUTER_GEMVS = ("gemv_normed_keep_store_m1c2p2n", "gemv_normed_keep_store_m1c4p2n")
# The one-row gate/up GEMVs that route the row themselves (CudaMoe.routed_gate_up), for at most 256 experts;
# ``f``: the shared chunk in the grid's first row of blocks, ``i{N}``: N column tiles a block, ``l``: loading
# each next tile's first step while summing a tile (numba_kernels/moe.py SHARED_FIRST, ITEMS, LEAD).
ROUTED_GATE_UPS = ("moe_gate_up_gemv_m1c4x128r256", "moe_gate_up_gemv_m1c4x64r256", "moe_gate_up_gemv_m1c4x128r256f",
                   "moe_gate_up_gemv_m1c4x128r256i3f", "moe_gate_up_gemv_m1c4x128r256i3fl")
# Those with an ``n`` build, asking L2 for their chunks' down weights (CudaMoe.down_prefetch).
NEXT_ROUTED_GATE_UPS = (ROUTED_GATE_UPS[0], *ROUTED_GATE_UPS[2:])
# The one-row down GEMVs with the combine folded in (CudaMoe.combined_down), for at most 8 experts a token.
COMBINED_DOWNS = ("moe_down_combine_gemv_m1c8x32g9", "moe_down_combine_gemv_m1c8x64g9")


def combine_gemm(down: str) -> str:
    """The grouped decode down GEMM ``down`` with ``moe_combine_residual`` folded in (its "down_combine" build)."""
    return down.replace("moe_down_", "moe_down_combine_", 1)


DOWN_COMBINE_GEMM = combine_gemm(DECODE_GEMMS[1])


def route_capacity(n_experts: int) -> int:
    """The build of ``moe_route`` / ``moe_router_route`` for ``n_experts`` experts (its ``_e`` suffix):
    the one with the fewest slots that hold them."""
    return min(e for e in ROUTE_EXPERTS if e >= n_experts)


def check_supported(config: HybridConfig) -> None:
    """Reject MoE shapes the kernels were not built for, naming the field."""
    c = config
    if MOE not in c.mlp_types:
        return
    if c.num_experts > MAX_EXPERTS:
        raise ValueError(f"the CUDA MoE supports at most {MAX_EXPERTS} experts, the model has {c.num_experts}")
    if c.num_experts_per_tok > MAX_TOP_K:
        raise ValueError(f"the CUDA MoE routes to at most {MAX_TOP_K} experts a token, the model asks "
                         f"num_experts_per_tok {c.num_experts_per_tok}")
    for field in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(c, field) % 8:  # 16-byte vector loads of weight rows and activations
            raise ValueError(f"the CUDA MoE needs {field} divisible by 8, got {getattr(c, field)}")


def max_chunks(config: HybridConfig, rows: int, chunk: int) -> int:
    """Chunks ``moe_plan`` can write for ``rows`` rows: each used expert's pairs in runs of ``chunk``,
    then the shared expert's rows. A row picks an expert once, so with ``rows <= chunk`` every used
    expert fits one chunk."""
    pairs = rows * config.num_experts_per_tok
    used = min(config.num_experts, pairs)
    routed = used if rows <= chunk else used + pairs // chunk
    return routed + -(-rows // chunk)


def _regions(config: HybridConfig, max_rows: int) -> dict[str, int]:
    c = config
    k = c.num_experts_per_tok
    pairs = max_rows * (k + 1)  # routed pairs, then one shared pair a row
    chunks = max_chunks(c, max_rows, MIN_CHUNK)  # chunks of 8 pairs or more never outnumber these
    return {
        "logits": max_rows * c.num_experts * 4,
        "topk_ids": max_rows * k * 4, "topk_w": max_rows * k * 4, "row_pair": max_rows * k * 4,
        "pair_row": pairs * 4, "pair_weight": pairs * 4,
        "chunks": 3 * chunks * 4, "n_chunks": 4,
        "act": pairs * _act_width(c) * 4, "out": pairs * c.hidden_size * 4,
        # moe_router_route's ticket and the folded combine's, one a column tile of the down GEMM: zero
        # between launches (the scratch is zeroed at start)
        "route_ticket": 4, "combine_tickets": 4 * -(-c.hidden_size // 16),
    }


def _act_width(config: HybridConfig) -> int:
    return max(config.moe_intermediate_size, config.shared_expert_intermediate_size)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


class CudaMoe:
    """The MoE blocks of one hybrid model over a fixed scratch region (see the module docstring)."""

    decode_gemms = DECODE_GEMMS  # per instance, so a benchmark can try other shapes
    prefill_gemms = PREFILL_GEMMS
    # A normalising decode router routes in its last block (``moe_router_route``) instead of launching
    # ``moe_route``. Off: bit for bit on an H100 (tests/cuda/test_cuda_moe.py), but level or slower there
    # (tools/gpu_bench_hybrid.py --fold-route-ablation, docs/benchmarks.md).
    fold_route = False
    # A decode step's down GEMM adds the MoE into the residual stream itself (``combine_gemm``: each
    # column tile's last block sums the tile's pairs) instead of launching ``moe_combine_residual``,
    # where its down build has such a form (not the GEMVs nor the ``e`` builds). Off: bit for bit on
    # an H100, level or slower there (--fold-combine-ablation), as ``fold_route``.
    fold_combine = False
    # A decode step's normalising router GEMM streams its weights (1 MiB on a 35B-A3B) before it waits
    # for the kernel before it (EARLY_ROUTER_GEMM), when launches overlap (Forward.overlaps): an H100's
    # 35B-A3B decode +2.5% at batch 1, +1% at 4, level at 8 (two runs of tools/gpu_bench_hybrid.py
    # --early-router-ablation, docs/benchmarks.md).
    early_router = True
    # Decode steps of at most this many rows (0, 1 or 2) run the expert GEMMs as fp32 GEMVs on the CUDA
    # cores (``gemv_gemms``), streamed as the dense batch-1 GEMVs are, instead of the tensor-core
    # grouped GEMMs: an H100's 35B-A3B batch-1 step 3.26-3.27 -> 3.21-3.22 ms of GPU time (gate/up 16.8
    # -> 15.2 us a layer, down 10.0 -> 8.7; tools/gpu_bench_hybrid.py --moe-gemv-ablation,
    # docs/benchmarks.md). Two rows are tested, not timed.
    gemv_rows = 1
    gemv_gemms = GEMV_GEMMS
    # A one-row step's gate/up GEMV of this build routes the row itself (numba_kernels/moe.py
    # ``make_routed_gemv``: every block routes from the logits and takes its chunk's expert), so no
    # ``moe_route`` launch precedes it; None launches ``moe_route``. Used where the experts fit the build
    # and ``gemv_rows`` allows one-row GEMVs. A one-row step that adds into the residual stream runs its
    # down GEMV as the ``combined_down`` build, with the combine folded in (``make_combined_down_gemv``:
    # a block per column tile takes every chunk, so it sums the pairs itself, no ticket), one launch
    # fewer; None launches the GEMV and ``moe_combine_residual``. Used where ``gemv_rows`` allows one-row
    # GEMVs and ``top_k + 1`` chunks fit the build's groups. Together: an H100's 35B-A3B batch-1 step
    # 3.21-3.22 -> 3.04-3.05 ms of GPU time (-5%; routing alone 3.10, combining alone 3.16;
    # tools/gpu_bench_hybrid.py --moe-builds-ablation, docs/benchmarks.md). The default build takes three
    # column tiles a block (``i3``: a routing a block, not a tile, and every block of the 35B-A3B resident
    # at once) and runs the shared chunk in the grid's first row of blocks (``f``: they start beside the
    # router and load the shared expert's weights while it runs): an H200's 35B-A3B batch-1 step 2.40 ->
    # 2.34 ms of GPU time with ``i3f`` (``f`` alone 2.37; asking L2 for the tiles too, 2.40). It also loads
    # a block's next tile while the block sums a tile (``l``): an H100's step 2.76 -> 2.74 and 2.73 ->
    # 2.71 ms against ``i3f`` in two calls (two runs each); four tiles a block 2.72-2.75, two steps in
    # flight a thread (96 registers) 2.73-2.74 at four tiles, 2.83-2.84 at three (docs/benchmarks.md).
    routed_gate_up: str | None = "moe_gate_up_gemv_m1c4x128r256i3fl"
    combined_down: str | None = "moe_down_combine_gemv_m1c8x32g9"
    # The share of each chunk's down matrix that the routed gate/up GEMV (its ``NEXT`` build, the first
    # of ROUTED_GATE_UPS + "n") asks L2 for at its tail, so the down GEMV, which waits for the plan,
    # starts on L2; 0: the plain build. H100, 35B-A3B batch 1, GPU ms a step (tools/gpu_bench_hybrid.py
    # --down-prefetch-ablation): 2.97-2.98 -> 2.93-2.94 at 0.5 (three runs), 2.92 at 0.25, 2.98 at 0.75,
    # 3.01 at 1 (the whole 19 MB of a layer's down weights crowds the gate/up GEMV's own stream). With the
    # ``i3fl`` gate/up (fortieth session, another H100, three runs): 0.5 2.72, 0.25 2.69, 0.125 2.70, 0.75
    # 2.75-2.76, none 2.70.
    down_prefetch = 0.25
    # Bytes of the next layer's first GEMM's weights (``forward``'s ``then``) that a one-row step's early
    # router asks L2 for once its own weights are in (NEXT_ROUTER_GEMM), a share a block: DRAM idles
    # through the routing, and that GEMM (the 35B-A3B's 50 MB DeltaNet in_proj) then starts on L2. 0: the
    # plain build. H100, 35B-A3B batch 1, GPU ms a step (tools/gpu_bench_hybrid.py --next-prefetch-ablation,
    # three runs): 2.93-2.95 -> 2.90 at 8 MiB, 2.91 at 4, 2.90 at 12 and 15.9. A block's request must stay
    # under 1 MiB (forward.L2_PREFETCH_MAX): 16 MiB over the router's 16 blocks measured as nothing.
    # With the expert GEMVs' weights at L2's evict-first priority it was the same (2.90). A batch's experts,
    # hundreds of MB a layer, would evict the bytes before the next layer reads them: one row only.
    next_prefetch = 8 << 20
    # A one-row step's normalising router as this fp32 GEMV build (one of ROUTER_GEMVS) instead of the
    # tensor-core GEMM. That GEMM's 16 blocks of 512 threads (108 registers each) do not fit beside the
    # o / out GEMV's blocks before it, so they load their weights only as that GEMV's blocks leave; the
    # GEMV's 64-128 blocks of 128 threads (48-64 registers) sit beside them and hold the router's weights
    # before the wait. None: the tensor-core GEMM. An H200's 35B-A3B batch-1 step 2.40 -> 2.36 ms of GPU
    # time with two experts a block (four: 2.41), 2.34 -> 2.29 beside the ``i3f`` gate/up
    # (tools/gpu_bench_hybrid.py --moe-builds-ablation 'router_gemv=NAME', docs/benchmarks.md).
    router_gemv: str | None = "gemv_normed_keep_store_m1c2p2n"

    @staticmethod
    def kernel_names() -> list[str]:
        """Every kernel ``forward`` may launch (load them before graph capture)."""
        routes = [f"{kind}_e{e}" for kind in ("moe_route", "moe_router_route") for e in ROUTE_EXPERTS]
        return [*routes, "moe_topk", "moe_plan", "moe_combine", "moe_combine_residual", ROUTER_DECODE_GEMM,
                ROUTER_NORMED_DECODE_GEMM, EARLY_ROUTER_GEMM, NEXT_ROUTER_GEMM, *ROUTER_GEMVS, ROUTER_PREFILL_GEMM,
                *DECODE_GEMMS[:2], *PREFILL_GEMMS[:2], DOWN_COMBINE_GEMM, *(n for p in GEMV_GEMMS.values() for n in p),
                *ROUTED_GATE_UPS, *COMBINED_DOWNS, *(name + "n" for name in NEXT_ROUTED_GATE_UPS)]

    @staticmethod
    def scratch_bytes(config: HybridConfig, max_rows: int) -> int:
        """Device bytes ``forward`` needs for up to ``max_rows`` rows (logits, plan, pair activations)."""
        return sum(_aligned(n) for n in _regions(config, max_rows).values())

    def __init__(self, kernels: rt.Kernels, config: HybridConfig, scratch: rt.DevicePtr, max_rows: int):
        """``scratch``: at least ``scratch_bytes(config, max_rows)`` bytes, owned by this object."""
        check_supported(config)
        if max_rows < 1:
            raise ValueError(f"max_rows must be positive, got {max_rows}")
        self.k = kernels
        self.c = config
        self.max_rows = max_rows
        self.route_experts = route_capacity(config.num_experts)  # any larger build routes the same
        arena = rt.Arena(scratch)
        for name, nbytes in _regions(config, max_rows).items():
            setattr(self, name, arena.take(nbytes, f"moe.{name}"))

    def forward(self, y: rt.DevicePtr, x: rt.DevicePtr, weights: dict[str, rt.DevicePtr], layer: int, rows: int,
                stream, residual: bool = False, norm: tuple[rt.DevicePtr, float, rt.DevicePtr] | None = None,
                then: rt.DevicePtr | None = None) -> None:
        """Enqueue ``y[:rows, :hidden] = MoE_layer(x[:rows])`` (fp32 ``[rows, hidden]`` each, y fully
        written, x untouched; with ``residual`` ``y += ...``, the residual stream) on ``stream``: no host
        sync, fixed addresses, capturable. ``norm = (weight, eps, normed)``, decode rows only: the layer
        takes rmsnorm(x) * weight instead, which the router GEMM writes into ``normed`` on its way.
        ``then``: the weights the next layer's first GEMM streams (``next_prefetch``, one row)."""
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"MoE of {rows} rows: this CudaMoe takes 1..{self.max_rows}")
        c, k = self.c, self.k
        p = f"layers.{layer}."
        H, top_k = c.hidden_size, c.num_experts_per_tok
        decode = rows <= GEMV_MAX_ROWS
        gate_up, down, chunk = self.decode_gemms if decode else self.prefill_gemms
        if rows <= self.gemv_rows:
            gate_up, down = self.gemv_gemms[rows]
        routed = self.routed_gemv(rows)
        combined = self.combined_gemv(rows) if residual else None
        self.check_gemms(gate_up, down)
        if norm is not None and self.fold_route and not routed:  # the router GEMM also routes, in its last block
            x = self.normed_router_route(x, weights, p, norm, rows, chunk, stream)
        else:
            if norm is None:
                self.router_logits(x, weights[p + "router"], rows, stream)
            else:
                x = self.normed_router_logits(x, weights[p + "router"], norm, rows, stream, then)
            if not routed:  # else the gate/up GEMV routes
                self.route(x, weights[p + "shared_gate"], rows, chunk, stream)
        chunks = max_chunks(c, rows, chunk)
        I, S, width = c.moe_intermediate_size, c.shared_expert_intermediate_size, _act_width(c)
        gate_up_args = (self.act, x, weights[p + "experts.gate_up"], weights[p + "shared.gate_up"], self.chunks,
                        self.n_chunks, self.pair_row, self.pair_weight, I, S, H, H, width, H)
        if routed:
            routing = (self.row_pair, self.topk_ids, self.topk_w, self.logits, weights[p + "shared_gate"],
                       c.num_experts, top_k, int(c.norm_topk_prob))
            if self.down_prefetch and routed + "n" in k.entries:  # and the chunks' down weights into L2
                share = self.down_prefetch
                routed, routing = routed + "n", routing + (
                    weights[p + "experts.down"], weights[p + "shared.down"], int(H * I * 2 * share) // 16 * 16,
                    int(H * S * 2 * share) // 16 * 16)
            self.grouped(routed, chunks, max(I, S), stream, gate_up_args + routing)
        else:
            self.grouped(gate_up, chunks, max(I, S), stream, gate_up_args)
        down_args = (self.out, self.act, weights[p + "experts.down"], weights[p + "shared.down"], self.chunks,
                     self.n_chunks, self.pair_row, self.pair_weight, H, H, I, S, H, width)
        if combined:  # a block per column tile runs every chunk and adds their sum into y
            kernel = k[combined]
            kernel.launch((-(-H // kernel.meta["cols"]),), (kernel.meta["threads"],),
                          down_args + (y, self.row_pair, rows, top_k, self.combine_tickets), stream)
        elif decode and residual and self.fold_combine and combine_gemm(down) in k.entries:  # each column tile's
            # last block adds the tile into y (the GEMVs and the early builds have no such build)
            self.grouped(combine_gemm(down), chunks, H, stream,
                         down_args + (y, self.row_pair, rows, top_k, self.combine_tickets))
        else:
            self.grouped(down, chunks, H, stream, down_args)
            combine = k["moe_combine_residual" if residual else "moe_combine"]
            threads = combine.meta["threads"]
            combine.launch((-(-H // threads), rows), (threads,), (y, self.out, self.row_pair, rows, top_k, H), stream)

    def one_row_build(self, name: str | None, rows: int) -> bool:
        """Whether a one-row build (``routed_gate_up``, ``combined_down``) named ``name`` may take a step
        of ``rows`` rows: one row, run as GEMVs."""
        return name is not None and rows == 1 and self.gemv_rows >= 1

    def routed_gemv(self, rows: int) -> str | None:
        """The gate/up build that routes a step of ``rows`` rows itself (``routed_gate_up``), if it may."""
        name = self.routed_gate_up
        fits = self.one_row_build(name, rows) and self.c.num_experts <= self.k[name].meta["max_experts"]
        return name if fits else None

    def combined_gemv(self, rows: int) -> str | None:
        """The down build with the combine folded in for a step of ``rows`` rows (``combined_down``), if it may."""
        name = self.combined_down
        fits = self.one_row_build(name, rows) and self.c.num_experts_per_tok + 1 <= self.k[name].meta["groups"]
        return name if fits else None

    def check_gemms(self, gate_up: str, down: str) -> None:
        """An ``e`` build of down (numba_kernels/moe.py ``make_grouped``'s ``early``) reads the plan
        before its grid wait, which is safe only after the gate/up build that triggers late."""
        if self.k[down].meta.get("early") and not self.k[gate_up].meta.get("early"):
            raise ValueError(f"{down} loads before its grid wait: it needs an early gate/up build, not {gate_up}")

    def route(self, x: rt.DevicePtr, shared_gate: rt.DevicePtr, rows: int, chunk: int, stream) -> None:
        """Top-k picks and the expert-sorted plan from ``logits``; the shared expert's gate from x."""
        c, k = self.c, self.k
        E, H, top_k = c.num_experts, c.hidden_size, c.num_experts_per_tok
        picks = (self.topk_ids, self.topk_w, self.logits, x, shared_gate, rows, E, H, top_k, int(c.norm_topk_prob))
        if rows <= GEMV_MAX_ROWS:  # a few rows: top-k and plan in one block
            route = k[f"moe_route_e{self.route_experts}"]
            route.launch((1,), (route.meta["threads"],), (*self.plan(), *picks, chunk), stream)
        else:
            k["moe_topk"].launch((rows,), (32,), (self.topk_ids, self.topk_w, self.pair_row, self.pair_weight,
                                                  *picks[2:]), stream)
            planner = k["moe_plan"]
            planner.launch((1,), (planner.meta["threads"],),
                           (*self.plan(), self.topk_ids, self.topk_w, rows, top_k, E, chunk), stream)

    def plan(self) -> tuple:
        """The routing's outputs the grouped GEMMs and the combine read."""
        return self.chunks, self.n_chunks, self.pair_row, self.pair_weight, self.row_pair

    def normed_router_route(self, x: rt.DevicePtr, weights: dict[str, rt.DevicePtr], p: str,
                            norm: tuple[rt.DevicePtr, float, rt.DevicePtr], rows: int, chunk: int,
                            stream) -> rt.DevicePtr:
        """``normed_router_logits`` and ``route`` in one launch (``moe_router_route``); returns ``normed``."""
        if rows > GEMV_MAX_ROWS:
            raise ValueError(f"the MoE's routing router takes at most {GEMV_MAX_ROWS} rows, got {rows}")
        c = self.c
        weight, eps, normed = norm
        kernel = self.k[f"moe_router_route_e{self.route_experts}"]
        kernel.launch((-(-c.num_experts // kernel.meta["cols"]),), (kernel.meta["threads"],),
                      (self.logits, x, weights[p + "router"], weight, rows, c.num_experts, c.hidden_size, eps, normed,
                       *self.plan(), self.topk_ids, self.topk_w, weights[p + "shared_gate"], c.num_experts_per_tok,
                       int(c.norm_topk_prob), chunk, self.route_ticket), stream)
        return normed

    def router_logits(self, x: rt.DevicePtr, router: rt.DevicePtr, rows: int, stream) -> None:
        """``logits[:rows] = x @ router.T`` in fp32 (the tensor-core decode GEMM is fp32-faithful)."""
        E, H = self.c.num_experts, self.c.hidden_size
        if rows <= GEMV_MAX_ROWS:
            kernel = self.k[ROUTER_DECODE_GEMM]
            kernel.launch((-(-E // kernel.meta["cols"]),), (kernel.meta["threads"],),
                          (self.logits, x, router, self.logits, rows, E, H, E, 0.0), stream)
        else:  # the grouped GEMM's dense form: 16 rows a block, 64 experts a block
            kernel = self.k[ROUTER_PREFILL_GEMM]
            kernel.launch((-(-E // kernel.meta["cols"]), -(-rows // kernel.meta["pairs"])), (kernel.meta["threads"],),
                          (self.logits, x, router, router, self.chunks, self.n_chunks, self.pair_row,
                           self.pair_weight, rows, E, H, H, E, H), stream)

    def normed_router_logits(self, x: rt.DevicePtr, router: rt.DevicePtr,
                             norm: tuple[rt.DevicePtr, float, rt.DevicePtr], rows: int, stream,
                             then: rt.DevicePtr | None = None) -> rt.DevicePtr:
        """``logits[:rows] = (rmsnorm(x) * weight) @ router.T``, the normalised rows into ``normed``
        as well (returned: the rest of the layer reads them); the early build and ``router_gemv`` ask L2
        for the first ``next_prefetch`` bytes of ``then``."""
        if rows > GEMV_MAX_ROWS:
            raise ValueError(f"the MoE's normalising router takes at most {GEMV_MAX_ROWS} rows, got {rows}")
        weight, eps, normed = norm
        E, H = self.c.num_experts, self.c.hidden_size
        args = (self.logits, x, router, weight, rows, E, H, E, eps, normed)
        one_row_gemv = rows == 1 and self.router_gemv is not None
        name = EARLY_ROUTER_GEMM if self.early_router else ROUTER_NORMED_DECODE_GEMM
        name = self.router_gemv if one_row_gemv else name
        blocks = -(-E // self.k[name].meta["cols"])
        ahead = 0
        if then is not None and rows == 1:  # a batch's expert streams would evict the bytes first
            ahead = prefetch_bytes(min(self.next_prefetch, then.nbytes), blocks)
        if one_row_gemv:  # its one build asks for nothing when given 0 bytes
            args += (then if ahead else router, ahead)
        elif self.early_router and ahead:
            name, args = NEXT_ROUTER_GEMM, args + (then, ahead)
        kernel = self.k[name]
        kernel.launch((blocks,), (kernel.meta["threads"],), args, stream)
        return normed

    def grouped(self, name: str, chunks: int, n: int, stream, args: tuple) -> None:
        kernel = self.k[name]
        kernel.launch((-(-n // kernel.meta["cols"]), chunks), (kernel.meta["threads"],), args, stream)
