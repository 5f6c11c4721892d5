"""CudaMoe (routing, plan and grouped expert GEMMs on the device) against the reference ``_moe`` (GPU only).

Two shapes: the tiny-qwen3-next preset's MoE (4 experts, top 2, expert width 32 != shared width 48)
and the Qwen3.6-35B-A3B block (hidden 2048, 256 experts, top 8 renormalised, experts and shared
expert 512 wide), each for decode rows 1..8 (chunks of 8 pairs, fp32-faithful activations) and a
prefill chunk (chunks of 16 pairs, two bf16 parts per activation). Routing must pick the same
experts as ``route``; outputs agree to fp32 summation order (decode) or to the 2-part split (prefill).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from ninfer.artifact.bf16 import to_float32  # noqa: E402
from ninfer.backends.reference.hybrid import HybridForward, route  # noqa: E402
from ninfer.backends.reference.hybrid_weights import DenseMlpWeights, MoeWeights  # noqa: E402
from ninfer.convert.random_model import HYBRID_PRESETS  # noqa: E402
from ninfer.models.hybrid import HybridConfig, MOE, tensor_names  # noqa: E402

from cuda_helpers import Gpu, rel_err  # noqa: E402

TINY = HYBRID_PRESETS["tiny-qwen3-next"]
A3B = HybridConfig(
    architecture="Qwen3_5MoeForCausalLM", vocab_size=1024, hidden_size=2048, num_layers=4,
    layer_types=("linear_attention",) * 3 + ("full_attention",), mlp_types=(MOE,) * 4, rms_norm_eps=1e-6,
    num_heads=16, num_kv_heads=2, head_dim=256, rotary_dim=64, rope_theta=10000000.0,
    max_position_embeddings=4096, linear_num_k_heads=16, linear_num_v_heads=32, linear_k_head_dim=128,
    linear_v_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True)
CONFIGS = {"tiny": TINY, "a3b": A3B}
PREFILL_ROWS = {"tiny": 150, "a3b": 64}  # tiny: > 32 pairs an expert, so experts span several chunks
DECODE_TOL, PREFILL_TOL = 1e-5, 1e-4
MOE_ROLES = ("router", "experts.gate_up", "experts.down", "shared.gate_up", "shared.down", "shared_gate")


def _bf16_bits(rng, shape, scale):
    """Random bf16 bit patterns: random sign and 7-bit mantissa, magnitudes in [scale / 8, 2 * scale).

    Built from 16 random bits an element: normal samples would take most of the test's time at the
    35B-A3B shape (1.5 G weights)."""
    raw = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    top = np.uint16(127 + int(np.floor(np.log2(scale))))
    exponent = top - ((raw >> np.uint16(7)) & np.uint16(3))
    return (raw & np.uint16(0x807F)) | (exponent << np.uint16(7))


class _Experts:
    """The reference's ``[E, in, out]`` float32 experts, widened on first use (256 full ones are 3 GB)."""

    def __init__(self, bits):
        self.bits = bits
        self.cache = {}

    def __getitem__(self, expert):
        expert = int(expert)
        if expert not in self.cache:
            self.cache[expert] = to_float32(self.bits[expert]).T
        return self.cache[expert]


class Block:
    """One MoE layer's random weights on the device and in the reference's layout."""

    def __init__(self, gpu, config, layer, seed):
        rng = np.random.default_rng(seed)
        prefix = f"layers.{layer}."
        shapes = tensor_names(config)
        self.bits = {prefix + role: _bf16_bits(rng, shapes[prefix + role], shapes[prefix + role][-1] ** -0.5)
                     for role in MOE_ROLES}
        self.device = {name: gpu.put(bits, name) for name, bits in self.bits.items()}
        b = {name[len(prefix):]: bits for name, bits in self.bits.items()}
        self.reference = MoeWeights(
            router=to_float32(b["router"]).T.copy(), gate_up=_Experts(b["experts.gate_up"]),
            down=_Experts(b["experts.down"]),
            shared=DenseMlpWeights(gate_up=to_float32(b["shared.gate_up"]).T.copy(),
                                   down=to_float32(b["shared.down"]).T.copy()),
            shared_gate=to_float32(b["shared_gate"]).T.copy())


def _reference(config, weights, x):
    model = HybridForward.__new__(HybridForward)  # _moe reads only the config
    model.config = config
    return model._moe(weights, x)


