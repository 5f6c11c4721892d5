"""The CUDA hybrid decode step's launches, checked on the CPU against ptx/manifest.json.

``HybridForward`` runs over a fake device (addresses, no memory) and kernels that type-check and
record each launch instead of running it. At the tiny test shapes and at Qwen3.6-27B / 35B-A3B
shapes (4 layers each; the GPU tests only run tiny ones): every kernel a decode step launches is in
``kernel_names()`` (modules cannot load during graph capture), every fused decode GEMM stays inside
its buffers with K % 8 == 0, and a dense-MLP step has no norm, SiLU or plain GEMV launch left.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

hf = pytest.importorskip("ninfer.backends.cuda.hybrid_forward")

from ninfer.backends.cuda import moe  # noqa: E402
from ninfer.backends.cuda import runtime as rt  # noqa: E402
from ninfer.backends.cuda.hybrid_weights import device_layout  # noqa: E402
from ninfer.convert.random_model import HYBRID_PRESETS  # noqa: E402
from ninfer.models.hybrid import DENSE, FULL, LINEAR, MOE, HybridConfig  # noqa: E402
from fake_cuda import FakeDevice, FakeKernels, check_decode_gemm  # noqa: E402

LAYERS = (LINEAR, LINEAR, LINEAR, FULL)
REAL = dict(vocab_size=248320, num_layers=4, layer_types=LAYERS, rms_norm_eps=1e-6, head_dim=256, rotary_dim=64,
            rope_theta=1e7, max_position_embeddings=262144, linear_num_k_heads=16, linear_k_head_dim=128,
            linear_v_head_dim=128)
CONFIGS = {
    "tiny-qwen3.5": HYBRID_PRESETS["tiny-qwen3.5"],
    "tiny-qwen3-next": HYBRID_PRESETS["tiny-qwen3-next"],  # MoE and dense MLPs
    "27b": HybridConfig(architecture="Qwen3_5ForCausalLM", hidden_size=5120, mlp_types=(DENSE,) * 4, num_heads=24,
                        num_kv_heads=4, linear_num_v_heads=48, intermediate_size=17408, **REAL),
    "35b-a3b": HybridConfig(architecture="Qwen3_5MoeForCausalLM", hidden_size=2048, mlp_types=(MOE,) * 4,
                            num_heads=16, num_kv_heads=2, linear_num_v_heads=32, num_experts=256,
                            num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            **REAL),
}
MAX_BATCH = 8


def decode_launches(fwd, rows: int) -> list[str]:
    """The kernels a decode step of ``rows`` rows launches, in order; each one ``kernel_names()`` preloads."""
    fwd.k.log.clear()
    fwd.decode(rows, None)
    launched = [kernel.name for kernel, _, _ in fwd.k.log]
    assert set(launched) <= set(fwd.kernel_names())
    return launched


def forward(config, kv_dtype="bf16"):
    device = FakeDevice()
    buffers = hf.HybridBuffers(device, config, page_size=16, num_pages=8, max_batch=MAX_BATCH, max_context=128,
                               max_rows=64, kv_dtype=kv_dtype, state_slots=1)
    weights = {name: device.alloc(int(np.prod(shape)) * (2 if kind == "bf16" else 4), name)
               for name, (shape, kind) in device_layout(config).items()}
    return hf.HybridForward(FakeKernels(), config, weights, buffers, page_size=16, kv_dtype=kv_dtype)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_launches_are_preloaded_and_gemms_in_bounds(name):
    config = CONFIGS[name]
    hf.check_supported(config, "bf16")
    fwd = forward(config)
    preloaded = set(fwd.kernel_names())
    for rows in range(1, MAX_BATCH + 1):
        fwd.k.log.clear()
        fwd.decode(rows, None)
        launched = {kernel.name for kernel, _, _ in fwd.k.log}
        assert launched <= preloaded, sorted(launched - preloaded)
        for kernel, grid, args in fwd.k.log:
            if "epilogue" in kernel.meta:  # (y, x, w, norm, rows, n, k, ldy, eps)
                check_decode_gemm(kernel, grid, *args)
        if MOE not in config.mlp_types:
            assert not launched & {"rmsnorm", "add_rmsnorm", "silu_mul", f"gemv_m{rows}_c4"}
        else:  # the router normalises x and the combine adds into the residual stream: no norm launch
            combine = fwd.moe.combined_down if rows == 1 else "moe_combine_residual"  # one row: the down GEMV's
            assert combine in launched and not launched & {"rmsnorm", "add_rmsnorm", "moe_combine"}
            # one row: CudaMoe.router_gemv, else the tensor-core router asking L2 ahead (CudaMoe.next_prefetch)
            router = (fwd.moe.router_gemv or moe.NEXT_ROUTER_GEMM) if rows == 1 else moe.EARLY_ROUTER_GEMM
            assert router in launched and moe.ROUTER_DECODE_GEMM not in launched


def test_decode_overlaps_the_kernels_that_wait_for_their_predecessor():
    """Programmatic dependent launch: after count_tokens (never overlapped: it follows the input copy),
    every launch of a decode step overlaps its predecessor (all its kernels are built to wait)."""
    for config, rows in ((CONFIGS["27b"], 2), (CONFIGS["35b-a3b"], 8)):  # the hybrid overlaps at every batch
        fwd = forward(config)
        fwd.decode(rows, None)
        flags = fwd.k.overlaps
        assert fwd.k.log[0][0].name == "count_tokens" and not flags[0]
        assert all(flags[1:]), [kernel.name for (kernel, _, _), flag in zip(fwd.k.log, flags) if not flag]
    assert not fwd.k.overlap.on
    fwd.k.overlaps.clear()
    fwd.overlap = False
    fwd.decode(2, None)
    assert fwd.k.overlaps and not any(fwd.k.overlaps)


def test_unfused_decode_keeps_one_lane_a_row():
    """``fused_decode`` off (tools/bench_decode_step.py): the prefill kernels, the decode delta rule."""
    fwd = forward(HYBRID_PRESETS["tiny-qwen3.5"])
    fwd.fused_decode = False
    fwd.decode(3, None)
    launched = [kernel.name for kernel, _, _ in fwd.k.log]
    assert fwd.rule_name in launched and not set(fwd.prefill_rule_names) & set(launched)
    assert "add_rmsnorm" in launched and launched[-2:] == ["sample_partial", "sample"]


def test_kv_prefetch_only_while_a_layer_of_keys_fits_the_budget():
    """``decode_attention`` asks L2 for a step's keys only when one layer of them (every row) takes at
    most ``KV_PREFETCH_BYTES``: a 27B-shaped layer keeps 4 KV heads of 256 bf16, 4 KiB a key."""
    from ninfer.backends.cuda.forward import KV_PREFETCH_BYTES

    fwd = forward(CONFIGS["27b"])
    assert fwd.layer_kv_bytes_per_key == 2 * 4 * 256 * 2
    fits = KV_PREFETCH_BYTES // fwd.layer_kv_bytes_per_key
    fwd.kv_prefetch = True  # off by default (Forward.kv_prefetch)
    assert fwd.decode_prefetch(fits) and not fwd.decode_prefetch(fits + 1)
    fwd.kv_prefetch_bytes = 0
    assert not fwd.decode_prefetch(1)


def test_decode_routing_takes_every_decode_row():
    """Each build of ``moe_route`` / ``moe_router_route`` sizes its shared tables for ``max_rows`` rows
    (a warp a row) and its slots for ``max_experts``, as the MoE expects: it sends every step of up to
    GEMV_MAX_ROWS rows to the build with the fewest slots that hold the model's experts."""
    from ninfer.backends.cuda.forward import GEMV_MAX_ROWS

    manifest = json.loads((rt.PTX_DIR / "manifest.json").read_text())
    for kind in ("moe_route", "moe_router_route"):
        for experts in moe.ROUTE_EXPERTS:
            meta = manifest["kernels"][f"{kind}_e{experts}"]["meta"]
            assert meta["max_rows"] >= GEMV_MAX_ROWS and meta["max_experts"] == experts
    assert [moe.route_capacity(n) for n in (8, 128, 256, 257, 1024)] == [256, 256, 256, 1024, 1024]
    fwd = forward(CONFIGS["35b-a3b"])  # 256 experts
    assert "moe_route_e256" in decode_launches(fwd, 2) and "moe_route_e1024" not in decode_launches(fwd, 8)


