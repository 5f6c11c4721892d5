"""The decode kernels written while no GPU was lent, run on the CPU in Numba's CUDA simulator.

tests/kernel_sim.py completes the simulator (warp shuffles, ``mma.sync`` and our other intrinsics)
and tests/sim_kernels.py runs each case; the simulator must be on before numba.cuda is first
imported, so each case is a subprocess and this process never imports numba.cuda. What the GPU
suite checks on the device (tests/cuda/test_cuda_kernels.py, test_cuda_moe.py, test_cuda_hybrid.py)
these check in the simulator: the tensor-core GEMVs against NumPy, the chained norm against the
normed kernels alone and in a whole dense decode step, the folded MoE launches and the fused DeltaNet
step bit for bit against the separate ones, alone and in a whole hybrid decode step. Speed is the
GPU's question.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("numba")

SCRIPT = Path(__file__).resolve().parent / "sim_kernels.py"
TOL = 1e-6  # fp32-faithful (three bf16 parts an activation); the simulator sums in float64
# Every (case, rows) the tests below ask for: the first test to ask starts them all, as many at once
# as there are CPUs (each is one busy process; together they take minutes, not the sum of them),
# the longest first (seconds, two at a time on two CPUs: the MoE cases 75-105, roped_attention and
# hybrid_decode 60-70, the whole dense step 35-50, the rest under 20): no long one starts last.
CASES = [("moe", 8), ("moe", 3), ("moe_gemv", 1), ("roped_attention", 3), ("hybrid_decode", 3), ("decode", 8),
         ("decode", 3), ("moe_gemv", 2), ("decode_attention", 2), ("rule_norm_gemv", 1), ("gemv", 1), ("chain", 3),
         ("chain", 8), ("gemv", 8), ("deltanet_step", 3), ("conv_gemv", 2), ("split_attention", 4), ("conv_gemv", 1),
         ("deltanet_step", 1), ("gated_combine", 3), ("gated_qk_rope", 3), ("collectives", 2)]
_runs: dict = {}


def _run(case: str, rows: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), case, "--rows", str(rows)], env=env, capture_output=True,
                          text=True, timeout=900)


def simulate(case: str, rows: int) -> dict:
    if not _runs:
        pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
        _runs.update({key: pool.submit(_run, *key) for key in CASES})
        pool.shutdown(wait=False)
    run = _runs[case, rows].result()
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("rows", [1, 8])
def test_tensor_core_gemvs_match_numpy(rows):
    result = simulate("gemv", rows)
    held = result.pop("gemv_residual_m1p4", None)  # one row: the fp32 GEMV holding 4 steps before its wait
    # the builds reading fragment-order copies: their row-major builds' y, bit for bit
    fragment_order = result.pop("fragment_order")
    assert len(fragment_order) == 4 and all(fragment_order.values()), fragment_order
    assert len(result) == 5 and (held is not None) == (rows == 1)
    for name, err in result.items():
        assert err < TOL, (name, err)
    if held:  # the same sums in the same order as the plain one-row GEMV
        assert held["identical"] and held["vs_numpy"] < TOL, held


@pytest.mark.parametrize("rows", [3, 8])
def test_chained_norm_matches_the_normed_kernels(rows):
    """The residual GEMV's next-norm input is ``y * norm_w`` exactly, its partial sums add up to each
    row's sum of squares, and every consumer shape agrees with the normed kernel it replaces."""
    result = simulate("chain", rows)
    assert result["xn"] == 0.0
    consumers = [name for name in result if name.startswith("mma_gemv_normin") and "vs" not in name]
    assert len(consumers) == 3
    for name, err in result.items():
        assert err < TOL, (name, err)


@pytest.mark.parametrize("rows", [3, 8])
def test_folded_moe_launches_are_the_separate_ones_bit_for_bit(rows):
    """``CudaMoe.fold_route`` / ``fold_combine``, the ``hold`` grouped GEMMs, the routing's build for
    MAX_EXPERTS (more slots a lane than the tiny model's), the early-loading router GEMM and the
    ``early`` grouped GEMMs (8 rows: a full chunk of pairs; 3: six picks): the MoE added into the
    residual stream, the normalised rows and the picks equal the five-launch path's, launch after
    launch (the tickets reset themselves), in three launches with both folds."""
    result = simulate("moe", rows)
    assert result["launches"] == [5, 4, 4, 3, 3, 5, 3, 3, 5, 4, 5, 5]
    assert result["held_launched"] and all(result["builds_launched"])
    assert len(result["refusals"]) == 1 and "early gate/up" in result["refusals"][0]
    assert all(result["identical"]), result["identical"]
    assert result["tickets_zero"]
    assert result["normed"] < TOL and result["moe"] < TOL, result