@pytest.fixture(scope="module")
def gpu():
    return Gpu()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, gpu):
    from ninfer.backends.cuda.moe import CudaMoe

    config = CONFIGS[request.param]
    layer = config.mlp_types.index(MOE)
    block = Block(gpu, config, layer, seed=11)
    max_rows = PREFILL_ROWS[request.param]
    scratch = gpu.empty(CudaMoe.scratch_bytes(config, max_rows))
    moe = CudaMoe(gpu.kernels, config, scratch, max_rows)
    return request.param, config, layer, block, moe


def _run(gpu, moe, config, layer, block, x):
    rows, hidden = x.shape
    d_x = gpu.put(x)
    d_y = gpu.empty(rows * hidden * 4)
    moe.forward(d_y, d_x, block.device, layer, rows, gpu.stream)
    got = gpu.get(d_y, np.float32, (rows, hidden))
    for ptr in (d_x, d_y):
        gpu.device.free(ptr)
    return got


def _check_routing(gpu, moe, config, block, x):
    rows, k = x.shape[0], config.num_experts_per_tok
    want_ids, want_w = route(x @ block.reference.router, k, config.norm_topk_prob)
    got_ids = gpu.get(moe.topk_ids, np.int32, (rows, k))
    got_w = gpu.get(moe.topk_w, np.float32, (rows, k))
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rows", range(1, 9))
def test_decode_rows_match_reference(gpu, case, rows):
    name, config, layer, block, moe = case
    x = np.random.default_rng(rows).standard_normal((rows, config.hidden_size), dtype=np.float32)
    got = _run(gpu, moe, config, layer, block, x)
    _check_routing(gpu, moe, config, block, x)
    assert rel_err(got, _reference(config, block.reference, x)) < DECODE_TOL


@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_builds_match_reference(gpu, case, rows):
    """``CudaMoe.gemv_rows``: the expert GEMMs of one or two rows as fp32 GEMVs, every shape of
    numba_kernels/moe.py GEMV_SHAPES for the row count (an A3B expert's rows take gate/up two steps a
    thread), against the reference."""
    from numba_kernels.moe import GEMV_SHAPES, gemv_name

    name, config, layer, block, moe = case
    x = np.random.default_rng(70 + rows).standard_normal((rows, config.hidden_size), dtype=np.float32)
    want = _reference(config, block.reference, x)
    shapes = [gemv_name(*s) for s in GEMV_SHAPES if s[1] == rows]
    gate_up, down = moe.gemv_gemms[rows]
    try:
        moe.gemv_rows = rows
        moe.routed_gate_up = None  # the plain gate/up builds under test at one row too
        for kernel in shapes:  # each with the default other half
            moe.gemv_gemms = {rows: (kernel, down) if "gate_up" in kernel else (gate_up, kernel)}
            assert rel_err(_run(gpu, moe, config, layer, block, x), want) < DECODE_TOL, kernel
    finally:
        for option in ("gemv_rows", "gemv_gemms", "routed_gate_up"):
            moe.__dict__.pop(option, None)  # the class's defaults again


