"""Tensor-core kernels on the CPU, in Numba's CUDA simulator (tests/kernel_sim.py), as a script.

    NUMBA_ENABLE_CUDASIM=1 python tests/sim_kernels.py CASE [--rows R]

prints one JSON line of the case's figures (largest relative errors, bit-for-bit flags) for
tests/test_kernels_sim.py to judge. The cases are the decode kernels written without a GPU lent:

- ``gemv``: tensor-core decode GEMVs of ``numba_kernels/gemm.py`` (plain, normed, residual, SwiGLU)
  against NumPy;
- ``chain``: the chained norm (``Forward.chain_norm``): a residual GEMV that writes the next norm's
  input and partial sums, then the GEMVs that read them, against the normed kernels and NumPy;
- ``moe``: ``CudaMoe`` (ninfer/backends/cuda/moe.py) over the simulated device with the routing and
  the combine folded in or not, the ``hold`` grouped GEMMs, the routing's builds, the early router:
  bit for bit the separate launches, the tickets back at zero, and the reference MoE;
- ``decode``: a whole ``Forward.decode`` step (rope, KV append, tensor-core decode attention, the
  GEMVs, sampling) with ``chain_norm`` off and on, over the simulated device and runtime;
- ``split_attention``: the CUDA-core split attention of prefill rows and its combine against NumPy;
- ``decode_attention``: the dense decode attention over a bf16 pool in pages of 64 and of 4 keys
  against NumPy.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_sim  # noqa: E402

kernel_sim.install()

from numba import cuda  # noqa: E402  (a case's own kernels: the simulator swaps this global)

from ninfer.backends.reference.forward import rms_norm, silu  # noqa: E402

EPS = np.float32(1e-6)


def rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def bf16_matrix(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Random bf16 weights [n, k] scaled by k ** -0.5: (bits as uint16, their float32 values)."""
    from ninfer.artifact.bf16 import from_float32, to_float32

    bits = from_float32((rng.standard_normal((n, k)) * k ** -0.5).astype(np.float32))
    return bits, to_float32(bits)


def put_weights(gpu, rng, layout: dict) -> dict:
    """A model's random weights on the simulated device: bf16 matrices, fp32 vectors near 1 (norms)."""
    weights = {}
    for name, (shape, kind) in layout.items():
        if kind == "bf16":
            weights[name] = gpu.put(bf16_matrix(rng, int(np.prod(shape[:-1])), shape[-1])[0], name)
        else:
            weights[name] = gpu.put((1 + 0.1 * rng.standard_normal(shape)).astype(np.float32), name)
    return weights