def test_early_router_takes_the_router_gemm_launch():
    """``CudaMoe.early_router`` (the default): a decode MoE layer's normalising router GEMM is the build
    that loads its weights before the wait, on the plain build's grid and arguments."""
    config = CONFIGS["35b-a3b"]
    fwd = forward(config)
    fwd.moe.early_router, fwd.moe.next_prefetch, fwd.moe.router_gemv = False, 0, None  # the tensor-core router
    decode_launches(fwd, 1)
    plain = [(grid, args) for kernel, grid, args in fwd.k.log if kernel.name == moe.ROUTER_NORMED_DECODE_GEMM]
    fwd.moe.early_router = True
    launched = decode_launches(fwd, 1)
    early = [(grid, args) for kernel, grid, args in fwd.k.log if kernel.name == moe.EARLY_ROUTER_GEMM]
    assert moe.ROUTER_NORMED_DECODE_GEMM not in launched and len(early) == len(plain) == config.num_layers
    assert all(e[0] == p[0] and all(a is b or a == b for a, b in zip(e[1], p[1])) for e, p in zip(early, plain))


def test_next_prefetch_takes_the_router_launch():
    """``CudaMoe.next_prefetch`` (the default): a one-row step's early router is its ``n`` build, on the
    plain build's grid and arguments, given the next layer's first GEMM's weights (the LM head's after
    the last layer) and the bytes to ask L2 for, at most the matrix and under a megabyte a block
    (forward.L2_PREFETCH_MAX). A two-row step asks for nothing."""
    from ninfer.backends.cuda.forward import L2_PREFETCH_MAX

    config = CONFIGS["35b-a3b"]
    fwd = forward(config)
    fwd.moe.router_gemv = None  # the tensor-core router (CudaMoe.router_gemv's builds ask for the same: below)
    assert fwd.moe.next_prefetch
    launched = decode_launches(fwd, 1)
    fwd.moe.next_prefetch = 0
    plain = decode_launches(fwd, 1)
    assert launched == [moe.NEXT_ROUTER_GEMM if name == moe.EARLY_ROUTER_GEMM else name for name in plain]
    fwd.moe.next_prefetch = 64 << 20  # more than 16 blocks may ask for
    decode_launches(fwd, 1)
    routers = [(grid, args) for kernel, grid, args in fwd.k.log if kernel.name == moe.NEXT_ROUTER_GEMM]
    following = [fwd.first_weights(i + 1) for i in range(config.num_layers)]
    assert [args[10] for _, args in routers] == following and following[-1] is fwd.lm_head
    for (grid, args), then in zip(routers, following):
        assert args[11] == min(then.nbytes, grid[0] * L2_PREFETCH_MAX) // 16 * 16
        assert -(-args[11] // grid[0]) <= L2_PREFETCH_MAX
    assert moe.NEXT_ROUTER_GEMM not in decode_launches(fwd, 2)


def test_router_gemv_takes_the_one_row_router_launch():
    """``CudaMoe.router_gemv``: a one-row step's router is that fp32 GEMV build, a block per ``cols``
    experts, asking L2 for what the tensor-core ``n`` build would (the next layer's first weights); a
    two-row step keeps the tensor-core router."""
    config = CONFIGS["35b-a3b"]
    fwd = forward(config)
    fwd.moe.router_gemv = None
    decode_launches(fwd, 1)
    mma = [args for kernel, _, args in fwd.k.log if kernel.name == moe.NEXT_ROUTER_GEMM]
    for build in moe.ROUTER_GEMVS:
        fwd.moe.router_gemv = build
        launched = decode_launches(fwd, 1)
        routers = [(grid, args) for kernel, grid, args in fwd.k.log if kernel.name == build]
        assert moe.NEXT_ROUTER_GEMM not in launched and len(routers) == len(mma) == config.num_layers
        cols = fwd.k[build].meta["cols"]
        for (grid, args), plain in zip(routers, mma):
            assert grid == (config.num_experts // cols,) and args[:10] == plain[:10]
            assert args[10] is plain[10] and 0 < args[11] <= plain[11] and args[11] % 16 == 0
        assert build not in decode_launches(fwd, 2)


def test_router_prefetch_takes_the_one_row_o_gemvs():
    """``HybridForward.router_prefetch``: a one-row step's DeltaNet out and attention o GEMVs are their
    ``n`` builds, given the layer's router and the bytes to ask L2 for; off, or at two rows, they are not."""
    config = CONFIGS["35b-a3b"]
    fwd = forward(config)
    plain = decode_launches(fwd, 1)
    fwd.router_prefetch = 1 << 20
    launched = decode_launches(fwd, 1)
    assert launched == [name + "n" if name in ("gemv_residual_headnorm_m1p4", "gemv_residual_m1p4") else name
                        for name in plain]
    asked = [(args[-2], args[-1]) for kernel, _, args in fwd.k.log if kernel.name in hf.ROUTER_PREFETCH_GEMVS]
    routers = [fwd.w[f"layers.{i}.router"] for i in range(config.num_layers)]
    assert [then for then, _ in asked] == routers
    assert all(nbytes == min(1 << 20, then.nbytes) // 16 * 16 for then, nbytes in asked)
    assert not set(hf.ROUTER_PREFETCH_GEMVS) & set(decode_launches(fwd, 2))
    hf.HybridForward.router_prefetch = 1 << 20  # set on the class, as before graph capture
    try:
        assert decode_launches(forward(config), 1) == launched
    finally:
        hf.HybridForward.router_prefetch = 0


def test_folded_routing_replaces_the_route_launch():
    """With ``CudaMoe.fold_route`` a decode MoE layer routes inside its router GEMM: one
    ``moe_router_route_e256`` a layer (a block per 16 experts, the router's rows, the normalised rows
    written where the grouped GEMMs read them), no ``moe_route`` and no separate router GEMM."""
    config = CONFIGS["35b-a3b"]
    fwd = forward(config)
    fwd.moe.fold_route = True
    fwd.moe.routed_gate_up = None  # else a one-row step's gate/up routes
    for rows in (1, 5, 8):
        launched = decode_launches(fwd, rows)
        assert launched.count("moe_router_route_e256") == config.num_layers
        assert "moe_route_e256" not in launched and moe.ROUTER_NORMED_DECODE_GEMM not in launched
        for i, (kernel, grid, args) in enumerate(fwd.k.log):
            if kernel.name == "moe_router_route_e256":
                assert grid == (config.num_experts // 16,) and args[4] == rows and args[8] is fwd.b.h
                gate_up = fwd.k.log[i + 1]
                want = moe.GEMV_GEMMS[1][0] if rows <= fwd.moe.gemv_rows else moe.DECODE_GEMMS[0]
                assert gate_up[0].name == want and gate_up[2][1] is fwd.b.h


def test_folded_combine_replaces_the_combine_launch():
    """With ``CudaMoe.fold_combine`` a decode MoE layer's down GEMM adds into the residual stream: one
    DOWN_COMBINE_GEMM a layer over the down GEMM's grid, no ``moe_combine_residual``; a one-row step's
    down GEMV has no such form and keeps the combine launch (without ``combined_down``)."""
    config = CONFIGS["35b-a3b"]
    fwd = forward(config)
    fwd.moe.fold_combine = True
    fwd.moe.combined_down = None
    launched = decode_launches(fwd, 1)
    assert launched.count(moe.GEMV_GEMMS[1][1]) == launched.count("moe_combine_residual") == config.num_layers
    for rows in (2, 8):
        launched = decode_launches(fwd, rows)
        assert launched.count(moe.DOWN_COMBINE_GEMM) == config.num_layers
        assert "moe_combine_residual" not in launched and moe.DECODE_GEMMS[1] not in launched
        for kernel, grid, args in fwd.k.log:
            if kernel.name == moe.DOWN_COMBINE_GEMM:
                assert grid[0] * kernel.meta["cols"] == config.hidden_size  # a ticket per column tile
                assert args[14] is fwd.b.x and args[16] == rows and args[18] is fwd.moe.combine_tickets
                assert fwd.moe.combine_tickets.nbytes >= grid[0] * 4


def test_one_row_steps_run_the_expert_gemvs():
    """``CudaMoe.gemv_rows`` (1 by default): a one-row decode step's experts run as fp32 GEMVs over the
    grouped GEMMs' grid shape (a block per chunk and its columns: 8 routed chunks and the shared one),
    two rows and more the tensor-core grouped GEMMs; with ``gemv_rows`` 2 two rows take the ``m2`` GEMVs."""
    config = CONFIGS["35b-a3b"]
    fwd = forward(config)
    fwd.moe.routed_gate_up = fwd.moe.combined_down = None  # the one-row builds that route and combine: below
    gate_up, down = moe.GEMV_GEMMS[1]
    launched = decode_launches(fwd, 1)
    assert launched.count(gate_up) == launched.count(down) == config.num_layers
    assert moe.DECODE_GEMMS[0] not in launched and moe.DECODE_GEMMS[1] not in launched
    for kernel, grid, args in fwd.k.log:
        if kernel.name == gate_up:
            assert grid == (config.moe_intermediate_size // kernel.meta["cols"], config.num_experts_per_tok + 1)
        if kernel.name == down:
            assert grid == (config.hidden_size // kernel.meta["cols"], config.num_experts_per_tok + 1)
    assert gate_up not in decode_launches(fwd, 2) and moe.DECODE_GEMMS[0] in decode_launches(fwd, 2)
    fwd.moe.gemv_rows = 2
    assert decode_launches(fwd, 2).count(moe.GEMV_GEMMS[2][0]) == config.num_layers


def test_one_row_steps_route_in_gate_up_and_combine_in_down():
    """By default a one-row MoE layer is three launches: the router, the gate/up GEMV that routes the row
    itself (``routed_gate_up``: no ``moe_route``, a block per chunk and columns, the routing's inputs
    and outputs passed; its ``NEXT`` build, given each chunk's down weights and the share of them to ask
    L2 for, ``down_prefetch``) and the down GEMV that adds into the residual stream (``combined_down``:
    a block per column tile, no ``moe_combine_residual``); two rows route and combine apart again."""
    config = CONFIGS["35b-a3b"]
    fwd = forward(config)
    routed, combined = fwd.moe.routed_gate_up, fwd.moe.combined_down
    assert routed in moe.ROUTED_GATE_UPS and combined in moe.COMBINED_DOWNS and fwd.moe.down_prefetch
    routed += "n"
    launched = decode_launches(fwd, 1)
    assert launched.count(routed) == launched.count(combined) == config.num_layers
    assert not {"moe_route_e256", "moe_combine_residual", *moe.GEMV_GEMMS[1]} & set(launched)
    H, I, S = config.hidden_size, config.moe_intermediate_size, config.shared_expert_intermediate_size
    layers = iter(i for i, mlp in enumerate(config.mlp_types) if mlp == MOE)
    for kernel, grid, args in fwd.k.log:
        if kernel.name == routed:
            p = f"layers.{next(layers)}."
            # a block per chunk and ``cols`` columns (the i3 build: three tiles of two)
            assert grid == (-(-config.moe_intermediate_size // kernel.meta["cols"]), config.num_experts_per_tok + 1)
            assert args[14] is fwd.moe.row_pair and args[17] is fwd.moe.logits and args[19:22] == (
                config.num_experts, config.num_experts_per_tok, int(config.norm_topk_prob))
            assert args[22] is fwd.w[p + "experts.down"] and args[23] is fwd.w[p + "shared.down"]
            assert args[24:] == (int(H * I * 2 * fwd.moe.down_prefetch) // 16 * 16,
                                 int(H * S * 2 * fwd.moe.down_prefetch) // 16 * 16)
        if kernel.name == combined:
            assert grid == (config.hidden_size // kernel.meta["cols"],)
            assert args[14] is fwd.b.x and args[15] is fwd.moe.row_pair and args[16:18] == (1, 8)
    launched = decode_launches(fwd, 2)
    assert routed not in launched and combined not in launched
    assert {"moe_route_e256", "moe_combine_residual"} <= set(launched)


@pytest.mark.parametrize("name", ["27b", "35b-a3b"])
def test_split_rule_replaces_the_rule_launch(name):
    """``rule_splits = n``: a decode DeltaNet layer of up to SPLIT_RULE_ROWS rows runs
    ``deltanet_rule_s{n}`` over (value heads, rows, n) from ``mixed`` into ``core``, with the buffers'
    partial sums and tickets (one a lane and value head), instead of ``deltanet_rule``; every split of
    RULE_SPLITS is built for head dim 128; the MoE model splits in two by default, the dense one not;
    more rows and prefill never launch it (with ``rule_norm_in_gemv`` off: the test below)."""
    from ninfer.backends.cuda.hybrid_forward import MOE_RULE_SPLITS, RULE_SPLITS, SPLIT_RULE_ROWS

    config = CONFIGS[name]
    fwd = forward(config)
    fwd.rule_norm_in_gemv = False
    assert fwd.rule_splits == (MOE_RULE_SPLITS if MOE in config.mlp_types else 0)
    assert sorted(fwd.split_rule_names) == list(RULE_SPLITS)
    n_v = config.linear_num_v_heads
    assert fwd.b.rule_tickets.nbytes >= MAX_BATCH * n_v * 4
    assert fwd.b.rule_partials.nbytes >= MAX_BATCH * n_v * max(RULE_SPLITS) * 4
    for splits in RULE_SPLITS:
        fwd.rule_splits = splits
        split = fwd.split_rule_names[splits]
        assert fwd.rule_name in decode_launches(fwd, SPLIT_RULE_ROWS + 1) and split not in decode_launches(fwd, 8)
        for rows in (1, SPLIT_RULE_ROWS):
            launched = decode_launches(fwd, rows)
            assert launched.count(split) == config.layer_types.count(LINEAR) and fwd.rule_name not in launched
            for kernel, grid, args in fwd.k.log:
                if kernel.name == split:
                    assert grid == (n_v, rows, splits) and args[0] is fwd.b.mixed and args[2] is fwd.b.core
                    assert args[-2] is fwd.b.rule_partials and args[-1] is fwd.b.rule_tickets
        fwd.k.log.clear()
        fwd.layers(20, None)  # a prefill chunk
        assert split not in [kernel.name for kernel, _, _ in fwd.k.log]


@pytest.mark.parametrize("name", ["27b", "35b-a3b"])
def test_one_row_steps_scale_the_split_rule_in_the_out_gemv(name):
    """``rule_norm_in_gemv``: where the rule is split (the MoE model by default) and a step has one row,
    each DeltaNet layer launches ``deltanet_rule_s{n}u`` (no tickets) and, for its out projection,
    ``gemv_residual_headnorm_m1p4`` (as the preloaded o GEMV; ``m1`` without ``preload_o``) reading core,
    the rule's partial sums, the split count and the head dim; two rows, the option off, or the dense
    model (no split) launch the ticketed rule and the plain out GEMV."""
    from ninfer.backends.cuda.hybrid_forward import SPLIT_RULE_ROWS

    config = CONFIGS[name]
    fwd = forward(config)
    linear = config.layer_types.count(LINEAR)
    splits = fwd.rule_splits
    if not splits:  # the dense model keeps one block a head: nothing to scale
        assert not any("headnorm" in n or "u_k" in n for n in decode_launches(fwd, 1) + decode_launches(fwd, 2))
        return
    unscaled = fwd.unscaled_rule_names[splits]
    for preload, out in ((True, "gemv_residual_headnorm_m1p4"), (False, "gemv_residual_headnorm_m1")):
        fwd.preload_o = preload
        rows = 1
        launched = decode_launches(fwd, rows)
        assert launched.count(unscaled) == linear and launched.count(out) == linear
        assert fwd.split_rule_names[splits] not in launched
        for kernel, grid, args in fwd.k.log:
            if kernel.name == unscaled:
                assert grid == (config.linear_num_v_heads, rows, splits) and args[-1] is fwd.b.rule_partials
            if kernel.name == out:
                assert args[0] is fwd.b.x and args[1] is fwd.b.core
                assert any(args[2] is fwd.w[f"layers.{i}.out"] for i in range(config.num_layers)
                           if config.layer_types[i] == LINEAR)
                assert args[5:8] == (config.hidden_size, config.value_dim, config.hidden_size)
                assert args[9] is fwd.b.rule_partials and args[10:] == (splits, config.linear_v_head_dim)
    fwd.preload_o = True
    assert not any("headnorm" in n for n in decode_launches(fwd, 2)) and SPLIT_RULE_ROWS >= 2
    assert fwd.split_rule_names[splits] in decode_launches(fwd, 2)
    fwd.rule_norm_in_gemv = False
    launched = decode_launches(fwd, 1)
    assert unscaled not in launched and "gemv_residual_m1p4" in launched


@pytest.mark.parametrize("name", ["27b", "35b-a3b"])
def test_one_and_two_row_steps_convolve_in_the_in_proj_gemv(name):
    """``conv_in_gemv``: a decode DeltaNet layer of one or two rows launches ``gemv_normed_conv_m{rows}``
    for its in_proj (proj, x, its weights and norm, then mixed, the layer's conv tails, the StateImage
    slots each row reads and writes, conv_dim and the conv weights) and no ``deltanet_conv``; three rows
    (a tensor-core in_proj), ``fused_step`` or the option off keep the conv launch."""
    from ninfer.backends.cuda.hybrid_forward import CONV_GEMVS

    config = CONFIGS[name]
    fwd = forward(config)
    linear = config.layer_types.count(LINEAR)
    for rows in (1, 2):
        launched = decode_launches(fwd, rows)
        assert launched.count(CONV_GEMVS[rows]) == linear and "deltanet_conv" not in launched
        for kernel, grid, args in fwd.k.log:
            if kernel.name == CONV_GEMVS[rows]:
                assert args[0] is fwd.b.proj and args[1] is fwd.b.x and args[9] is fwd.b.mixed
                assert args[12] is fwd.b.inputs.d_state_in and args[13] is fwd.b.inputs.d_state_out
                assert args[14] == config.conv_dim and args[5] == config.in_proj_size
    assert decode_launches(fwd, 3).count("deltanet_conv") == linear
    for option, value in (("fused_step", True), ("conv_in_gemv", False)):
        setattr(fwd, option, value)
        launched = decode_launches(fwd, 1)
        assert CONV_GEMVS[1] not in launched and "gemv_normed_store_m1" in launched
        setattr(fwd, option, not value)


# HybridForward's decode fusions: option -> (its kernel's name attribute, the launches it replaces, the layers
# that launch it, its grid's first dimension, its tickets' region and their count a lane, (argument
# index, buffer) pairs it must be given).
FUSED_KERNELS = {
    "fused_step": ("step_name", ("deltanet_conv", "rule_name"), LINEAR, "linear_num_v_heads", "step_tickets",
                   "linear_num_k_heads", ((0, "proj"), (1, "core"), (-1, "step_tickets"))),
    "merged_attention": ("merged_attention_name", ("gated_combine", "gated_attention_name"), FULL, "num_heads",
                         "attention_tickets", "num_heads", ((-3, "attn"), (-2, "gate"), (-1, "attention_tickets"))),
}


@pytest.mark.parametrize("option", sorted(FUSED_KERNELS))
@pytest.mark.parametrize("name", ["27b", "35b-a3b"])
def test_fused_decode_kernels_replace_their_launches(name, option):
    """``fused_step``: a decode DeltaNet layer runs its conv and delta rule as one ``deltanet_step`` over
    the rule's grid (value heads x rows), from the projection into ``core``, a ticket per (lane, key
    head); ``merged_attention``: a decode attention layer runs ``gated_attention_merged`` over the
    attention's grid into ``attn`` with the gate, a ticket per (lane, query head), no
    ``gated_combine``. Prefill never launches them."""
    kernel_attr, replaced, kind, heads, tickets, per_lane, wiring = FUSED_KERNELS[option]
    config = CONFIGS[name]
    fwd = forward(config)
    setattr(fwd, option, True)
    fused = getattr(fwd, kernel_attr)
    replaced = [getattr(fwd, r, r) for r in replaced]  # attribute names, or kernel names as they are
    assert getattr(fwd.b, tickets).nbytes >= MAX_BATCH * getattr(config, per_lane) * 4
    for rows in (1, 8):
        launched = decode_launches(fwd, rows)
        assert launched.count(fused) == config.layer_types.count(kind)
        assert not set(replaced) & set(launched)
        for kernel, grid, args in fwd.k.log:
            if kernel.name == fused:
                assert grid[:2] == (getattr(config, heads), rows)
                assert all(args[at] is getattr(fwd.b, buffer) for at, buffer in wiring)
    fwd.k.log.clear()
    fwd.layers(20, None)  # a prefill chunk
    launched = [kernel.name for kernel, _, _ in fwd.k.log]
    assert fused not in launched


@pytest.mark.parametrize("name", ["27b", "35b-a3b"])
def test_decode_attention_ropes_inside_the_split_attention(name):
    """``roped_attention`` (on by default): a decode attention layer launches ``gated_attention_roped`` over
    (query heads, rows, splits) from ``qkv`` into the partials, writing the gates, with the layer's pool,
    norms and rotary tables, then ``gated_combine``; no ``gated_qk_rope`` or ``gated_attention``. With
    ``merged_attention``, the option off, a head dim without the build, or in prefill the q/k kernel runs."""
    config = CONFIGS[name]
    fwd = forward(config)
    roped = fwd.roped_attention_name
    assert fwd.roped_attention and roped == f"gated_attention_roped_d{config.head_dim}_bf16"
    full = config.layer_types.count(FULL)
    for rows in (1, 8):
        launched = decode_launches(fwd, rows)
        assert launched.count(roped) == launched.count("gated_combine") == full
        assert fwd.qk_name not in launched and fwd.gated_attention_name not in launched
        for kernel, grid, args in fwd.k.log:
            if kernel.name == roped:
                assert grid == (config.num_heads, rows, fwd.n_splits(rows, decode=True))
                assert args[0] is fwd.b.qkv and args[7] is fwd.b.part_o and args[15] is fwd.b.gate
                assert args[9:11] == (config.num_heads, config.num_kv_heads)
                assert args[18] is fwd.b.cos and args[-2:] == (config.rotary_dim // 2, config.rms_norm_eps)
    fwd.k.log.clear()
    fwd.layers(20, None)  # a prefill chunk
    assert roped not in [kernel.name for kernel, _, _ in fwd.k.log]
    for option, value in (("merged_attention", True), ("roped_attention", False)):
        setattr(fwd, option, value)
        launched = decode_launches(fwd, 1)
        assert roped not in launched and fwd.qk_name in launched
    import attrs

    other = forward(attrs.evolve(config, head_dim=128))  # no roped build at this head dim: the q/k kernel
    assert other.qk_name in decode_launches(other, 1)


def test_preload_o_takes_the_one_row_o_gemv():
    """``Forward.preload_o`` (on for a MoE hybrid, off for a dense one): a one-row step's o projections
    (the DeltaNet out and the attention o) run the GEMV that holds its first steps before its wait, on
    the plain one's grid and arguments; two rows keep theirs (the DeltaNet out's ``head_norm`` build with
    ``rule_norm_in_gemv``: the test above)."""
    from ninfer.backends.cuda.forward import PRELOADED_O_GEMV

    assert not forward(CONFIGS["27b"]).preload_o
    config = CONFIGS["35b-a3b"]
    fwd = forward(config)
    fwd.rule_norm_in_gemv = False
    assert fwd.preload_o
    held = decode_launches(fwd, 1)
    fwd.preload_o = False
    plain = decode_launches(fwd, 1)
    fwd.preload_o = True
    decode_launches(fwd, 1)
    assert held.count(PRELOADED_O_GEMV) == plain.count("gemv_residual_m1") == config.num_layers
    assert "gemv_residual_m1" not in held and len(held) == len(plain)
    for kernel, grid, args in fwd.k.log:
        if kernel.name == PRELOADED_O_GEMV:
            assert grid == (config.hidden_size // 4,) and args[0] is fwd.b.x and args[4] == 1
    assert PRELOADED_O_GEMV not in decode_launches(fwd, 2)


def test_dense_mlp_gemms_ask_l2_for_the_next_gemms_weights():
    """A batched step of a dense-MLP hybrid runs its o, gate/up and down GEMMs as the NEXT builds where
    ``gemm_prefetch`` asks (forward.GEMM_PREFETCH up to 6 rows): o with the layer's gate/up weights,
    gate/up with its down's, down with the next layer's in_proj or qkv, or the LM head's after the last
    layer. A MoE hybrid's o, a one-row step and an 8-row step ask for nothing."""
    config = CONFIGS["27b"]
    fwd = forward(config)
    w, L = fwd.w, config.num_layers
    first = [w[f"layers.{i}.{'in_proj' if config.layer_types[i] == LINEAR else 'qkv'}"] for i in range(1, L)]
    first.append(fwd.lm_head)
    want = [then for i in range(L) for then in (w[f"layers.{i}.gate_up"], w[f"layers.{i}.down"], first[i])]
    decode_launches(fwd, 4)
    asked = [(args[-2], args[-1]) for kernel, _, args in fwd.k.log if kernel.meta.get("next")]
    assert [then for then, _ in asked] == want
    assert all(0 < nbytes <= 8 << 20 for _, nbytes in asked)
    for rows in (1, 8):
        decode_launches(fwd, rows)
        assert not any(kernel.meta.get("next") for kernel, _, _ in fwd.k.log), rows
    moe_fwd = forward(CONFIGS["35b-a3b"])
    decode_launches(moe_fwd, 4)
    assert not any(kernel.meta.get("next") for kernel, _, _ in moe_fwd.k.log)


@pytest.mark.parametrize("name", ["27b", "35b-a3b"])
def test_gated_attention_splits_cap_the_blocks(name):
    """``HybridForward.decode_split``: MIN_SPLIT-key splits as the grid holds, at most ``decode_blocks``
    blocks (rows x query heads x splits) in all, so long batched steps take longer splits; steps of 512
    keys keep 32-key splits; every split length fits the grid; ``min_decode_split`` raises the floor."""
    from ninfer.backends.cuda.forward import MAX_DECODE_SPLITS, MIN_SPLIT

    config = CONFIGS[name]
    fwd = forward(config)
    assert fwd.decode_blocks == 4096
    for rows in (1, 4, 8):
        assert fwd.decode_split(513, rows) == 32
        for length in (1, 33, 513, 2049, 8193, 40000):
            split = fwd.decode_split(length, rows)
            splits = -(-length // split)
            assert split % MIN_SPLIT == 0 and splits <= MAX_DECODE_SPLITS
            assert rows * config.num_heads * splits <= max(fwd.decode_blocks, rows * config.num_heads)
    assert fwd.decode_split(8193, 8) > fwd.decode_split(8193, 1)
    fwd.decode_blocks = 0
    assert fwd.decode_split(8193, 8) == fwd.decode_split(8193, 1)
    fwd.min_decode_split = 128
    assert fwd.decode_split(513, 1) == 128