def test_routed_gate_up_matches_reference(gpu, case):
    """``CudaMoe.routed_gate_up``: a one-row step whose gate/up GEMV routes the row itself (no
    ``moe_route`` launch) writes the picks and the plan the down GEMM and the combine read, from a
    scratch that holds none of them, and the MoE agrees with the reference, for every build."""
    from ninfer.backends.cuda import runtime as rt
    from ninfer.backends.cuda.moe import NEXT_ROUTED_GATE_UPS, ROUTED_GATE_UPS

    name, config, layer, block, moe = case
    x = np.random.default_rng(80).standard_normal((1, config.hidden_size), dtype=np.float32)
    want = _reference(config, block.reference, x)
    try:  # then the builds that ask L2 for the chunks' down weights (CudaMoe.down_prefetch), a hint
        for routed, down_prefetch in ([(name, 0.0) for name in ROUTED_GATE_UPS]
                                      + [(name, 1.0) for name in NEXT_ROUTED_GATE_UPS]):
            moe.routed_gate_up, moe.down_prefetch = routed, down_prefetch
            for region in (moe.chunks, moe.n_chunks, moe.pair_row, moe.pair_weight, moe.row_pair, moe.topk_ids,
                           moe.topk_w):
                rt.memset32(region, 0x7FC00007, region.nbytes // 4, gpu.stream)
            assert rel_err(_run(gpu, moe, config, layer, block, x), want) < DECODE_TOL, (routed, down_prefetch)
            _check_routing(gpu, moe, config, block, x)
    finally:
        moe.__dict__.pop("routed_gate_up", None)
        moe.__dict__.pop("down_prefetch", None)


def test_combined_down_is_the_down_gemv_and_combine(gpu, case):
    """``CudaMoe.combined_down``: a one-row step adding into the residual stream, whose down GEMV sums
    the pairs itself (no ``moe_combine_residual``), gives the GEMV and combine launched apart bit for
    bit, and with the routed gate/up the reference's MoE."""
    from ninfer.backends.cuda.moe import COMBINED_DOWNS, ROUTED_GATE_UPS

    name, config, layer, block, moe = case
    x = np.random.default_rng(81).standard_normal((1, config.hidden_size), dtype=np.float32)
    resid = np.random.default_rng(82).standard_normal((1, config.hidden_size), dtype=np.float32)
    want = _reference(config, block.reference, x)

    def run() -> np.ndarray:
        d_x, d_y = gpu.put(x), gpu.put(resid)
        moe.forward(d_y, d_x, block.device, layer, 1, gpu.stream, residual=True)
        got = gpu.get(d_y, np.float32, (1, config.hidden_size))
        for ptr in (d_x, d_y):
            gpu.device.free(ptr)
        return got

    gate_up = moe.gemv_gemms[1][0]
    try:
        for combined in COMBINED_DOWNS:
            meta = moe.k[combined].meta
            moe.combined_down = moe.routed_gate_up = None
            moe.gemv_gemms = {1: (gate_up, f"moe_down_gemv_m1c{meta['cols']}x{meta['threads'] // meta['groups']}")}
            apart = run()  # the down GEMV summing in the same order, then the combine
            assert rel_err(apart - resid, want) < DECODE_TOL
            moe.combined_down = combined
            np.testing.assert_array_equal(run(), apart)
            moe.routed_gate_up = ROUTED_GATE_UPS[0]
            assert rel_err(run() - resid, want) < DECODE_TOL, combined
    finally:
        for option in ("combined_down", "routed_gate_up", "gemv_gemms"):
            moe.__dict__.pop(option, None)


class _NormedRow:
    """One row of a one-row step that adds the MoE of ``rmsnorm(x) * norm_w`` into its residual stream
    (``CudaMoe.forward`` with ``norm``): the inputs, the reference's MoE (``want``) and ``run(then)``."""

    def __init__(self, gpu, config, layer, block, moe, seed):
        rng = np.random.default_rng(seed)
        H = config.hidden_size
        self.gpu, self.layer, self.block, self.moe, self.H = gpu, layer, block, moe, H
        self.x = rng.standard_normal((1, H), dtype=np.float32)
        self.resid = rng.standard_normal((1, H), dtype=np.float32)
        norm_w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
        self.d_w, self.d_normed = gpu.put(norm_w), gpu.empty(H * 4)
        self.then = block.device[f"layers.{layer}.experts.gate_up"]  # any weights: they are only asked of L2
        x64 = self.x.astype(np.float64)
        self.normed = (self.x / np.sqrt(np.mean(x64 ** 2) + 1e-6) * norm_w).astype(np.float32)
        self.want = _reference(config, block.reference, self.normed)

    def run(self, then) -> np.ndarray:
        """The residual stream after the step; ``then``: the weights the router asks L2 for, or None."""
        gpu = self.gpu
        d_x, d_y = gpu.put(self.x), gpu.put(self.resid)
        self.moe.forward(d_y, d_x, self.block.device, self.layer, 1, gpu.stream, residual=True,
                         norm=(self.d_w, 1e-6, self.d_normed), then=then)
        got = gpu.get(d_y, np.float32, (1, self.H))
        for ptr in (d_x, d_y):
            gpu.device.free(ptr)
        return got


def test_next_prefetch_changes_no_bit(gpu, case):
    """``CudaMoe.next_prefetch``: a one-row step whose normalising router asks L2 for the next layer's
    first weights is bit for bit the step without it (a hint), and the reference's MoE."""
    name, config, layer, block, moe = case
    row = _NormedRow(gpu, config, layer, block, moe, seed=91)
    try:
        moe.next_prefetch = 0
        plain = row.run(row.then)
        moe.next_prefetch = 8 << 20
        np.testing.assert_array_equal(row.run(row.then), plain)
        assert rel_err(plain - row.resid, row.want) < DECODE_TOL
    finally:
        moe.__dict__.pop("next_prefetch", None)


def test_router_gemv_matches_reference(gpu, case):
    """``CudaMoe.router_gemv``: a one-row step whose normalising router is an fp32 GEMV (each build, with
    and without asking L2 for the next layer's first weights) picks the reference's experts with its
    weights, keeps the normalised row, and adds the reference's MoE into the residual stream."""
    from ninfer.backends.cuda.moe import ROUTER_GEMVS

    name, config, layer, block, moe = case
    row = _NormedRow(gpu, config, layer, block, moe, seed=93)
    try:
        for build in ROUTER_GEMVS:
            moe.router_gemv = build
            for then in (None, row.then):
                assert rel_err(row.run(then) - row.resid, row.want) < DECODE_TOL, (build, then is None)
                assert rel_err(gpu.get(row.d_normed, np.float32, (1, row.H)), row.normed) < DECODE_TOL, build
                _check_routing(gpu, moe, config, block, row.normed)
    finally:
        moe.__dict__.pop("router_gemv", None)


def test_prefill_chunk_matches_reference(gpu, case):
    name, config, layer, block, moe = case
    x = np.random.default_rng(99).standard_normal((PREFILL_ROWS[name], config.hidden_size), dtype=np.float32)
    got = _run(gpu, moe, config, layer, block, x)
    _check_routing(gpu, moe, config, block, x)
    want = _reference(config, block.reference, x)
    assert rel_err(got, want) < PREFILL_TOL
    worst_row = max(rel_err(got[r], want[r]) for r in range(x.shape[0]))
    assert worst_row < 10 * PREFILL_TOL


def test_decode_replays_in_a_cuda_graph(gpu, case):
    from ninfer.backends.cuda import runtime as rt

    name, config, layer, block, moe = case
    rows, hidden = 4, config.hidden_size
    d_x, d_y = gpu.put(np.zeros((rows, hidden), np.float32)), gpu.empty(rows * hidden * 4)
    graph = rt.Graph.capture(gpu.stream, lambda: moe.forward(d_y, d_x, block.device, layer, rows, gpu.stream))
    try:
        for seed in (1, 2):  # new inputs at the captured address, new routing, same graph
            x = np.random.default_rng(seed).standard_normal((rows, hidden), dtype=np.float32)
            rt.check(rt.cu.cuMemcpyHtoD(d_x.addr, x.ctypes.data, x.nbytes), "cuMemcpyHtoD")
            graph.launch(gpu.stream)
            got = gpu.get(d_y, np.float32, (rows, hidden))
            assert rel_err(got, _reference(config, block.reference, x)) < DECODE_TOL
    finally:
        graph.destroy()
        for ptr in (d_x, d_y):
            gpu.device.free(ptr)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_folded_launches_are_the_separate_ones_bit_for_bit(gpu, case, rows):
    """``fold_route``: the normalising router GEMM routes in its last block (``moe_router_route``);
    ``fold_combine``: the down GEMM's last block of each column tile adds the tile into the residual
    stream; the grouped GEMMs' ``hold`` builds (a +0.0 that waits for a round's loads); the routing's
    build for MAX_EXPERTS (more slots a lane than the model needs); the router GEMM loading its weights
    before the wait (``early_router``); the ``early`` grouped GEMMs (down reading the plan and its first
    weights before its wait), launched overlapped. The MoE added into the residual stream, the picks and the normalised rows
    are bit for bit those of the separate launches, and stay so launch after launch (the tickets reset
    themselves)."""
    from ninfer.backends.cuda import runtime as rt
    from ninfer.backends.cuda.moe import ROUTE_EXPERTS
    from ninfer.backends.reference.forward import rms_norm

    name, config, layer, block, moe = case
    rows_h = rows * config.hidden_size
    rng = np.random.default_rng(40 + rows)
    x = rng.standard_normal((rows, config.hidden_size), dtype=np.float32)
    weight = (1 + 0.1 * rng.standard_normal(config.hidden_size)).astype(np.float32)
    d_x, d_w, d_y, normed = gpu.put(x), gpu.put(weight), gpu.empty(rows_h * 4), gpu.empty(rows_h * 4)
    d_spare = gpu.empty(rows_h * 4)
    for tickets in (moe.route_ticket, moe.combine_tickets):  # as HybridBuffers.init leaves them
        rt.memset32(tickets, 0, tickets.nbytes // 4, gpu.stream)
    runs, fits = [], moe.route_experts
    try:
        held = ("moe_gate_up_t1w8u2p1s3h", "moe_down_t1w4u2p1s3h", moe.decode_gemms[2])  # numba_kernels/moe.py hold
        early = [("moe_gate_up_t1w8u2p1s3e", down, moe.decode_gemms[2])  # numba_kernels/moe.py EARLY_SHAPES
                 for down in ("moe_down_t1w4u2p1s3e", "moe_down_t1w4u4p1s3e")]
        plain, most = moe.decode_gemms, ROUTE_EXPERTS[-1]
        for setting in ((False, False, plain, fits), (True, False, plain, fits), (False, True, plain, fits),
                        (True, True, plain, fits), (True, True, plain, fits), (False, False, held, fits),
                        (True, True, held, fits), (False, False, plain, most), (True, False, plain, most),
                        (False, False, plain, -fits), (False, False, early[0], -fits), (True, False, early[1], fits)):
            moe.fold_route, moe.fold_combine, moe.decode_gemms, experts = setting
            moe.route_experts, moe.early_router = abs(experts), experts < 0  # negative: the early router too
            moe.gemv_rows = 0  # the tensor-core grouped GEMMs at every row count: the builds under test
            moe.router_gemv = None  # and the tensor-core router (the fp32 GEMV one sums in another order)
            rt.memset32(d_y, 0, rows_h, gpu.stream)
            args = (d_x, block.device, layer, rows, gpu.stream)
            if moe.k[moe.decode_gemms[1]].meta.get("early"):  # overlapped, as in a decode step, after a kernel
                moe.forward(d_spare, *args, residual=True, norm=(d_w, 1e-6, normed))
                with moe.k.overlapped():
                    moe.forward(d_y, *args, residual=True, norm=(d_w, 1e-6, normed))
            else:
                moe.forward(d_y, *args, residual=True, norm=(d_w, 1e-6, normed))
            runs.append([gpu.get(d_y, np.float32, (rows, config.hidden_size)),
                         gpu.get(normed, np.float32, (rows, config.hidden_size)),
                         gpu.get(moe.topk_ids, np.int32, (rows, config.num_experts_per_tok)),
                         gpu.get(moe.topk_w, np.float32, (rows, config.num_experts_per_tok))])
    finally:
        del moe.fold_route, moe.fold_combine, moe.decode_gemms, moe.early_router, moe.gemv_rows  # the defaults
        moe.route_experts = fits
        for ptr in (d_x, d_w, d_y, normed, d_spare):
            gpu.device.free(ptr)
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            np.testing.assert_array_equal(got, want)
    assert gpu.get(moe.route_ticket, np.int32, (1,))[0] == 0
    assert not gpu.get(moe.combine_tickets, np.int32, (moe.combine_tickets.nbytes // 4,)).any()
    h = rms_norm(x, weight, 1e-6)
    assert rel_err(runs[0][1], h) < 1e-6
    assert rel_err(runs[0][0], _reference(config, block.reference, h)) < DECODE_TOL


@pytest.mark.parametrize("rows", [1, 8])
def test_hold_builds_match_reference(gpu, case, rows):
    """Every ``hold`` build of the grouped decode GEMMs (numba_kernels/moe.py HOLD_SHAPES), as
    ``CudaMoe.decode_gemms`` with the default other half, the down ones with the combine folded in
    too (``fold_combine``: the tickets start at zero and every launch leaves them so)."""
    from ninfer.backends.cuda import runtime as rt
    from numba_kernels.moe import HOLD_SHAPES, grouped_name

    name, config, layer, block, moe = case
    x = np.random.default_rng(60 + rows).standard_normal((rows, config.hidden_size), dtype=np.float32)
    want = _reference(config, block.reference, x)
    gate_up, down, chunk = moe.decode_gemms
    held = [grouped_name(*shape, hold=True) for shape in HOLD_SHAPES if shape[0] != "down_combine"]
    rt.memset32(moe.combine_tickets, 0, moe.combine_tickets.nbytes // 4, gpu.stream)
    d_x, d_y = gpu.put(x), gpu.empty(x.nbytes)
    moe.gemv_rows = 0  # the tensor-core grouped GEMMs at every row count: the builds under test
    try:
        for kernel in held:
            moe.decode_gemms = (kernel, down, chunk) if "gate_up" in kernel else (gate_up, kernel, chunk)
            assert rel_err(_run(gpu, moe, config, layer, block, x), want) < DECODE_TOL, kernel
            if "down" in kernel:  # and its down_combine build, adding into a residual stream of zeros
                moe.fold_combine = True
                rt.memset32(d_y, 0, x.size, gpu.stream)
                moe.forward(d_y, d_x, block.device, layer, rows, gpu.stream, residual=True)
                moe.fold_combine = False
                assert rel_err(gpu.get(d_y, np.float32, x.shape), want) < DECODE_TOL, kernel
    finally:
        for option in ("decode_gemms", "fold_combine", "gemv_rows"):
            moe.__dict__.pop(option, None)  # the class's defaults again
        for ptr in (d_x, d_y):
            gpu.device.free(ptr)


def test_rejects_unsupported_shapes():
    import attrs

    from ninfer.backends.cuda.moe import check_supported

    with pytest.raises(ValueError, match="experts"):
        check_supported(attrs.evolve(A3B, num_experts=2048))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        check_supported(attrs.evolve(A3B, moe_intermediate_size=500))