def rms_normed(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The reference backend's RMSNorm, in float64 (the kernels' fp32 sums are compared against it)."""
    return rms_norm(x.astype(np.float64), weight, float(EPS))


def gemv(gpu, name: str, x: np.ndarray, bits: np.ndarray, norm: np.ndarray, y0: np.ndarray, n: int,
         extra=()) -> np.ndarray:
    """One decode GEMV launch as ``Forward.decode_gemm`` makes it; returns y."""
    kernel = gpu.kernels[name]
    rows, k = x.shape
    d_y = gpu.put(y0)
    grid = (-(-n // kernel.meta["cols"]),)
    gpu.launch(name, grid, (kernel.meta["threads"],),
               (d_y, gpu.put(x), gpu.put(bits), gpu.put(norm), rows, n, k, n, EPS, *extra))
    return gpu.get(d_y, np.float32, (rows, n))


def case_gemv(rows: int) -> dict:
    from numba_kernels.gemm import mma_kernel_name

    gpu = kernel_sim.SimGpu()
    rng = np.random.default_rng(rows)
    k, n = 128, 48  # three 16-row tiles (the last of a t4 block partial); four 32-k steps
    x = rng.standard_normal((rows, k)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    y0 = rng.standard_normal((rows, n)).astype(np.float32)
    bits, w = bf16_matrix(rng, n, k)
    gate_up_bits, gate_up = bf16_matrix(rng, 2 * n, k)
    result = {}
    for normed, epilogue, shape, hold in [(False, "store", (1, 8, 2, 3), False), (True, "store", (1, 8, 2, 3), False),
                                          (False, "residual", (1, 16, 4, 3), False),
                                          (True, "swiglu", (4, 4, 1, 3), False),
                                          (False, "store", (4, 4, 1, 3), False)]:
        name = mma_kernel_name(normed, epilogue, *shape, hold=hold)
        h = rms_normed(x, norm) if normed else x.astype(np.float64)
        if epilogue == "swiglu":
            got = gemv(gpu, name, x, gate_up_bits, norm, y0, n)
            want = silu(h @ gate_up[:n].T) * (h @ gate_up[n:].T)
        else:
            got = gemv(gpu, name, x, bits, norm, y0, n)
            want = h @ w.T + (y0 if epilogue == "residual" else 0)
        result[name] = rel(got, want)
    result["fragment_order"] = fragment_builds(gpu, rng, rows)
    if rows == 1:  # the fp32 GEMV holding 4 steps before its wait, over 4 steps a thread and a remainder
        from ninfer.backends.cuda.forward import PRELOADED_O_GEMV

        k, n = 8 * (4 * 128 + 1), 8
        x = rng.standard_normal((1, k)).astype(np.float32)
        bits, w = bf16_matrix(rng, n, k)
        plain = gemv(gpu, "gemv_residual_m1", x, bits, norm, y0[:, :n], n)
        held = gemv(gpu, PRELOADED_O_GEMV, x, bits, norm, y0[:, :n], n)
        result[PRELOADED_O_GEMV] = {"vs_numpy": rel(held, x @ w.T + y0[:, :n]),
                                    "identical": bool(np.array_equal(held, plain))}
    return result


def fragment_builds(gpu, rng, rows: int) -> dict:
    """Whether each FRAG build (numba_kernels/gemm.py FRAG_GEMMS), fed ``fragment_order``'s copy, gives
    its row-major build's y bit for bit: k of 3 32-k steps (a ring slot's second step past K), 3 tiles
    (the last of a t4 block partial)."""
    from numba_kernels.gemm import FRAG_GEMMS, fragment_order, mma_kernel_name

    k, n = 96, 48
    x = rng.standard_normal((rows, k)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    y0 = rng.standard_normal((rows, n)).astype(np.float32)
    identical = {}
    for normed, epilogue, (t, w, u, terms, ring), _ in FRAG_GEMMS:
        swiglu = epilogue == "swiglu"
        bits, _ = bf16_matrix(rng, 2 * n if swiglu else n, k)
        row_major = gemv(gpu, mma_kernel_name(normed, epilogue, t, w, u, terms, RING=ring), x, bits, norm, y0, n)
        name = mma_kernel_name(normed, epilogue, t, w, u, terms, RING=ring, FRAG=True)
        frag = gemv(gpu, name, x, fragment_order(bits, t, swiglu), norm, y0, n)
        identical[name] = bool(np.array_equal(frag, row_major))
    return identical


def case_conv_gemv(rows: int) -> dict:
    """``gemv_normed_conv_m{rows}`` (a DeltaNet in_proj with the conv in its epilogue) against
    ``gemv_normed_store_m{rows}`` then ``deltanet_conv``, both writing the tails out of place (lanes
    out of order, slot 0 unused): the stored columns past the conv's channels, the conv's output and
    the new tails bit for bit, the slots read left as they were."""
    gpu = kernel_sim.SimGpu()
    rng = np.random.default_rng(70 + rows)
    k, channels, n = 64, 40, 52  # the conv's channels, then 12 stored columns; a block's 4 columns straddle them
    slot = 3 * channels + 5
    x = rng.standard_normal((rows, k)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    bits, _ = bf16_matrix(rng, n, k)
    states0 = rng.standard_normal((2 * rows + 1) * slot).astype(np.float32)
    conv_w = gpu.put((rng.standard_normal(channels * 4) * 0.5).astype(np.float32))
    lanes = gpu.put((rows - np.arange(rows)).astype(np.int32))
    lanes_out = gpu.put((rows + 1 + np.arange(rows)).astype(np.int32))
    runs = []
    for fused in (False, True):
        states, mixed = gpu.put(states0), gpu.empty(rows * channels * 4)
        conv = (mixed, states, slot, lanes, lanes_out, channels, conv_w)
        if fused:
            proj = gemv(gpu, f"gemv_normed_conv_m{rows}", x, bits, norm, np.zeros((rows, n), np.float32), n,
                        extra=conv)
        else:
            proj = gemv(gpu, f"gemv_normed_store_m{rows}", x, bits, norm, np.zeros((rows, n), np.float32), n)
            gpu.launch("deltanet_conv", (-(-channels // 128), rows), (128,),
                       (mixed, gpu.put(proj), n, states, slot, lanes, lanes_out, 1, channels, conv_w))
        runs.append((proj, gpu.get(mixed, np.float32, (rows, channels)),
                     gpu.get(states, np.float32, ((2 * rows + 1) * slot,))))
    (proj_a, mixed_a, states_a), (proj_b, mixed_b, states_b) = runs
    return {"stored_equal": bool(np.array_equal(proj_a[:, channels:], proj_b[:, channels:])),
            "conv_equal": bool(np.array_equal(mixed_a, mixed_b)),
            "states_equal": bool(np.array_equal(states_a, states_b)),
            "tails_written": bool((states_b != states0).any()),
            "read_slots_kept": bool(np.array_equal(states_b[:(rows + 1) * slot], states0[:(rows + 1) * slot])),
            "finite": bool(np.isfinite(mixed_b).all())}


def case_rule_norm_gemv(rows: int) -> dict:
    """``deltanet_rule_s2u`` then ``gemv_residual_headnorm_m1`` (the out GEMV scaling each head by its
    gated RMSNorm: ``HybridForward.rule_norm_in_gemv``) against ``deltanet_rule_s2`` (its last block
    scales) then ``gemv_residual_m1``, and the same with their ``p4`` builds and the ``p4n`` builds that
    ask L2 for the next weights (``HybridForward.router_prefetch``): the residual stream and the states bit
    for bit, lanes out of order and written out of place, the tickets back at zero, each ``n`` build
    asking for exactly the bytes it is given."""
    gpu = kernel_sim.SimGpu()
    rng = np.random.default_rng(80 + rows)
    n_k, n_v, d, hidden = 2, 4, 32, 48
    key_dim, value_dim = n_k * d, n_v * d
    conv_dim = 2 * key_dim + value_dim
    in_stride = conv_dim + value_dim + 2 * n_v
    slot = n_v * d * d + 3
    states0 = (rng.standard_normal((2 * rows + 1) * slot) * 0.5).astype(np.float32)
    lanes = gpu.put((rows - np.arange(rows)).astype(np.int32))
    lanes_out = gpu.put((rows + 1 + np.arange(rows)).astype(np.int32))
    mixed = gpu.put(rng.standard_normal((rows, conv_dim)).astype(np.float32))
    proj = gpu.put(rng.standard_normal((rows, in_stride)).astype(np.float32))
    dt_bias, a_log = (gpu.put(rng.standard_normal(n_v).astype(np.float32)) for _ in range(2))
    norm_w = gpu.put((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    bits, _ = bf16_matrix(rng, hidden, value_dim)
    y0 = rng.standard_normal((rows, hidden)).astype(np.float32)
    tickets = gpu.put(np.zeros(rows * n_v, np.int32))
    builds = ["", "p4", "p4n"]
    then = gpu.empty(1 << 10, poison=0)  # the next weights the n builds ask L2 for
    result, ys = {}, {}
    for build in builds:
        ask = (then, then.nbytes) if build.endswith("n") else ()
        before = gpu.device.prefetched
        runs = []
        for unscaled in (False, True):
            states, out, partials = gpu.put(states0), gpu.empty(rows * value_dim * 4), gpu.empty(rows * n_v * 2 * 4)
            args = (mixed, proj, out, states, slot, lanes, lanes_out, n_k, n_v, in_stride, dt_bias, a_log, norm_w,
                    EPS, partials)
            rule = f"deltanet_rule_s2{'u' if unscaled else ''}_k{d}_v{d}"
            gpu.launch(rule, (n_v, rows, 2), (d,), args if unscaled else args + (tickets,))
            core = gpu.get(out, np.float32, (rows, value_dim))
            if unscaled:
                y = gemv(gpu, f"gemv_residual_headnorm_m{rows}{build}", core, bits, np.zeros(1, np.float32), y0, hidden,
                         extra=(partials, 2, d, *ask))
            else:
                y = gemv(gpu, f"gemv_residual_m{rows}{build}", core, bits, np.zeros(1, np.float32), y0, hidden,
                         extra=ask)
            runs.append((y, gpu.get(states, np.float32, ((2 * rows + 1) * slot,))))
        (y_a, states_a), (y_b, states_b) = runs
        ys[build] = y_b
        result[f"m{rows}{build}"] = {"as_without_n": bool(np.array_equal(y_b, ys[build.rstrip("n")])),
                                     "residual_equal": bool(np.array_equal(y_a, y_b)),
                                     "states_equal": bool(np.array_equal(states_a, states_b)),
                                     "residual_moved": bool((y_b != y0).all()), "finite": bool(np.isfinite(y_b).all()),
                                     "tickets_zero": bool(not gpu.get(tickets, np.int32, (rows * n_v,)).any()),
                                     "asked": gpu.device.prefetched - before == (2 * then.nbytes if ask else 0)}
    return result


def case_chain(rows: int) -> dict:
    """o (a residual GEMV writing the next norm's input and partial sums) then q/k/v, gate/up and the
    LM head as chained consumers; each against the normed kernel it replaces and NumPy."""
    from numba_kernels.gemm import mma_kernel_name

    gpu = kernel_sim.SimGpu()
    rng = np.random.default_rng(10 + rows)
    hidden, width, n = 128, 64, 48
    attn = rng.standard_normal((rows, width)).astype(np.float32)  # the o GEMV's input
    resid = rng.standard_normal((rows, hidden)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    o_bits, o_w = bf16_matrix(rng, hidden, width)
    producer = mma_kernel_name(False, "residual", 1, 16, 4, 3, chain="out")
    kernel = gpu.kernels[producer]
    parts = -(-hidden // kernel.meta["cols"])
    d_y, d_xn, d_part = gpu.put(resid), gpu.empty(rows * hidden * 4), gpu.empty(parts * 8 * 4)
    gpu.launch(producer, (parts,), (kernel.meta["threads"],),
               (d_y, gpu.put(attn), gpu.put(o_bits), gpu.put(norm), rows, hidden, width, hidden, EPS, d_xn, d_part))
    y = gpu.get(d_y, np.float32, (rows, hidden))
    y_want = resid + attn.astype(np.float64) @ o_w.T
    xn = gpu.get(d_xn, np.float32, (rows, hidden))
    squares = gpu.get(d_part, np.float32, (parts, 8))[:, :rows].sum(axis=0)
    result = {"residual": rel(y, y_want), "xn": rel(xn, y * norm),
              "squares": rel(squares, (y.astype(np.float64) ** 2).sum(axis=1))}
    h = rms_normed(y, norm)
    zeros = np.zeros((rows, n), np.float32)
    for epilogue, shape, hold, normed_name in [
            ("store", (1, 8, 2, 3), False, "mma_gemv_normed_store_t1w8u2s3"),
            ("swiglu", (4, 4, 1, 3), True, "mma_gemv_normed_swiglu_t4w4u1s3"),
            ("store", (4, 4, 1, 3), True, "mma_gemv_normed_store_t4w8u1s3")]:
        name = mma_kernel_name(False, epilogue, *shape, chain="in", hold=hold)
        swiglu = epilogue == "swiglu"
        bits, w = bf16_matrix(rng, 2 * n if swiglu else n, hidden)
        got = gemv(gpu, name, xn, bits, norm, zeros, n, extra=(d_part, parts))
        fused = gemv(gpu, normed_name, y, bits, norm, zeros, n)
        want = silu(h @ w[:n].T) * (h @ w[n:].T) if swiglu else h @ w.T
        result[name] = rel(got, want)
        result[f"{name} vs normed"] = rel(got, fused)
    return result


def moe_layer(rows: int) -> SimpleNamespace:
    """One tiny MoE layer on the simulated GPU (random bf16 weights, a ``CudaMoe`` of 8 rows, its
    tickets zeroed) and ``rows`` rows of input, norm weights and residual stream, with ``run()``: the
    decode ``forward`` into the residual stream, normalising its input; returns (y, normed, picks, pick
    weights) and keeps each run's launches."""
    from ninfer.artifact.bf16 import to_float32
    from ninfer.backends.cuda.moe import CudaMoe
    from ninfer.backends.reference.hybrid_weights import DenseMlpWeights, MoeWeights
    from ninfer.convert.random_model import HYBRID_PRESETS
    from ninfer.models.hybrid import MOE, tensor_names

    config = HYBRID_PRESETS["tiny-qwen3-next"]
    layer = config.mlp_types.index(MOE)
    gpu = kernel_sim.SimGpu()
    rng = np.random.default_rng(20 + rows)
    prefix = f"layers.{layer}."
    shapes = tensor_names(config)
    roles = ("router", "experts.gate_up", "experts.down", "shared.gate_up", "shared.down", "shared_gate")
    bits = {}
    for role in roles:
        shape = shapes[prefix + role]
        bits[role] = bf16_matrix(rng, int(np.prod(shape[:-1])), shape[-1])[0].reshape(shape)
    weights = {prefix + role: gpu.put(b, role) for role, b in bits.items()}
    f = {role: to_float32(b) for role, b in bits.items()}
    reference = MoeWeights(router=f["router"].T.copy(), gate_up=[e.T for e in f["experts.gate_up"]],
                           down=[e.T for e in f["experts.down"]],
                           shared=DenseMlpWeights(gate_up=f["shared.gate_up"].T.copy(),
                                                  down=f["shared.down"].T.copy()),
                           shared_gate=f["shared_gate"].T.copy())
    H, K = config.hidden_size, config.num_experts_per_tok
    moe = CudaMoe(gpu.kernels, config, gpu.empty(CudaMoe.scratch_bytes(config, 8)), 8)
    for tickets in (moe.route_ticket, moe.combine_tickets):  # as HybridBuffers.init leaves them
        gpu.memset32(tickets, 0)
    x = rng.standard_normal((rows, H)).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    resid = rng.standard_normal((rows, H)).astype(np.float32)
    d_x, d_w, d_y, d_normed = gpu.put(x), gpu.put(norm_w), gpu.empty(rows * H * 4), gpu.empty(rows * H * 4)
    launches = []

    def run(then=None) -> list:
        gpu.device.bytes(d_y)[:] = resid.view(np.uint8).ravel()
        first = len(gpu.kernels.launches)
        moe.forward(d_y, d_x, weights, layer, rows, gpu.stream, residual=True, norm=(d_w, float(EPS), d_normed),
                    then=then)
        launches.append(gpu.kernels.launches[first:])
        return [gpu.get(d_y, np.float32, (rows, H)), gpu.get(d_normed, np.float32, (rows, H)),
                gpu.get(moe.topk_ids, np.int32, (rows, K)), gpu.get(moe.topk_w, np.float32, (rows, K))]

    def reference_moe() -> np.ndarray:
        """The reference backend's MoE of the normalised rows: what ``run()`` adds to the residual stream."""
        from ninfer.backends.reference.hybrid import HybridForward

        model = HybridForward.__new__(HybridForward)  # _moe reads only the config
        model.config = config
        return model._moe(reference, rms_normed(x, norm_w).astype(np.float32))

    return SimpleNamespace(gpu=gpu, moe=moe, x=x, norm_w=norm_w, resid=resid, run=run, launches=launches,
                           reference_moe=reference_moe)


def case_moe(rows: int) -> dict:
    """``CudaMoe.forward`` (decode, into the residual stream, normalising its input) with every setting
    of ``fold_route`` / ``fold_combine``, the ``hold`` grouped GEMMs, the routing's build for
    MAX_EXPERTS, the router GEMM loading its weights before the wait (``early_router``) and the ``early``
    grouped GEMMs (down reading the plan and its first weights before its wait), over one tiny MoE layer."""
    from ninfer.backends.cuda.moe import EARLY_ROUTER_GEMM, ROUTE_EXPERTS

    t = moe_layer(rows)
    moe, launches = t.moe, t.launches
    plain = moe.decode_gemms
    held = ("moe_gate_up_t1w8u2p1s3h", "moe_down_t1w4u2p1s3h", plain[2])  # numba_kernels/moe.py HOLD_SHAPES
    wide = ("moe_gate_up_t1w16u4p1s3h", "moe_down_t1w8u2p1s3h", plain[2])  # the ablation's other pair
    early_gemms = ("moe_gate_up_t1w8u2p1s3e", "moe_down_t1w4u4p1s3e", plain[2])  # numba_kernels/moe.py EARLY_SHAPES
    runs = []
    fits, most = moe.route_experts, ROUTE_EXPERTS[-1]  # the routing's build for the model, the largest
    for setting in ((False, False, plain, 0, fits), (True, False, plain, 0, fits), (False, True, plain, 0, fits),
                    (True, True, plain, 0, fits), (True, True, plain, 0, fits), (False, False, held, 0, fits),
                    (True, True, held, 0, fits), (True, True, wide, 0, fits), (False, False, plain, 0, most),
                    (True, False, plain, 0, most), (False, False, plain, 1, fits), (False, False, early_gemms, 1, fits)):
        moe.fold_route, moe.fold_combine, moe.decode_gemms, early, moe.route_experts = setting
        moe.early_router = bool(early)
        runs.append(t.run())
    refusals = []  # an early down after a gate/up that triggers its dependents before the routing is done
    moe.decode_gemms = (plain[0], early_gemms[1], plain[2])
    try:
        t.run()
    except ValueError as error:
        refusals.append(str(error))
    return {
        "launches": [len(run) for run in launches[:len(runs)]],
        "held_launched": held[0] in launches[6] and wide[0] in launches[7] and early_gemms[1] in launches[11],
        "builds_launched": [f"moe_route_e{fits}" in launches[0], f"moe_router_route_e{most}" in launches[9],
                            EARLY_ROUTER_GEMM in launches[10]],
        "identical": [all(np.array_equal(a, b) for a, b in zip(run, runs[0])) for run in runs],
        "refusals": refusals,
        "tickets_zero": bool(not t.gpu.get(moe.route_ticket, np.int32, (1,)).any()
                             and not t.gpu.get(moe.combine_tickets, np.int32, (moe.combine_tickets.nbytes // 4,)).any()),
        "normed": rel(runs[0][1], rms_normed(t.x, t.norm_w)),
        "moe": rel(runs[0][0] - t.resid, t.reference_moe()),
    }


def case_moe_gemv(rows: int) -> dict:
    """``CudaMoe.gemv_rows``: a decode step of ``rows`` (1 or 2) rows with the expert GEMMs as fp32 GEMVs
    (every shape of numba_kernels/moe.py GEMV_SHAPES for the row count) against the tensor-core grouped
    GEMMs: the same picks and normalised rows, the MoE to fp32 rounding, and both against the reference."""
    from ninfer.backends.cuda.moe import COMBINED_DOWNS, GEMV_GEMMS, NEXT_ROUTED_GATE_UPS, ROUTED_GATE_UPS
    from numba_kernels.moe import GEMV_SHAPES, gemv_name

    t = moe_layer(rows)
    moe = t.moe
    moe.gemv_rows = 0
    moe.routed_gate_up = moe.combined_down = None  # the one-row builds that route or combine: last
    mma = t.run()
    gate_ups = [gemv_name(*s) for s in GEMV_SHAPES if s[0] == "gate_up" and s[1] == rows]
    downs = [gemv_name(*s) for s in GEMV_SHAPES if s[0] == "down" and s[1] == rows]
    moe.gemv_rows = rows
    want = t.reference_moe()
    result = {"mma": rel(mma[0] - t.resid, want)}
    for gate_up, down in zip(gate_ups, downs):  # every shape once
        moe.gemv_gemms = {rows: (gate_up, down)}
        got = t.run()
        assert gate_up in t.launches[-1] and down in t.launches[-1]
        result[f"{gate_up},{down}"] = {"vs_mma": rel(got[0] - t.resid, mma[0] - t.resid),
                                       "vs_reference": rel(got[0] - t.resid, want),
                                       "routing_identical": all(np.array_equal(a, b) for a, b in zip(got[1:], mma[1:]))}
    if rows == 1:  # the gate/up GEMVs that route the row themselves: the same plan as moe_route's
        moe.gemv_gemms = GEMV_GEMMS
        plain = t.run()
        plan = plan_of(t.gpu, moe)
        # each build, and those asking L2 for the chunks' down weights at their tail (CudaMoe.down_prefetch)
        outputs = {}
        for routed, down_prefetch in ([(name, 0.0) for name in ROUTED_GATE_UPS]
                                      + [(name, 1.0) for name in NEXT_ROUTED_GATE_UPS]):
            moe.routed_gate_up, moe.down_prefetch = routed, down_prefetch
            routed += "n" if down_prefetch else ""
            for region in (moe.chunks, moe.n_chunks, moe.pair_row, moe.pair_weight, moe.row_pair, moe.topk_ids,
                           moe.topk_w):  # moe_route's outputs gone: this run must write them all
                t.gpu.memset32(region, 0x7FC00007)
            got = t.run()
            assert routed in t.launches[-1] and not any(n.startswith("moe_route") for n in t.launches[-1])
            shared = moe.c.num_experts_per_tok  # the shared pair's weight: another sum order
            mine = plan_of(t.gpu, moe)
            outputs[routed] = (got, mine)
            result[routed] = {"vs_plain": rel(got[0] - t.resid, plain[0] - t.resid),
                              "vs_reference": rel(got[0] - t.resid, want),
                              "routing_identical": all(np.array_equal(a, b) for a, b in zip(got[1:], plain[1:])),
                              "plan_identical": all(np.array_equal(mine[name], plan[name]) for name in plan
                                                    if name != "pair_weight"),
                              "routed_weights_identical": np.array_equal(mine["pair_weight"][:shared],
                                                                         plan["pair_weight"][:shared]),
                              "shared_weight": rel(mine["pair_weight"][shared:], plan["pair_weight"][shared:])}
        result["reordered"] = {}  # the f, i and l builds against theirs without: the same sums, other blocks
        for name in outputs:
            plain_name = re.sub(r"r256(i\d+)?f?l?", "r256", name)
            if plain_name != name:
                (got, mine), (base, base_plan) = outputs[name], outputs[plain_name]
                result["reordered"][name] = (all(np.array_equal(a, b) for a, b in zip(got, base))
                                             and all(np.array_equal(mine[key], base_plan[key]) for key in plan))
        moe.routed_gate_up, moe.down_prefetch = None, 0.0
        for combined in COMBINED_DOWNS:  # the down GEMV adding into the residual stream itself: bit for bit
            moe.combined_down = combined
            for routed in (None, ROUTED_GATE_UPS[0]):
                moe.routed_gate_up = routed
                got = t.run()
                assert combined in t.launches[-1] and "moe_combine_residual" not in t.launches[-1]
                result[f"{combined},{routed}"] = {
                    "launches": len(t.launches[-1]),
                    "identical": bool(np.array_equal(got[0], plain[0])) if routed is None
                    else rel(got[0] - t.resid, plain[0] - t.resid)}
        result["next_prefetch"] = next_prefetch(t, ROUTED_GATE_UPS[0], COMBINED_DOWNS[0])
        result["router_gemv"] = router_gemv(t, ROUTED_GATE_UPS[0], COMBINED_DOWNS[0])
        moe.combined_down = moe.routed_gate_up = None
    return result


def next_prefetch(t, routed: str, combined: str) -> dict:
    """A one-row step (the routing gate/up, the combining down; no down prefetch, so the router's is the
    only request) with the router asking L2 for the first bytes of the next layer's weights
    (``CudaMoe.next_prefetch``) against one without: the same bytes out, the router's build launched,
    and what the simulated device was asked to prefetch."""
    from ninfer.backends.cuda.moe import NEXT_ROUTER_GEMM

    moe = t.moe
    moe.routed_gate_up, moe.combined_down, moe.down_prefetch = routed, combined, 0.0
    default_router, moe.router_gemv = moe.router_gemv, None  # the tensor-core router's n build
    then = t.gpu.empty(3 << 10, poison=0)  # the next layer's first weights: 3 KiB, less than asked for
    moe.next_prefetch = 0
    plain = t.run(then)
    before = t.gpu.device.prefetched
    moe.next_prefetch = 1 << 20
    got = t.run(then)
    moe.router_gemv = default_router
    return {"identical": all(np.array_equal(a, b) for a, b in zip(got, plain)),
            "launched": sorted(set(t.launches[-1]) - set(t.launches[-2])),
            "plain_launched": sorted(set(t.launches[-2]) - set(t.launches[-1])),
            "router": NEXT_ROUTER_GEMM, "next_bytes_asked": t.gpu.device.prefetched - before,
            "then_bytes": then.nbytes}


def router_gemv(t, routed: str, combined: str) -> dict:
    """``CudaMoe.router_gemv``: a one-row step (the routing gate/up, the combining down, the router asking
    L2 for the next layer's first weights) with each fp32 GEMV router build against the tensor-core
    router: the build launched, the same picks, the pick weights, the normalised row and the MoE to fp32
    rounding, and the same bytes asked of L2."""
    from ninfer.backends.cuda.moe import ROUTER_GEMVS

    moe = t.moe
    moe.routed_gate_up, moe.combined_down, moe.down_prefetch = routed, combined, 0.0
    then = t.gpu.empty(3 << 10, poison=0)
    default_router = moe.router_gemv
    moe.next_prefetch, moe.router_gemv = 1 << 20, None
    plain = t.run(then)
    want = t.reference_moe()
    result = {}
    for name in ROUTER_GEMVS:
        moe.router_gemv = name
        before = t.gpu.device.prefetched
        got = t.run(then)
        result[name] = {"launched": name in t.launches[-1], "picks_identical": bool(np.array_equal(got[2], plain[2])),
                        "pick_weights": rel(got[3], plain[3]), "normed": rel(got[1], plain[1]),
                        "vs_plain": rel(got[0] - t.resid, plain[0] - t.resid),
                        "vs_reference": rel(got[0] - t.resid, want),
                        "next_bytes_asked": t.gpu.device.prefetched - before, "then_bytes": then.nbytes}
    moe.router_gemv = default_router
    return result


def plan_of(gpu, moe) -> dict:
    """A one-row step's plan as the routing left it: chunks, their count, the pairs, row_pair."""
    k = moe.c.num_experts_per_tok
    return {"chunks": gpu.get(moe.chunks, np.int32, (3 * (k + 1),)), "n_chunks": gpu.get(moe.n_chunks, np.int32, (1,)),
            "pair_row": gpu.get(moe.pair_row, np.int32, (k + 1,)),
            "pair_weight": gpu.get(moe.pair_weight, np.float32, (k + 1,)),
            "row_pair": gpu.get(moe.row_pair, np.int32, (k,))}


def case_decode(rows: int) -> dict:
    """A whole decode step of ``Forward`` (a small Qwen3-style model, bf16 KV pool with keys already in
    it) with ``chain_norm`` off and on: the same tokens, hidden states and logits to fp32 rounding."""
    from ninfer.backends.cuda import forward as fw
    from ninfer.backends.cuda.weights import device_layout
    from ninfer.models import DenseConfig

    config = DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, max_position_embeddings=1024, qk_norm=True)
    gpu = kernel_sim.SimGpu()
    kernel_sim.patch_runtime(gpu.device)
    rng = np.random.default_rng(30 + rows)
    weights = put_weights(gpu, rng, device_layout(config))
    page_size, max_context = 16, 64
    buffers = fw.StepBuffers(gpu.device, config, page_size=page_size, num_pages=rows * 4 + 1, max_batch=8,
                             max_context=max_context, max_rows=8, kv_dtype="bf16")
    buffers.init(None)
    forward = fw.Forward(gpu.kernels, config, weights, buffers, page_size=page_size, kv_dtype="bf16")
    kv = gpu.device.bytes(buffers.kv)
    random_bits(rng, kv)
    kv_before = kv.copy()
    depth = decode_inputs(rng, forward, buffers.inputs, rows, config.vocab_size, max_context, 4)
    runs = []
    for chain in (False, True):
        kv[:] = kv_before
        forward.chain_norm = chain
        first = len(gpu.kernels.launches)
        forward.decode(rows, None, depth)
        runs.append({"x": gpu.get(buffers.x, np.float32, (rows, config.hidden_size)),
                     "logits": gpu.get(buffers.logits, np.float32, (rows, config.vocab_size)),
                     "tokens": gpu.get(buffers.out, np.int32, (rows,)),
                     "kv": kv.copy(), "chained": sum("normin" in n or "normout" in n
                                                     for n in gpu.kernels.launches[first:])})
    # q/k/v, o, gate/up and down from the fragment-order copies CudaRunner makes (``fragment_order_bf16``),
    # checked against numba_kernels.gemm.fragment_order; the FRAG builds load the same fragments.
    from numba_kernels.gemm import fragment_order
    from ninfer.backends.cuda.runner import CudaRunner

    free = gpu.device.memory.size - gpu.device.used
    device = SimpleNamespace(alloc=gpu.device.alloc, free_memory=lambda: free)
    owner = SimpleNamespace(config=config, kernels=gpu.kernels, device=device, stream=None)
    fragments = CudaRunner._fragment_copies(owner, weights, 8)
    reordered = CudaRunner._fragment_copies(owner, weights, 2) == {}  # no tensor-core decode GEMMs at 1-2 rows
    reordered &= CudaRunner._fragment_copies(owner, weights, 8, keep_free=free) == {}  # no room left: none
    assert sorted(fragments) == sorted(f"layers.{i}.{m}" for i in range(config.num_layers) for m in fw.FRAGMENT_ORDER)
    for name, copy in fragments.items():
        shape = device_layout(config)[name][0]
        want = fragment_order(gpu.get(weights[name], np.uint16, shape), fw.fragment_tiles(name.rsplit(".", 1)[1]),
                              name.endswith("gate_up"))
        reordered &= copy.nbytes == want.nbytes and bool(np.array_equal(gpu.get(copy, np.uint16, want.shape), want))
    ordered = fw.Forward(gpu.kernels, config, weights, buffers, page_size=page_size, kv_dtype="bf16",
                         fragments=fragments)
    kv[:] = kv_before
    first = len(gpu.kernels.launches)
    ordered.decode(rows, None, depth)
    frag = {"x": gpu.get(buffers.x, np.float32, (rows, config.hidden_size)),
            "logits": gpu.get(buffers.logits, np.float32, (rows, config.vocab_size)),
            "tokens": gpu.get(buffers.out, np.int32, (rows,)), "kv": kv.copy()}
    off, on = runs
    return {"reordered": reordered,
            "fragment_launches": sum(bool(gpu.kernels[n].meta.get("frag")) for n in gpu.kernels.launches[first:]),
            "fragments_exact": all(np.array_equal(frag[key], off[key]) for key in frag),
            "chains": fw.chains_norms(rows), "chained_launches": [off["chained"], on["chained"]],
            "x": rel(on["x"], off["x"]), "logits": rel(on["logits"], off["logits"]),
            "tokens_equal": bool(np.array_equal(on["tokens"], off["tokens"])),
            "greedy": bool(np.array_equal(off["tokens"], off["logits"].argmax(axis=1))),
            "kv_equal": bool(np.array_equal(on["kv"], off["kv"])), "kv_written": bool((off["kv"] != kv_before).any()),
            "seconds": dict(sorted(((name, round(t, 1)) for name, t in gpu.kernels.seconds.items()),
                                   key=lambda item: -item[1])[:5])}


def case_deltanet_step(rows: int) -> dict:
    """``deltanet_step`` (conv and delta rule in one launch) against ``deltanet_conv`` + ``deltanet_rule``
    for two decode steps of ``rows`` sequences in a row (lanes out of order, slot 0 unused), with two
    and three value heads a key head: the outputs and both states bit for bit, the tickets back at zero.
    Then, at head dim 32 (a build of whole warps), ``deltanet_rule_s2`` (each head's columns over two
    blocks) against ``deltanet_rule``: outputs and states to fp32 rounding, its tickets back at zero.
    Last, each form with its states written out of place (``lanes_out``, pipelined decode) against
    itself in place, bit for bit, the slots it read left as they were."""
    result = {}
    for n_k, n_v in ((2, 4), (1, 3)):
        result[f"group{n_v // n_k}"] = _deltanet_runs(rows, n_k, n_v, 16, ("rule", "step"), exact=True)
    result["split2"] = _deltanet_runs(rows, 2, 4, 32, ("rule", "split2"), exact=False)
    for form in ("rule", "step", "split2"):
        result[f"{form} out of place"] = _deltanet_runs(rows, 2, 4, 32, (form, form + " out of place"), exact=True)
    return result


def _deltanet_runs(rows: int, n_k: int, n_v: int, d: int, forms: tuple, exact: bool) -> dict:
    """Two decode steps of the DeltaNet conv and rule in each of two ``forms`` ("rule": conv then
    ``deltanet_rule``; "step": ``deltanet_step``; "splitN": conv then ``deltanet_rule_sN``; with " out
    of place": the first step writes slots ``rows + 1 ..``, the second reads them and writes the lanes'
    slots back) from the same states, compared bit for bit (``exact``) or to fp32 rounding."""
    gpu = kernel_sim.SimGpu()
    rng = np.random.default_rng(40 + rows + n_v + d)
    key_dim, value_dim = n_k * d, n_v * d
    conv_dim = 2 * key_dim + value_dim
    in_stride = conv_dim + value_dim + 2 * n_v
    slot = 3 * conv_dim + n_v * d * d + 4  # a slot stride that is not the state's size
    lanes = gpu.put((rows - np.arange(rows)).astype(np.int32))
    spares = gpu.put((rows + 1 + np.arange(rows)).astype(np.int32))
    floats = (2 * rows + 1) * slot
    states0 = (rng.standard_normal(floats) * 0.5).astype(np.float32)
    conv_w = gpu.put((rng.standard_normal(conv_dim * 4) * 0.5).astype(np.float32))
    dt_bias, a_log = (gpu.put(rng.standard_normal(n_v).astype(np.float32)) for _ in range(2))
    norm_w = gpu.put((1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    tickets = gpu.put(np.zeros(rows * n_v, np.int32))  # n_v >= n_k: enough for either kernel
    partials = gpu.empty(rows * n_v * 8 * 4)
    projs = [gpu.put(rng.standard_normal((rows, in_stride)).astype(np.float32)) for _ in range(2)]
    runs = []
    for form in forms:
        form, _, placed = form.partition(" ")
        steps = ((lanes, spares), (spares, lanes)) if placed else ((lanes, lanes), (lanes, lanes))
        states = gpu.put(states0)
        mixed, out = gpu.empty(rows * conv_dim * 4), gpu.empty(rows * value_dim * 4)
        rule_state = states.at(3 * conv_dim * 4)
        outs = []
        for proj, (read, write) in zip(projs, steps):
            if form == "step":
                gpu.launch(f"deltanet_step_k{d}_v{d}", (n_v, rows), (2 * d,),
                           (proj, out, states, slot, read, write, n_k, n_v, in_stride, conv_w, dt_bias, a_log,
                            norm_w, EPS, tickets))
            else:
                gpu.launch("deltanet_conv", (-(-conv_dim // 128), rows), (128,),
                           (mixed, proj, in_stride, states, slot, read, write, 1, conv_dim, conv_w))
            if form == "rule":
                gpu.launch(f"deltanet_rule_k{d}_v{d}", (n_v, rows), (2 * d,),
                           (mixed, proj, out, rule_state, slot, read, write, 1, n_k, n_v, in_stride, dt_bias,
                            a_log, norm_w, EPS))
            elif form != "step":
                splits = int(form.removeprefix("split"))
                gpu.launch(f"deltanet_rule_s{splits}_k{d}_v{d}", (n_v, rows, splits), (2 * d // splits,),
                           (mixed, proj, out, rule_state, slot, read, write, n_k, n_v, in_stride, dt_bias, a_log,
                            norm_w, EPS, partials, tickets))
            outs.append(gpu.get(out, np.float32, (rows, value_dim)))
            if not outs[1:]:
                first = gpu.get(states, np.float32, (floats,))
        runs.append((outs, gpu.get(states, np.float32, (floats,)), first))
    (outs_a, states_a, _), (outs_b, states_b, first_b) = runs
    lane_slots = slice(slot, (rows + 1) * slot)  # slot 0 is unused, the spares follow the lanes
    if exact:
        same_out = all(np.array_equal(a, b) for a, b in zip(outs_a, outs_b))
        same_states = bool(np.array_equal(states_a[lane_slots], states_b[lane_slots]))
    else:
        same_out = all(rel(b, a) < 1e-6 for a, b in zip(outs_a, outs_b))
        same_states = rel(states_b[lane_slots], states_a[lane_slots]) < 1e-6
    checks = {"out_equal": same_out, "states_equal": same_states,
              "states_moved": bool((states_a != states0).any()),
              "slot0_kept": bool(np.array_equal(states_b[:slot], states0[:slot])),
              "finite": bool(all(np.isfinite(o).all() for o in outs_b)),
              "tickets_zero": bool(not gpu.get(tickets, np.int32, (rows * n_v,)).any())}
    if forms[1].endswith("out of place"):  # the first step left the states it read as they were
        checks["read_slots_kept"] = bool(np.array_equal(first_b[lane_slots], states0[lane_slots]))
    return checks


def case_gated_combine(rows: int) -> dict:
    """``gated_combine`` over random split partials (rows with 10 and 2 splits holding keys, of 11, so
    a group of MERGE_GROUP is partial) against the softmax merge in NumPy, times the sigmoid gate; then
    ``gated_attention`` + ``gated_combine`` over a paged bf16 pool (keys in groups of KEYS, the last
    group partial) against attention in NumPy."""
    gpu = kernel_sim.SimGpu()
    rng = np.random.default_rng(60 + rows)
    heads, splits, d, split_len = 3, 11, 32, 32
    positions = np.array([split_len * 9 + 5, 40, 7][:rows], np.int32)
    m = (rng.standard_normal((rows, heads, splits)) * 3).astype(np.float32)
    l = rng.uniform(0.5, 4, (rows, heads, splits)).astype(np.float32)
    o = rng.standard_normal((rows, heads, splits, d)).astype(np.float32)
    gate = rng.standard_normal((rows, heads * d)).astype(np.float32)
    out = gpu.empty(rows * heads * d * 4)
    gpu.launch("gated_combine", (heads, rows), (d,),
               (out, gpu.put(gate), gpu.put(o), gpu.put(np.stack([m, l], -1)), gpu.put(positions), heads, splits, d,
                gpu.put(np.array([split_len], np.int32))))
    want = np.zeros((rows, heads, d))
    for r in range(rows):
        active = min(splits, (positions[r] + split_len) // split_len)
        for h in range(heads):
            w = np.exp(m[r, h, :active] - m[r, h, :active].max())
            want[r, h] = (o[r, h, :active] * w[:, None]).sum(0) / (l[r, h, :active] * w).sum()
    return {"combine": rel(gpu.get(out, np.float32, (rows, heads * d)), want.reshape(rows, -1) / (1 + np.exp(-gate))),
            "attention": _gated_attention(rows)}


def case_gated_qk_rope(rows: int) -> dict:
    """``gated_qk_rope_f32`` (its loads of the position, rotary entries, norm weights and KV page before
    the grid wait) against NumPy: the gates copied, q and k through their RMSNorm (``1 + w`` folded)
    and RoPE on the first ``2 * rot_half`` dims, q into its row, k and v into the rows' pages."""
    gpu = kernel_sim.SimGpu()
    rng = np.random.default_rng(20 + rows)
    heads, kv, d, rot_half, page, max_pages, max_context = 4, 2, 32, 4, 16, 3, 48
    qkv = rng.standard_normal((rows, 2 * (heads + kv) * d)).astype(np.float32)
    q_norm, k_norm = ((1 + 0.1 * rng.standard_normal(d)).astype(np.float32) for _ in range(2))
    angles = np.arange(max_context)[:, None] * (0.5 ** np.arange(rot_half))[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    positions = np.array([5, 37, 20][:rows], np.int32)
    table = (1 + np.arange(rows * max_pages)).reshape(rows, max_pages).astype(np.int32)
    page_stride = 2 * kv * page * d
    pool = np.zeros(((rows * max_pages + 1), 2, kv, page, d), np.float32)
    q_out, gate = gpu.empty(rows * (heads + 2 * kv) * d * 4), gpu.empty(rows * heads * d * 4)
    d_pool = gpu.put(pool)
    gpu.launch("gated_qk_rope_f32", (rows, heads + 2 * kv), (d,),
               (gpu.put(qkv), q_out, gate, gpu.put(q_norm), gpu.put(k_norm), gpu.put(cos), gpu.put(sin), d_pool,
                page_stride, gpu.put(table), max_pages, gpu.put(np.arange(rows, dtype=np.int32)), gpu.put(positions),
                heads, kv, d, rot_half, page, EPS))

    def normed_roped(x, w, pos):
        x = x / np.sqrt((x.astype(np.float64) ** 2).mean() + EPS) * w
        a, b = x[:rot_half].copy(), x[rot_half:2 * rot_half].copy()
        x[:rot_half], x[rot_half:2 * rot_half] = a * cos[pos] - b * sin[pos], b * cos[pos] + a * sin[pos]
        return x

    q_want = np.zeros((rows, heads + 2 * kv, d))
    pool_want = pool.astype(np.float64)
    for r in range(rows):
        pos = positions[r]
        row = qkv[r].astype(np.float64)
        for h in range(heads):
            q_want[r, h] = normed_roped(row[2 * h * d:2 * h * d + d], q_norm, pos)
        for j in range(kv):
            k = row[2 * heads * d + j * d:2 * heads * d + j * d + d]
            v = row[2 * heads * d + (kv + j) * d:2 * heads * d + (kv + j) * d + d]
            at = table[r, pos // page]
            pool_want[at, 0, j, pos % page] = normed_roped(k, k_norm, pos)
            pool_want[at, 1, j, pos % page] = v
    gates = qkv.reshape(rows, heads + kv, 2, d)[:, :heads, 1].reshape(rows, -1)
    q_got = gpu.get(q_out, np.float32, (rows, heads + 2 * kv, d))
    return {"gate_equal": bool(np.array_equal(gpu.get(gate, np.float32, (rows, heads * d)), gates)),
            "q": rel(q_got[:, :heads], q_want[:, :heads]),
            "pool": rel(gpu.get(d_pool, np.float32, pool.shape), pool_want)}


def _split_partials(gpu, name: str, grid: tuple, q: np.ndarray, pool: np.ndarray, table: np.ndarray,
                    positions: np.ndarray, heads: int, split_len: int, splits: int) -> tuple:
    """Launch the split attention kernel ``name`` (``attention_*`` / ``gated_attention_*``, one
    signature) over ``pool`` ``[pages, 2, n_kv, 16, d]`` of every row's keys; returns what the combine
    kernels read: (part_o, part_ml, positions, split length) on the device."""
    rows, (n_kv, page, d) = q.shape[0], pool.shape[2:]
    cells = rows * heads * splits
    part_o, part_ml = gpu.empty(cells * d * 4), gpu.empty(cells * 2 * 4)
    d_positions, d_split = gpu.put(positions), gpu.put(np.array([split_len], np.int32))
    gpu.launch(name, grid, (128,),
               (gpu.put(q), gpu.put(pool), 2 * n_kv * page * d, gpu.put(table), table.shape[1],
                gpu.put(np.arange(rows, dtype=np.int32)), d_positions, part_o, part_ml, heads, n_kv,
                int(page).bit_length() - 1, d_split, splits, float(d ** -0.5)))
    return part_o, part_ml, d_positions, d_split


def attention_in_numpy(q: np.ndarray, pool: np.ndarray, table: np.ndarray, positions: np.ndarray,
                       heads: int) -> np.ndarray:
    """``[rows, heads * d]``: each row's query heads attending to its keys ``0..positions[r]`` (GQA)."""
    rows, (n_kv, page, d) = q.shape[0], pool.shape[2:]
    want = np.zeros((rows, heads, d))
    for r in range(rows):
        keys = np.arange(positions[r] + 1)
        at = pool[table[r, keys // page]].astype(np.float64)  # [keys, 2, n_kv, page, d]
        for h in range(heads):
            kvh = h // (heads // n_kv)
            k, v = at[keys, 0, kvh, keys % page], at[keys, 1, kvh, keys % page]
            s = k @ q[r, h] * d ** -0.5
            p = np.exp(s - s.max())
            want[r, h] = p @ v / p.sum()
    return want.reshape(rows, -1)


def _paged_case(seed: int, rows: int, d: int) -> tuple:
    """Random queries (4 heads over 2 KV heads) and a pool of five 16-key pages a row, shuffled."""
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((rows * 5, 2, 2, 16, d)).astype(np.float32)
    table = rng.permutation(rows * 5).astype(np.int32).reshape(rows, 5)
    q = rng.standard_normal((rows, 4 + 2 * 2, d)).astype(np.float32)
    return rng, pool, table, q


def _gated_attention(rows: int) -> float:
    """``gated_attention_d32_bf16`` then ``gated_combine`` for ``rows`` rows of 4 query heads over 2 KV
    heads, 16-key pages in a shuffled page table: relative error against NumPy."""
    from ninfer.artifact.bf16 import from_float32, to_float32

    gpu = kernel_sim.SimGpu()
    rng, pool, table, q = _paged_case(70 + rows, rows, 32)
    heads, splits, d = 4, 4, 32
    positions = np.array([70, 20, 45][:rows], np.int32)
    pool_bits = from_float32(pool)
    gate = rng.standard_normal((rows, heads * d)).astype(np.float32)
    part_o, part_ml, d_positions, d_split = _split_partials(gpu, "gated_attention_d32_bf16", (heads, rows, splits),
                                                            q, pool_bits, table, positions, heads, 32, splits)
    out = gpu.empty(rows * heads * d * 4)
    gpu.launch("gated_combine", (heads, rows), (d,),
               (out, gpu.put(gate), part_o, part_ml, d_positions, heads, splits, d, d_split))
    want = attention_in_numpy(q, to_float32(pool_bits), table, positions, heads)
    return rel(gpu.get(out, np.float32, (rows, heads * d)), want / (1 + np.exp(-gate)))


def case_split_attention(rows: int) -> dict:
    """``attention_g2_d64_f32`` (the CUDA-core split attention of prefill rows over an fp32 pool: each
    block's warps merged once a head) then ``attention_combine``, for ``rows`` rows of 4 query heads over
    2 KV heads, 16-key pages in a shuffled page table, rows holding 3, 1, 2 and 2 splits of keys:
    relative error against attention in NumPy."""
    gpu = kernel_sim.SimGpu()
    _, pool, table, q = _paged_case(80 + rows, rows, 64)
    heads, splits, d = 4, 3, 64
    positions = np.array([70, 20, 45, 33][:rows], np.int32)
    part_o, part_ml, d_positions, d_split = _split_partials(gpu, "attention_g2_d64_f32", (2, rows, splits),
                                                            q, pool, table, positions, heads, 32, splits)
    out = gpu.empty(rows * heads * d * 4)
    gpu.launch("attention_combine", (heads, rows), (4 * d,),
               (out, part_o, part_ml, d_positions, heads, splits, d, d_split))
    return {"attention": rel(gpu.get(out, np.float32, (rows, heads * d)),
                             attention_in_numpy(q, pool, table, positions, heads))}


def case_decode_attention(rows: int) -> dict:
    """``decode_attention_g2_d64_bf16`` (one launch: rope, the KV append, the tensor-core key phase, the
    split merge) over a bf16 pool of 4 query heads on 2 KV heads in shuffled pages of 64 keys and of 4
    (a 16-key tile spans pages): rows of 300 and 40 keys in one split of 320 (a warp folds 4 or 5 tiles,
    the first staged) and in splits of 64 (merged). Relative error of the output against NumPy, and
    whether the new keys landed where their pages say."""
    from ninfer.artifact.bf16 import from_float32, to_float32

    kv, group, d = 2, 2, 64
    heads = kv * group
    split, max_ctx = 320, 352
    lengths = np.array([300, 40][:rows])
    positions = (lengths - 1).astype(np.int32)
    result = {}
    for page in (64, 4):
        gpu = kernel_sim.SimGpu(256 << 20)
        rng = np.random.default_rng(100 + page + rows)
        max_pages = max_ctx // page
        num_pages = rows * max_pages + 1
        table = rng.permutation(num_pages)[:rows * max_pages].reshape(rows, max_pages).astype(np.int32)
        pool = to_float32(from_float32(rng.standard_normal((num_pages, 2, kv, page, d)).astype(np.float32)))
        qkv = rng.standard_normal((rows, (heads + 2 * kv) * d)).astype(np.float32)
        angles = np.arange(max_ctx)[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))[None]
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        half = d // 2

        def rope(x, pos):
            c, s_ = cos[pos], sin[pos]
            return np.concatenate([x[..., :half] * c - x[..., half:] * s_, x[..., half:] * c + x[..., :half] * s_], -1)

        want_pool = pool.copy()
        q = np.zeros((rows, heads + 2 * kv, d), np.float32)
        for r in range(rows):
            x = qkv[r].reshape(heads + 2 * kv, d)
            q[r, :heads] = rope(x[:heads], positions[r])
            at = table[r, positions[r] // page]
            want_pool[at, 0, :, positions[r] % page] = to_float32(from_float32(rope(x[heads:heads + kv], positions[r])))
            want_pool[at, 1, :, positions[r] % page] = to_float32(from_float32(x[heads + kv:]))
        want = attention_in_numpy(q, want_pool, table, positions, heads)
        zeros = gpu.put(np.zeros((heads + 2 * kv) * d, np.float32))
        errors, pool_equal = [], True
        for split_len in (split, 64):
            splits = -(-max_ctx // split_len)
            part_o, part_ml = gpu.empty(rows * heads * splits * d * 4), gpu.empty(rows * heads * splits * 2 * 4)
            out = gpu.empty(rows * heads * d * 4)
            d_pool = gpu.put(from_float32(pool))  # each launch appends to the pool as it was
            gpu.launch("decode_attention_g2_d64_bf16", (kv, rows, splits), (128,),
                       (gpu.put(qkv), zeros, zeros, zeros, gpu.put(cos), gpu.put(sin), d_pool, d_pool,
                        2 * kv * page * d, gpu.put(table), max_pages, gpu.put(np.arange(rows, dtype=np.int32)),
                        gpu.put(positions), out, part_o, part_ml, gpu.put(np.zeros(rows * kv, np.int32)), heads, kv,
                        page.bit_length() - 1, gpu.put(np.array([split_len, 0], np.int32)), splits,
                        float(np.float32(d ** -0.5)), 0, 0, 1e-6, d_pool, 0))
            errors.append(rel(gpu.get(out, np.float32, (rows, heads * d)), want))
            pool_equal &= bool(np.array_equal(to_float32(gpu.get(d_pool, np.uint16, pool.shape)), want_pool))
        result[f"page{page}"] = max(errors)
        result[f"page{page} pool"] = pool_equal
    return result


def decode_inputs(rng, forward, inp, rows: int, vocab: int, max_context: int, pages: int, positions=None) -> int:
    """A greedy decode step's inputs for ``rows`` lanes whose keys are already cached (1 .. max_context - 2
    of them unless ``positions`` are given, ``pages`` pages a lane from page 1 on), uploaded; returns the
    attention depth the runner would pick."""
    if positions is None:
        positions = rng.integers(1, max_context - 1, rows).astype(np.int32)
    inp.tokens[:rows] = rng.integers(0, vocab, rows)
    inp.positions[:rows] = positions
    inp.row_table[:rows] = np.arange(rows)
    inp.lanes[:rows] = np.arange(rows)
    inp.state_in[:rows] = np.arange(rows)  # a hybrid's states: each lane's, written out of place
    inp.state_out[:rows] = rows + np.arange(rows)
    inp.split[0] = split = forward.decode_split(int(positions.max()) + 1, rows)
    inp.split[1] = 0
    inp.page_tables[:rows, :pages] = 1 + np.arange(pages * rows).reshape(rows, pages)  # page 0 unused
    inp.fparams[:5 * rows] = 0.0  # temperature 0: greedy
    inp.iparams[:2 * rows] = [v for lane in range(rows) for v in (0, lane)]
    inp.keys[:2 * rows] = 0
    inp.upload(None)
    return forward.decode_depth(split, int(positions.max()) + 1)


def random_bits(rng, raw: np.ndarray) -> None:
    """Fill a device region with random bf16 pairs (finite, about unit scale) whatever it holds."""
    raw[:] = (rng.standard_normal(raw.size // 2).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16).view(np.uint8)


def hybrid_step(config, rng, rows: int, max_context: int, pages: int) -> tuple:
    """(gpu, buffers, forward): a simulated ``HybridForward`` of ``config`` with random weights, pages of 16
    keys (``pages`` a row from page 1 on), a bf16 pool of random keys and random states."""
    from ninfer.backends.cuda import hybrid_forward as hf
    from ninfer.backends.cuda.hybrid_weights import device_layout

    gpu = kernel_sim.SimGpu()
    kernel_sim.patch_runtime(gpu.device)
    weights = put_weights(gpu, rng, device_layout(config))
    buffers = hf.HybridBuffers(gpu.device, config, page_size=16, num_pages=rows * pages + 1, max_batch=8,
                               max_context=max_context, max_rows=8, kv_dtype="bf16", state_slots=1)
    buffers.init(None)
    forward = hf.HybridForward(gpu.kernels, config, weights, buffers, page_size=16, kv_dtype="bf16")
    random_bits(rng, gpu.device.bytes(buffers.kv))
    states = gpu.device.bytes(buffers.states).view(np.float32)
    states[:] = rng.standard_normal(states.size).astype(np.float32) * 0.3
    return gpu, buffers, forward


def case_hybrid_decode(rows: int) -> dict:
    """A whole ``HybridForward.decode`` step (a DeltaNet and a gated-attention layer, each MLP a MoE)
    with ``fused_step``, ``merged_attention``, ``fold_route`` and ``fold_combine`` off, then all on:
    the same states, KV appends, hidden states, logits and tokens bit for bit, in fewer launches."""
    import attrs

    from ninfer.convert.random_model import HYBRID_PRESETS
    from ninfer.models.hybrid import FULL, LINEAR, MOE

    # tiny-qwen3.5-moe cut to one layer of each kind and four experts (the simulator's time goes on blocks)
    config = attrs.evolve(HYBRID_PRESETS["tiny-qwen3.5-moe"], num_layers=2, layer_types=(LINEAR, FULL),
                                 mlp_types=(MOE, MOE), num_experts=4, num_experts_per_tok=2, vocab_size=256)
    rng = np.random.default_rng(50 + rows)
    max_context, pages = 64, 4
    gpu, buffers, forward = hybrid_step(config, rng, rows, max_context, pages)
    kv, states = gpu.device.bytes(buffers.kv), gpu.device.bytes(buffers.states)
    kv_before, states_before = kv.copy(), states.copy()
    depth = decode_inputs(rng, forward, buffers.inputs, rows, config.vocab_size, max_context, pages)
    runs = []
    forward.roped_attention = False  # the three-launch attention that merged_attention folds (roped: its own case)
    for fused, folds in ((False, False), (True, True)):
        kv[:], states[:] = kv_before, states_before
        forward.fused_step = forward.merged_attention = fused
        forward.moe.fold_route = forward.moe.fold_combine = folds
        first = len(gpu.kernels.launches)
        forward.decode(rows, None, depth)
        runs.append({"launches": len(gpu.kernels.launches) - first, "kv": kv.copy(), "states": states.copy(),
                     "x": gpu.get(buffers.x, np.float32, (rows, config.hidden_size)),
                     "logits": gpu.get(buffers.logits, np.float32, (rows, config.vocab_size)),
                     "tokens": gpu.get(buffers.out, np.int32, (rows,))})
    base = runs[0]
    return {"launches": [run["launches"] for run in runs],
            "identical": [all(np.array_equal(run[key], base[key]) for key in base if key != "launches")
                          for run in runs],
            "states_moved": bool((base["states"] != states_before).any()),
            "kv_written": bool((base["kv"] != kv_before).any()),
            "greedy": bool(np.array_equal(base["tokens"], base["logits"].argmax(axis=1))),
            "finite": bool(np.isfinite(base["logits"]).all()),
            "tickets_zero": bool(not gpu.get(buffers.step_tickets, np.int32, (8 * config.linear_num_k_heads,)).any()
                                 and not gpu.get(buffers.attention_tickets, np.int32, (8 * config.num_heads,)).any())}


def case_roped_attention(rows: int) -> dict:
    """A whole ``HybridForward.decode`` step (a DeltaNet and a gated-attention layer, dense MLPs, a quarter
    of each head rotated, bf16 pool) with ``roped_attention`` off (``gated_qk_rope`` + ``gated_attention``
    + ``gated_combine``), then on (``gated_attention_roped`` + ``gated_combine``): rows of one, two and
    three splits, query groups of four (two KV heads of four query heads each). Whether the pool, gates,
    attention output, hidden states, logits, tokens and states are bit for bit the same, and the
    launches of each."""
    import attrs

    from ninfer.convert.random_model import HYBRID_PRESETS
    from ninfer.models.hybrid import DENSE, FULL, LINEAR

    result = {}
    for heads, kv_heads in ((8, 2),):
        config = attrs.evolve(HYBRID_PRESETS["tiny-qwen3.5"], num_layers=2, layer_types=(LINEAR, FULL),
                              mlp_types=(DENSE, DENSE), vocab_size=256, num_heads=heads, num_kv_heads=kv_heads)
        max_context, pages = 96, 6
        gpu, buffers, forward = hybrid_step(config, np.random.default_rng(90 + rows + heads), rows, max_context, pages)
        kv, states = gpu.device.bytes(buffers.kv), gpu.device.bytes(buffers.states)
        kv_before, states_before = kv.copy(), states.copy()
        positions = np.array([20, 50, 80][:rows], np.int32)  # one, two and three splits of 32 keys
        runs = []
        for roped in (False, True):
            kv[:], states[:] = kv_before, states_before
            forward.roped_attention = roped
            depth = decode_inputs(np.random.default_rng(7), forward, buffers.inputs, rows, config.vocab_size,
                                  max_context, pages, positions)
            first = len(gpu.kernels.launches)
            forward.decode(rows, None, depth)
            runs.append({"launched": list(gpu.kernels.launches[first:]), "kv": kv.copy(), "states": states.copy(),
                         "gate": gpu.get(buffers.gate, np.float32, (rows, config.q_size)),
                         "attn": gpu.get(buffers.attn, np.float32, (rows, config.q_size)),
                         "x": gpu.get(buffers.x, np.float32, (rows, config.hidden_size)),
                         "logits": gpu.get(buffers.logits, np.float32, (rows, config.vocab_size)),
                         "tokens": gpu.get(buffers.out, np.int32, (rows,))})
        off, on = runs
        result[f"{heads}x{kv_heads}"] = {
            "launches": [sum(n.startswith("gated_") for n in run["launched"]) for run in runs],
            "roped_launched": forward.roped_attention_name in on["launched"],
            "kv_written": bool((on["kv"] != kv_before).any()),
            "identical": {key: bool(np.array_equal(on[key], off[key])) for key in off if key != "launched"}}
    return result


def case_collectives(rows: int) -> dict:
    """The simulator's own collectives (tests/kernel_sim.py). Its one-collective ``warp_sum`` /
    ``warp_max`` (``_butterfly``) against the shuffle-by-shuffle device functions they stand in for, in
    a block of ``32 * rows + 16`` threads (a partial last warp): the same bits in every lane, for sums
    whose value depends on the order of the additions and maxima over NaNs and signed zeros. Then a
    thread that raises while the others wait at a barrier and in a shuffle: the launch raises its error
    within the waits' half-second poll, and the pooled threads reduce as before in the next launch."""
    import time

    import numba_kernels.common as common

    @cuda.jit
    def reduce_both_ways(x, m, out):
        i = cuda.threadIdx.x
        out[0, i] = common.warp_sum(x[i])
        out[1, i] = common.shuffled_warp_sum(x[i])
        out[2, i] = common.warp_max(m[i])
        out[3, i] = common.shuffled_warp_max(m[i])

    @cuda.jit
    def one_thread_fails(out):
        i = cuda.threadIdx.x
        if i == 37:
            raise ValueError("thread 37 fails")
        out[i] = cuda.shfl_xor_sync(0xFFFFFFFF, float(i), 1)  # warp 1 waits here for its lane 5
        cuda.syncthreads()  # the other warps wait here for warp 1

    threads = 32 * rows + 16
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(threads) * 10.0 ** rng.integers(-2, 3, threads)).astype(np.float32)
    m = rng.standard_normal(threads).astype(np.float32)
    m[[3, threads - 14]], m[[5, 6]] = np.nan, (-0.0, 0.0)  # NaNs in the first and the partial warp

    def reduced() -> np.ndarray:
        out = np.zeros((4, threads), np.float32)
        reduce_both_ways[1, threads](x, m, out)
        return out

    out = reduced()
    bits = out.view(np.uint32)
    started = time.monotonic()
    try:
        one_thread_fails[1, threads](np.zeros(threads, np.float32))
        failure = ""
    except ValueError as error:
        failure = str(error)
    failed_in = time.monotonic() - started
    return {"sum_identical": bool(np.array_equal(bits[0], bits[1])), "max_identical": bool(np.array_equal(bits[2], bits[3])),
            "sum_vs_numpy": rel(out[0, 32:64], np.full(32, x[32:64].astype(np.float64).sum())),
            "failure": failure, "failed_in_s": failed_in,
            "same_after_failure": bool(np.array_equal(reduced().view(np.uint32), bits))}


CASES = {"gemv": case_gemv, "chain": case_chain, "moe": case_moe, "moe_gemv": case_moe_gemv, "decode": case_decode,
         "deltanet_step": case_deltanet_step, "conv_gemv": case_conv_gemv, "rule_norm_gemv": case_rule_norm_gemv, "gated_qk_rope": case_gated_qk_rope,
         "roped_attention": case_roped_attention, "hybrid_decode": case_hybrid_decode, "gated_combine": case_gated_combine,
         "split_attention": case_split_attention, "decode_attention": case_decode_attention,
         "collectives": case_collectives}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--rows", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(CASES[args.case](args.rows)))


if __name__ == "__main__":
    main()