@pytest.mark.parametrize("rows", [1, 2])
def test_moe_gemv_builds_are_the_mma_ones_to_rounding(rows):
    """``CudaMoe.gemv_rows``: the expert GEMMs of one or two rows as fp32 GEMVs, every shape for the row
    count: the same picks and normalised rows as the tensor-core grouped GEMMs, the MoE to fp32
    rounding of theirs and of the reference. One row: the gate/up GEMVs that route the row themselves
    write moe_route's plan (the shared pair's weight to rounding) and the same MoE, the shared chunk in
    the grid's first row of blocks (``f`` builds), several tiles a block (``i``) and loading each next
    tile early (``l``) bit for bit as the plain build; the down GEMVs with
    the combine folded in give the launched-apart result bit for bit, and so does the router asking L2
    for the next layer's first weights (``CudaMoe.next_prefetch``), which asks for exactly those bytes;
    the router as an fp32 GEMV (``CudaMoe.router_gemv``, each build) picks the same experts and gives
    the normalised row, the pick weights and the MoE to fp32 rounding, asking L2 for the same bytes."""
    result = simulate("moe_gemv", rows)
    assert result["mma"] < TOL
    after = result.pop("next_prefetch", None)
    gemv_router = result.pop("router_gemv", None)
    reordered = result.pop("reordered", None)
    if rows == 1:
        base = "moe_gate_up_gemv_m1c4x128r256"
        assert reordered == {base + flags + n: True for flags in ("f", "i3f", "i3fl") for n in ("", "n")}
        assert len(gemv_router) == 2
        for name, checks in gemv_router.items():
            assert checks["launched"] and checks["picks_identical"], (name, checks)
            assert max(checks[key] for key in ("pick_weights", "normed", "vs_plain", "vs_reference")) < TOL, checks
            assert checks["next_bytes_asked"] == checks["then_bytes"], checks
        assert after["identical"], after
        assert after["launched"] == [after["router"]] and len(after["plain_launched"]) == 1, after
        assert after["next_bytes_asked"] == after["then_bytes"], after
    shapes = [name for name in result if name != "mma" and "r256" not in name and "combine" not in name]
    assert len(shapes) == (5 if rows == 1 else 2)
    for name in shapes:
        checks = result[name]
        assert checks["routing_identical"], name
        assert checks["vs_mma"] < TOL and checks["vs_reference"] < TOL, (name, checks)
    routed = [name for name in result if "r256" in name and "combine" not in name]  # CudaMoe.routed_gate_up
    assert len(routed) == (9 if rows == 1 else 0)  # five builds, four of them also asking L2 for the down weights
    for name in routed:
        checks = result[name]
        assert checks["routing_identical"] and checks["plan_identical"] and checks["routed_weights_identical"], name
        assert checks["shared_weight"] < TOL and checks["vs_plain"] < TOL and checks["vs_reference"] < TOL, checks
    combined = {name: checks for name, checks in result.items() if "combine" in name}  # CudaMoe.combined_down
    assert len(combined) == (4 if rows == 1 else 0)
    for name, checks in combined.items():  # router, (route,) gate/up, down with the combine
        if name.endswith(",None"):
            assert checks == {"launches": 4, "identical": True}, name
        else:
            assert checks["launches"] == 3 and checks["identical"] < TOL, name


@pytest.mark.parametrize("rows", [3, 8])
def test_decode_step_with_chained_norms_is_the_unchained_one(rows):
    """A whole ``Forward.decode`` step (two layers, bf16 KV pool holding keys, greedy sampling) with
    ``chain_norm`` on: eight chained GEMVs (o, gate/up and down of both layers, the second layer's
    q/k/v, the LM head; the first q/k/v reads the embedding unchained) and the same hidden states,
    logits, tokens and KV appends as the unchained step, whose down GEMM at 8 rows is the ring kernel.
    With q/k/v, o, gate/up and down read from fragment-order copies (``Forward.fragments``, made by
    ``fragment_order_bf16``) the unchained step is the same bit for bit."""
    result = simulate("decode", rows)
    assert result["chains"] and result["chained_launches"] == [0, 8]
    # the four GEMMs of both layers read their fragment-order copies: the same step, bit for bit
    assert result["reordered"] and result["fragment_launches"] == 8 and result["fragments_exact"], result
    assert result["x"] < TOL and result["logits"] < TOL, result
    assert result["tokens_equal"] and result["greedy"]
    assert result["kv_equal"] and result["kv_written"]


@pytest.mark.parametrize("rows", [1, 3])
def test_fused_and_split_deltanet_rules_are_the_rule(rows):
    """``deltanet_step`` (``HybridForward.fused_step``) against ``deltanet_conv`` + ``deltanet_rule``, two
    steps in a row, with two and three value heads a key head (whose q/k conv tails the last block of
    the key head writes, after the others have read them), bit for bit; ``deltanet_rule_s2``
    (``HybridForward.rule_splits``) against ``deltanet_rule`` to fp32 rounding. Each of the three
    with its states written out of place (pipelined decode) against itself in place, bit for bit,
    leaving the slots it read untouched."""
    result = simulate("deltanet_step", rows)
    assert sorted(result) == ["group2", "group3", "rule out of place", "split2", "split2 out of place",
                              "step out of place"]
    assert all("read_slots_kept" in result[f"{form} out of place"] for form in ("rule", "step", "split2"))
    for group, checks in result.items():
        assert all(checks.values()), (group, checks)


@pytest.mark.parametrize("rows", [1, 2])
def test_the_in_proj_gemv_with_the_conv_is_gemv_then_conv(rows):
    """``gemv_normed_conv_m{rows}`` (``HybridForward.conv_in_gemv``) against the in_proj GEMV then
    ``deltanet_conv``, tails written out of place: stored columns, conv output and tails bit for bit."""
    result = simulate("conv_gemv", rows)
    assert all(result.values()), result


def test_the_out_gemv_scaling_the_split_rule_is_the_ticketed_rule():
    """``deltanet_rule_s2u`` + ``gemv_residual_headnorm_m1`` (``HybridForward.rule_norm_in_gemv``) against
    ``deltanet_rule_s2`` + ``gemv_residual_m1``, and their ``p4`` and ``p4n`` builds: the residual stream
    and the states bit for bit, the ``n`` builds asking L2 for the bytes they are given."""
    result = simulate("rule_norm_gemv", 1)
    assert sorted(result) == ["m1", "m1p4", "m1p4n"]
    for build, checks in result.items():
        assert all(checks.values()), (build, checks)


def test_gated_qk_rope_matches_numpy():
    """``gated_qk_rope`` (the hybrids' q/k norms, partial RoPE and KV append; what it needs of the step's
    inputs and weights loaded before its grid wait) against NumPy: gates bit for bit, q and the pool to
    fp32 rounding."""
    result = simulate("gated_qk_rope", 3)
    assert result["gate_equal"] and result["q"] < TOL and result["pool"] < TOL, result


def test_roped_attention_is_qk_rope_then_attention():
    """A hybrid decode step with ``roped_attention`` (``gated_attention_roped``: the q/k norms, RoPE and KV
    append inside the split attention, its first keys loaded before the grid wait) against
    ``gated_qk_rope`` + ``gated_attention``, rows of one, two and three splits, two KV heads of four
    query heads: one launch a layer fewer; pool, gates, attention output, hidden states, logits, tokens
    and states bit for bit."""
    result = simulate("roped_attention", 3)
    assert sorted(result) == ["8x2"]
    for shape, checks in result.items():
        assert checks["launches"] == [3, 2] and checks["roped_launched"] and checks["kv_written"], (shape, checks)
        assert all(checks["identical"].values()), (shape, checks)


def test_hybrid_decode_step_with_every_fusion_is_the_plain_one():
    """A whole hybrid decode step (DeltaNet and gated attention, MoE MLPs) with ``fused_step``,
    ``merged_attention`` and both MoE folds: six launches fewer, the same states, KV, hidden states,
    logits and tokens bit for bit."""
    result = simulate("hybrid_decode", 3)
    assert result["launches"][0] - result["launches"][1] == 6  # the conv, the combine, and two a MoE layer
    assert all(result["identical"])
    for check in ("states_moved", "kv_written", "greedy", "finite", "tickets_zero"):
        assert result[check], check


def test_gated_attention_and_its_split_merge_match_numpy():
    """``gated_combine`` (every split's max, then the rescaled sums, in groups of loads) against the
    softmax merge of the same partials in NumPy, rows of 10 and 2 splits with keys; ``gated_attention``
    (keys in groups of KEYS a warp) and the merge over a paged pool against attention in NumPy."""
    result = simulate("gated_combine", 3)
    assert result["combine"] < TOL and result["attention"] < TOL, result


def test_decode_attention_over_pages_of_any_size_matches_numpy():
    """``decode_attention_g2_d64_bf16`` over pages of 64 keys and of 4 (a tile spans pages), one split a
    row and several: the output against NumPy to the tolerance of the bf16 pool and two-part q and P,
    the new K/V where the row's page table says."""
    result = simulate("decode_attention", 2)
    for page in (64, 4):
        assert result[f"page{page}"] < 1e-4 and result[f"page{page} pool"], result


def test_split_attention_of_prefill_rows_matches_numpy():
    """``attention_g2_d64_f32`` (each block's warps weighed once a head, ``make_warp_merge``'s
    ``warp_factors``) and ``attention_combine`` over a paged fp32 pool: rows with 3, 1, 2 and 2 splits
    of keys, splits past a row's keys left empty, against attention in NumPy."""
    assert simulate("split_attention", 4)["attention"] < TOL


def test_the_simulators_collectives():
    """tests/kernel_sim.py plays ``warp_sum`` / ``warp_max`` as one warp collective (five were most of
    the simulated MoE GEMVs' time): every lane's bits must be those of the five shuffles, in full warps
    and a partial one, for sums whose rounding depends on the order and maxima over NaNs and zeros. A
    thread that raises while the rest of its block waits (in a shuffle, at a barrier) ends the launch
    with its error within the waits' half-second poll, and the pooled threads work on afterwards."""
    result = simulate("collectives", 2)
    assert result["sum_identical"] and result["max_identical"], result
    assert result["sum_vs_numpy"] < TOL, result
    assert result["failure"].endswith("thread 37 fails") and result["failed_in_s"] < 10, result
    assert result["same_after_failure"], result
