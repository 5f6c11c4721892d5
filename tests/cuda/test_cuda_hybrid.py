"""CudaHybridRunner and its kernels against the reference hybrid backend (GPU only).

Tolerances: with an fp32 KV pool the two backends differ by fp32 summation order (and the GPU's
exp/tanh), and the reference prefill uses the chunked delta rule where the GPU runs it token by
token: logits agree to 1e-3 relative, greedy tokens are identical. With the default bf16 pool
logits agree to 3e-2 relative. The DeltaNet kernels alone agree with the reference functions to
1e-5 relative.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from ninfer.backends.reference import deltanet as ref  # noqa: E402
from ninfer.backends.reference.forward import silu  # noqa: E402
from ninfer.backends.reference.hybrid_runner import HybridRunner  # noqa: E402
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow  # noqa: E402
from ninfer.convert.random_model import HYBRID_PRESETS, make_random_artifact  # noqa: E402
from ninfer.models.hybrid import DENSE, HybridConfig  # noqa: E402

from cuda_helpers import Gpu, rel_err  # noqa: E402

# tiny-qwen3-next with dense MLPs and its own LM head (untied: greedy runs do not repeat one token);
# "wide" has the real models' head sizes: attention head_dim 256 with 6 query heads per KV head,
# rotary 64, DeltaNet heads of 128.
NEXT_DENSE = attrs.evolve(HYBRID_PRESETS["tiny-qwen3-next"], mlp_types=(DENSE,) * 4)
WIDE = HybridConfig(
    architecture="Qwen3_5ForCausalLM", vocab_size=1024, hidden_size=256, num_layers=4,
    layer_types=("linear_attention",) * 3 + ("full_attention",), mlp_types=(DENSE,) * 4, rms_norm_eps=1e-6,
    num_heads=6, num_kv_heads=1, head_dim=256, rotary_dim=64, rope_theta=10000000.0,
    max_position_embeddings=4096, linear_num_k_heads=1, linear_num_v_heads=2, linear_k_head_dim=128,
    linear_v_head_dim=128, intermediate_size=256)
CONFIGS = {"tiny-qwen3.5": HYBRID_PRESETS["tiny-qwen3.5"], "next-dense": NEXT_DENSE, "wide": WIDE}
# Tested last (the tests that take them come last in this file): a fault in the MoE kernels poisons
# the context. tiny-qwen3.5-moe: every layer MoE, 8 experts, top 4.
MOE_CONFIGS = {name: HYBRID_PRESETS[name] for name in ("tiny-qwen3-next", "tiny-qwen3.5-moe")}
# The greedy-identity and Engine tests: a dense model, then an MoE one, with their seeds. On the
# reference, seed 5's MoE greedy run (4 lanes, 256 tokens) has no top-2 logit gap under 3e-4 of the
# largest logit and no router top-k cut closer than 1e-4: fp32 summation order cannot flip a choice.
GREEDY_CONFIGS = {"next-dense": (NEXT_DENSE, 7), "tiny-qwen3.5-moe": (HYBRID_PRESETS["tiny-qwen3.5-moe"], 5)}
PAGE, MAX_CTX, BATCH, EXTRA_SLOTS = 16, 512, 4, 2
PAGES_PER_LANE = MAX_CTX // PAGE


def _artifact(tmp_path_factory, name, config, seed):
    from ninfer.artifact import open_artifact

    path = tmp_path_factory.mktemp("hybrid") / f"{name}.ninfer"
    make_random_artifact(path, config, seed=seed)
    return open_artifact(path)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def artifact(request, tmp_path_factory):
    return _artifact(tmp_path_factory, request.param, CONFIGS[request.param], 5)


@pytest.fixture(scope="module")
def next_artifact(tmp_path_factory):
    return _artifact(tmp_path_factory, "next", NEXT_DENSE, 7)


@pytest.fixture(scope="module", params=list(GREEDY_CONFIGS))
def greedy_artifact(request, tmp_path_factory):
    return _artifact(tmp_path_factory, request.param, *GREEDY_CONFIGS[request.param])


def _runners(artifact, kv_dtype="f32", cuda_graph=True, prefill_gemm="fp32"):
    from ninfer.backends.cuda.hybrid_runner import CudaHybridRunner

    kw = dict(page_size=PAGE, num_pages=BATCH * PAGES_PER_LANE + 4, max_batch=BATCH, max_context=MAX_CTX,
              state_slots=EXTRA_SLOTS)
    return HybridRunner(artifact, **kw), CudaHybridRunner(artifact, kv_dtype=kv_dtype, cuda_graph=cuda_graph,
                                                          max_prefill_rows=64, prefill_gemm=prefill_gemm, **kw)


def _table(lane):
    return (np.arange(PAGES_PER_LANE) * BATCH + lane).astype(np.int32)


def _greedy(lane, step=0):
    return SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
                       frequency_penalty=0.0, seed=0, step=step)


def _prompt(lane, n, vocab):
    return ((np.arange(n) * 37 + lane * 101 + 5) % vocab).astype(np.int32)


# -- kernels ------------------------------------------------------------------------------------

NK, NV, DH = 2, 4, 128
KEY_DIM, VALUE_DIM = NK * DH, NV * DH
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
IN_SIZE = CONV_DIM + VALUE_DIM + 2 * NV


def _reference_rule(mixed, proj, state, dt_bias, a_log, norm, eps, decode):
    rows = mixed.shape[0]
    q = ref.l2_normalize(mixed[:, :KEY_DIM].reshape(rows, NK, DH)) * np.float32(DH ** -0.5)
    k = ref.l2_normalize(mixed[:, KEY_DIM:2 * KEY_DIM].reshape(rows, NK, DH))
    v = mixed[:, 2 * KEY_DIM:].reshape(rows, NV, DH)
    q, k = np.repeat(q, NV // NK, axis=1), np.repeat(k, NV // NK, axis=1)
    z = proj[:, CONV_DIM:CONV_DIM + VALUE_DIM].reshape(rows, NV, DH)
    b, a = proj[:, CONV_DIM + VALUE_DIM:CONV_DIM + VALUE_DIM + NV], proj[:, CONV_DIM + VALUE_DIM + NV:]
    beta, g = ref.sigmoid(b), -np.exp(a_log) * ref.softplus(a + dt_bias)
    if decode:
        o, s = ref.recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state)
        o = o[:, 0]
    else:
        o, s = ref.chunked(q, k, v, g, beta, state)
    return ref.gated_rms_norm(o, z, norm, eps).reshape(rows, VALUE_DIM), s


@pytest.mark.parametrize("decode", [False, True])
def test_conv_kernel_matches_the_reference(decode):
    """The conv over a prefill sequence (its tail updated in place) and a decode step of three lanes out
    of order (each tail written to another slot, pipelined decode: the slots read stay as they were)."""
    gpu, rng = Gpu(), np.random.default_rng(1)
    rows, slots = (3, 8) if decode else (70, 4)
    lanes = np.array([3, 0, 2] if decode else [2], np.int32)
    lanes_out = lanes + 4 if decode else lanes
    x = rng.standard_normal((rows, IN_SIZE)).astype(np.float32)
    weight = rng.standard_normal((CONV_DIM, 4)).astype(np.float32)
    states = rng.standard_normal((slots, 3, CONV_DIM)).astype(np.float32)
    d_states, out = gpu.put(states), gpu.empty(rows * CONV_DIM * 4)
    seqs, seq_rows = (rows, 1) if decode else (1, rows)
    gpu.launch("deltanet_conv", (-(-CONV_DIM // 128), seqs), (128,),
               (out, gpu.put(x), IN_SIZE, d_states, 3 * CONV_DIM, gpu.put(lanes), gpu.put(lanes_out), seq_rows,
                CONV_DIM, gpu.put(weight)))
    got, got_states = gpu.get(out, np.float32, (rows, CONV_DIM)), gpu.get(d_states, np.float32, states.shape)
    if decode:
        want, want_state = ref.conv_step(x[:, :CONV_DIM], states[lanes], weight)
    else:
        want, want_state = ref.conv_prefill(x[:, :CONV_DIM], states[lanes[0]], weight)
    assert rel_err(got, silu(want)) < 1e-6
    np.testing.assert_array_equal(got_states[lanes_out], want_state.reshape(got_states[lanes_out].shape))
    untouched = np.setdiff1d(np.arange(slots), lanes_out)
    np.testing.assert_array_equal(got_states[untouched], states[untouched])


@pytest.mark.parametrize("decode", [False, True])
def test_delta_rule_kernel_matches_the_reference(decode):
    """The rule over a prefill sequence (state in place) and a decode step of three lanes out of order
    (each state written to another slot, the slots read left as they were)."""
    gpu, rng = Gpu(), np.random.default_rng(2)
    rows, slots = (3, 8) if decode else (100, 4)
    lanes = np.array([1, 3, 0] if decode else [2], np.int32)
    lanes_out = lanes + 4 if decode else lanes
    mixed = rng.standard_normal((rows, CONV_DIM)).astype(np.float32)
    proj = rng.standard_normal((rows, IN_SIZE)).astype(np.float32)
    states = (rng.standard_normal((slots, NV, DH, DH)) * 0.1).astype(np.float32)
    dt_bias, a_log = rng.standard_normal(NV).astype(np.float32), rng.standard_normal(NV).astype(np.float32)
    norm = rng.standard_normal(DH).astype(np.float32)
    d_states, out = gpu.put(states), gpu.empty(rows * VALUE_DIM * 4)
    seqs, seq_rows = (rows, 1) if decode else (1, rows)
    gpu.launch(f"deltanet_rule_k{DH}_v{DH}", (NV, seqs), (2 * DH,),
               (gpu.put(mixed), gpu.put(proj), out, d_states, NV * DH * DH, gpu.put(lanes), gpu.put(lanes_out),
                seq_rows, NK, NV, IN_SIZE, gpu.put(dt_bias), gpu.put(a_log), gpu.put(norm), 1e-6))
    got, got_states = gpu.get(out, np.float32, (rows, VALUE_DIM)), gpu.get(d_states, np.float32, states.shape)
    start = states[lanes] if decode else states[lanes[0]]
    want, want_state = _reference_rule(mixed, proj, start, dt_bias, a_log, norm, 1e-6, decode)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got_states[lanes_out], want_state.reshape(got_states[lanes_out].shape)) < 1e-5
    untouched = np.setdiff1d(np.arange(slots), lanes_out)
    np.testing.assert_array_equal(got_states[untouched], states[untouched])


@pytest.mark.parametrize("nk, nv", [(NK, NV), (1, 3)])
def test_fused_step_is_conv_then_rule(nk, nv):
    """``deltanet_step`` (``HybridForward.fused_step``) against ``deltanet_conv`` + ``deltanet_rule``: two
    decode steps of three lanes (out of order), outputs and both states to fp32 rounding, the key heads'
    tickets back at zero. Not bit for bit here as in the simulator (tests/test_kernels_sim.py): with the
    conv's result in registers the compiler contracts its arithmetic differently (H100, 2026-12-05: a
    quarter of the outputs differ, by 5e-7 at most)."""
    gpu, rng = Gpu(), np.random.default_rng(3 + nv)
    key_dim, value_dim = nk * DH, nv * DH
    conv_dim = 2 * key_dim + value_dim
    in_size = conv_dim + value_dim + 2 * nv
    rows, slots, slot = 3, 4, 3 * conv_dim + nv * DH * DH
    lanes = gpu.put(np.array([2, 0, 3], np.int32))
    states = (rng.standard_normal(slots * slot) * 0.1).astype(np.float32)
    conv_w = gpu.put(rng.standard_normal(conv_dim * 4).astype(np.float32))
    dt_bias, a_log = (gpu.put(rng.standard_normal(nv).astype(np.float32)) for _ in range(2))
    norm, tickets = gpu.put(rng.standard_normal(DH).astype(np.float32)), gpu.put(np.zeros(rows * nk, np.int32))
    projs = [gpu.put(rng.standard_normal((rows, in_size)).astype(np.float32)) for _ in range(2)]
    runs = []
    for fused in (False, True):
        d_states, mixed, out = gpu.put(states), gpu.empty(rows * conv_dim * 4), gpu.empty(rows * value_dim * 4)
        outs = []
        for proj in projs:
            if fused:
                gpu.launch(f"deltanet_step_k{DH}_v{DH}", (nv, rows), (2 * DH,),
                           (proj, out, d_states, slot, lanes, lanes, nk, nv, in_size, conv_w, dt_bias, a_log, norm,
                            1e-6, tickets))
            else:
                gpu.launch("deltanet_conv", (-(-conv_dim // 128), rows), (128,),
                           (mixed, proj, in_size, d_states, slot, lanes, lanes, 1, conv_dim, conv_w))
                gpu.launch(f"deltanet_rule_k{DH}_v{DH}", (nv, rows), (2 * DH,),
                           (mixed, proj, out, d_states.at(3 * conv_dim * 4), slot, lanes, lanes, 1, nk, nv, in_size,
                            dt_bias, a_log, norm, 1e-6))
            outs.append(gpu.get(out, np.float32, (rows, value_dim)))
        runs.append((outs, gpu.get(d_states, np.float32, (slots * slot,))))
    for got, want in zip(runs[1][0] + [runs[1][1]], runs[0][0] + [runs[0][1]]):
        assert rel_err(got, want) < 1e-6
    assert not gpu.get(tickets, np.int32, (rows * nk,)).any()


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_rule_is_the_rule(splits):
    """``deltanet_rule_s{splits}`` (``HybridForward.rule_splits``) against ``deltanet_rule``: two decode
    steps of three lanes (out of order), outputs and states to fp32 rounding, the tickets back at zero."""
    gpu, rng = Gpu(), np.random.default_rng(30 + splits)
    nk, nv = NK, NV
    key_dim, value_dim = nk * DH, nv * DH
    conv_dim = 2 * key_dim + value_dim
    in_size = conv_dim + value_dim + 2 * nv
    rows, slots, slot = 3, 4, nv * DH * DH
    lanes = gpu.put(np.array([2, 0, 3], np.int32))
    states = (rng.standard_normal(slots * slot) * 0.1).astype(np.float32)
    dt_bias, a_log = (gpu.put(rng.standard_normal(nv).astype(np.float32)) for _ in range(2))
    norm, tickets = gpu.put(rng.standard_normal(DH).astype(np.float32)), gpu.put(np.zeros(rows * nv, np.int32))
    partials = gpu.empty(rows * nv * splits * 4)
    steps = [(gpu.put(rng.standard_normal((rows, conv_dim)).astype(np.float32)),
              gpu.put(rng.standard_normal((rows, in_size)).astype(np.float32))) for _ in range(2)]
    runs = []
    for split in (False, True):
        d_states, out = gpu.put(states), gpu.empty(rows * value_dim * 4)
        outs = []
        for mixed, proj in steps:
            if split:
                gpu.launch(f"deltanet_rule_s{splits}_k{DH}_v{DH}", (nv, rows, splits), (2 * DH // splits,),
                           (mixed, proj, out, d_states, slot, lanes, lanes, nk, nv, in_size, dt_bias, a_log, norm,
                            1e-6, partials, tickets))
            else:
                gpu.launch(f"deltanet_rule_k{DH}_v{DH}", (nv, rows), (2 * DH,),
                           (mixed, proj, out, d_states, slot, lanes, lanes, 1, nk, nv, in_size, dt_bias, a_log, norm,
                            1e-6))
            outs.append(gpu.get(out, np.float32, (rows, value_dim)))
        runs.append((outs, gpu.get(d_states, np.float32, (slots * slot,))))
    for got, want in zip(runs[1][0] + [runs[1][1]], runs[0][0] + [runs[0][1]]):
        assert rel_err(got, want) < 1e-6
    assert not gpu.get(tickets, np.int32, (rows * nv,)).any()


@pytest.mark.parametrize("build", ["", "p4", "p4n"])
def test_out_gemv_scaling_the_split_rule_is_the_ticketed_rule(build):
    """``deltanet_rule_s2u`` + ``gemv_residual_headnorm_m1{build}`` (``HybridForward.rule_norm_in_gemv``)
    against ``deltanet_rule_s2`` + ``gemv_residual_m1{build}`` at the 35B-A3B's head dim and widths:
    the residual stream and the states bit for bit (the lane's slots written out of place); the ``n``
    builds ask L2 for 1 MiB of the weights (``HybridForward.router_prefetch``)."""
    rows = 1
    from ninfer.artifact.bf16 import from_float32

    gpu, rng = Gpu(), np.random.default_rng(60 + rows)
    nk, nv, hidden = 16, 32, 2048
    key_dim, value_dim = nk * DH, nv * DH
    conv_dim = 2 * key_dim + value_dim
    in_size = conv_dim + value_dim + 2 * nv
    slot = nv * DH * DH
    lanes = gpu.put(np.arange(rows, 0, -1, dtype=np.int32))
    lanes_out = gpu.put(np.arange(rows, dtype=np.int32) + rows + 1)
    states = (rng.standard_normal((2 * rows + 1) * slot) * 0.1).astype(np.float32)
    dt_bias, a_log = (gpu.put(rng.standard_normal(nv).astype(np.float32)) for _ in range(2))
    norm, tickets = gpu.put(rng.standard_normal(DH).astype(np.float32)), gpu.put(np.zeros(rows * nv, np.int32))
    mixed = gpu.put(rng.standard_normal((rows, conv_dim)).astype(np.float32))
    proj = gpu.put(rng.standard_normal((rows, in_size)).astype(np.float32))
    w = gpu.put(from_float32((rng.standard_normal((hidden, value_dim)) * value_dim ** -0.5).astype(np.float32)))
    y0 = rng.standard_normal((rows, hidden)).astype(np.float32)
    runs = []
    for unscaled in (False, True):
        d_states, out, y = gpu.put(states), gpu.empty(rows * value_dim * 4), gpu.put(y0)
        partials = gpu.empty(rows * nv * 2 * 4)
        args = (mixed, proj, out, d_states, slot, lanes, lanes_out, nk, nv, in_size, dt_bias, a_log, norm, 1e-6,
                partials)
        gpu.launch(f"deltanet_rule_s2{'u' if unscaled else ''}_k{DH}_v{DH}", (nv, rows, 2), (DH,),
                   args if unscaled else args + (tickets,))
        gemv = f"gemv_residual_{'headnorm_' if unscaled else ''}m{rows}{build}"
        gemv_args = (y, out, w, norm, rows, hidden, value_dim, hidden, 1e-6) + ((partials, 2, DH) if unscaled else ())
        gemv_args += (w, 1 << 20) if build.endswith("n") else ()
        gpu.launch(gemv, (hidden // 4,), (128,), gemv_args)
        runs.append((gpu.get(y, np.float32, (rows, hidden)), gpu.get(d_states, np.float32, states.shape)))
    (y_a, states_a), (y_b, states_b) = runs
    assert np.array_equal(y_a, y_b) and np.array_equal(states_a, states_b)
    assert (y_b != y0).all() and (states_b != states).any()
    assert not gpu.get(tickets, np.int32, (rows * nv,)).any()


def test_prefill_delta_rule_pipeline_matches_the_reference():
    """prep (norms, gates) -> scan (the recurrence) -> gated norm, over one sequence."""
    gpu, rng = Gpu(), np.random.default_rng(3)
    rows, slots, lane = 130, 3, 1
    mixed = rng.standard_normal((rows, CONV_DIM)).astype(np.float32)
    proj = rng.standard_normal((rows, IN_SIZE)).astype(np.float32)
    states = (rng.standard_normal((slots, NV, DH, DH)) * 0.1).astype(np.float32)
    dt_bias, a_log = rng.standard_normal(NV).astype(np.float32), rng.standard_normal(NV).astype(np.float32)
    norm = rng.standard_normal(DH).astype(np.float32)
    d_mixed, d_proj, d_states = gpu.put(mixed), gpu.put(proj), gpu.put(states)
    qk, gates = gpu.empty(rows * 2 * KEY_DIM * 4), gpu.empty(rows * 2 * NV * 4)
    o_raw, out = gpu.empty(rows * VALUE_DIM * 4), gpu.empty(rows * VALUE_DIM * 4)
    prep, scan = gpu.kernels[f"deltanet_prep_k{DH}"], gpu.kernels[f"deltanet_scan_k{DH}_v{DH}"]
    gpu.launch(prep.name, (rows, NK + 1), (prep.meta["threads"],),
               (qk, gates, d_mixed, d_proj, NK, NV, IN_SIZE, gpu.put(dt_bias), gpu.put(a_log)))
    gpu.launch(scan.name, (NV, scan.meta["splits"], 1), (scan.meta["threads"],),
               (qk, gates, d_mixed, o_raw, d_states, NV * DH * DH, gpu.put(np.array([lane], np.int32)), rows, NK, NV))
    gpu.launch(f"deltanet_gated_norm_v{DH}", (rows, NV), (DH,),
               (out, o_raw, d_proj, IN_SIZE, NK, NV, gpu.put(norm), 1e-6))
    want, want_state = _reference_rule(mixed, proj, states[lane], dt_bias, a_log, norm, 1e-6, False)
    assert rel_err(gpu.get(out, np.float32, (rows, VALUE_DIM)), want) < 1e-5
    got_states = gpu.get(d_states, np.float32, states.shape)
    assert rel_err(got_states[lane], want_state) < 1e-5
    np.testing.assert_array_equal(got_states[[0, 2]], states[[0, 2]])


# -- the runner ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype, tol", [("f32", 1e-3), ("bf16", 3e-2)])
def test_prefill_and_decode_logits_match_the_reference(artifact, kv_dtype, tol):
    _check_logits(artifact, kv_dtype, tol)


def test_tuned_cublaslt_prefill_matches_the_reference(artifact, monkeypatch):
    """``ninfer serve``'s prefill GEMMs: cuBLASLt on bf16 activations, their algorithms timed at
    startup (TUNE_MIN_ROWS lowered to this test's 64-row sub-chunks), which prefills lane 0 once: the
    lanes checked include it."""
    from ninfer.backends.cuda import cublaslt

    monkeypatch.setattr(cublaslt, "TUNE_MIN_ROWS", 64)
    _check_logits(artifact, "bf16", 5e-2, prefill_gemm="cublaslt-tuned")


def _check_logits(artifact, kv_dtype, tol, prefill_gemm="fp32"):
    reference, cuda = _runners(artifact, kv_dtype=kv_dtype, prefill_gemm=prefill_gemm)
    assert bool(cuda.startup.get("prefill_gemm_tuning", {}).get("gemms")) == (prefill_gemm == "cublaslt-tuned")
    try:
        vocab = reference.info.vocab_size
        for lane, n in ((0, 150), (2, 37)):  # 150 rows: three prefill sub-chunks of 64
            chunk = PrefillChunk(lane=lane, tokens=_prompt(lane, n, vocab), start=0, page_table=_table(lane),
                                 return_logits=True)
            want, got = reference.prefill(chunk).logits, cuda.prefill(chunk).logits
            assert rel_err(got, want) < tol, (lane, rel_err(got, want))
        positions = np.array([150, 37])
        for step in range(3):
            batch = DecodeBatch(lanes=np.array([0, 2]), tokens=np.array([5 + step, 9 + step]),
                                positions=positions + step, page_tables=np.stack([_table(0), _table(2)]),
                                sampling=[_greedy(0, step), _greedy(2, step)], return_logits=True)
            want, got = reference.decode(batch), cuda.decode(batch)
            assert rel_err(got.logits, want.logits) < tol, (step, rel_err(got.logits, want.logits))
        for lane in (0, 2):
            assert rel_err(cuda.read_state(lane), reference.read_state(lane)) < 10 * tol
    finally:
        cuda.close()


def _generate(runner, lanes, prompts, steps):
    """Greedy: prefill each lane, then ``steps`` decode steps of all lanes together."""
    outs = {lane: [] for lane in lanes}
    last = {}
    for lane in lanes:
        r = runner.prefill(PrefillChunk(lane=lane, tokens=prompts[lane], start=0, page_table=_table(lane),
                                        sample=_greedy(lane)))
        last[lane] = int(r.tokens[0])
        outs[lane].append(last[lane])
    for step in range(steps):
        batch = DecodeBatch(lanes=np.array(lanes), tokens=np.array([last[la] for la in lanes]),
                            positions=np.array([len(prompts[la]) + step for la in lanes]),
                            page_tables=np.stack([_table(la) for la in lanes]),
                            sampling=[_greedy(la, step + 1) for la in lanes])
        for lane, token in zip(lanes, runner.decode(batch).tokens.tolist()):
            last[lane] = token
            outs[lane].append(token)
    return outs


def test_state_images_read_write_copy_are_exact(next_artifact):
    _, cuda = _runners(next_artifact)
    try:
        vocab = cuda.info.vocab_size
        assert cuda.num_state_slots == BATCH + EXTRA_SLOTS
        prompt = _prompt(0, 40, vocab)
        cuda.prefill(PrefillChunk(lane=0, tokens=prompt, start=0, page_table=_table(0)))
        image = cuda.read_state(0)
        assert image.shape == (cuda.state_floats,) and image.dtype == np.float32 and np.abs(image).max() > 0
        cuda.copy_state(0, BATCH)  # lane -> checkpoint slot
        np.testing.assert_array_equal(cuda.read_state(BATCH), image)
        assert cuda.state_length(BATCH) == 40
        noise = np.random.default_rng(0).standard_normal(cuda.state_floats).astype(np.float32)
        cuda.write_state(BATCH + 1, noise)
        np.testing.assert_array_equal(cuda.read_state(BATCH + 1), noise)
        assert cuda.state_length(BATCH + 1) == -1
        # Continue lane 0 after its state was saved; restore it into lane 3 with the KV pages copied:
        # both continue identically.
        first = _decode_some(cuda, 0, prompt, 6)
        cuda.copy_pages(_table(0)[:3].tolist(), _table(3)[:3].tolist())
        cuda.copy_state(BATCH, 3)
        assert _decode_some(cuda, 3, prompt, 6) == first
        with pytest.raises(ValueError, match="summarises"):
            cuda.prefill(PrefillChunk(lane=3, tokens=prompt[:4], start=10, page_table=_table(3)))
    finally:
        cuda.close()


def test_state_images_and_pages_round_trip_through_the_pinned_host_arena(next_artifact):
    """host_arena_state_images adds whole StateImages to the arena; read_state / read_pages land in it
    and write_state / write_pages copy from it, bit-exact against the staging path."""
    import gc

    from ninfer.backends.cuda.hybrid_runner import CudaHybridRunner

    kw = dict(page_size=PAGE, num_pages=BATCH * PAGES_PER_LANE + 4, max_batch=BATCH, max_context=MAX_CTX,
              state_slots=EXTRA_SLOTS)
    cuda = CudaHybridRunner(next_artifact, cuda_graph=False, max_prefill_rows=64, host_arena_bytes=1 << 20,
                            host_arena_state_images=2, **kw)
    try:
        arena = cuda.host_arena
        assert cuda.startup["host_arena_bytes"] == (1 << 20) + 2 * cuda.state_bytes == arena.nbytes
        prompt = _prompt(0, 40, cuda.info.vocab_size)
        cuda.prefill(PrefillChunk(lane=0, tokens=prompt, start=0, page_table=_table(0)))
        image, pages = cuda.read_state(0), cuda.read_pages(_table(0)[:3].tolist())
        assert arena.contains(image) and arena.contains(pages.transpose(2, 1, 0, 4, 3, 5))
        arena_copy, cuda.host_arena = cuda.host_arena, None
        staged_image, staged_pages = cuda.read_state(0), cuda.read_pages(_table(0)[:3].tolist())
        cuda.host_arena = arena_copy
        np.testing.assert_array_equal(image, staged_image)
        np.testing.assert_array_equal(pages, staged_pages)
        cuda.write_state(BATCH + 1, image, length=40)
        cuda.write_pages(_table(3)[:3].tolist(), pages)
        np.testing.assert_array_equal(cuda.read_state(BATCH + 1), staged_image)
        np.testing.assert_array_equal(cuda.read_pages(_table(3)[:3].tolist()), staged_pages)
        assert cuda.state_length(BATCH + 1) == 40 and cuda.host_arena_fallbacks == 0
        # Lane 3 restored from the arena continues exactly as lane 0.
        cuda.copy_state(BATCH + 1, 3)
        assert _decode_some(cuda, 3, prompt, 6) == _decode_some(cuda, 0, prompt, 6)
        del image, pages
        gc.collect()
        assert arena.used == 0
    finally:
        cuda.close()


def _decode_some(runner, lane, prompt, steps):
    token, out = int(prompt[-1]), []
    for step in range(steps):
        batch = DecodeBatch(lanes=np.array([lane]), tokens=np.array([token]), positions=np.array([len(prompt) + step]),
                            page_tables=_table(lane)[None], sampling=[_greedy(lane, step)])
        token = int(runner.decode(batch).tokens[0])
        out.append(token)
    return out


def test_graphs_and_direct_launches_agree(next_artifact):
    from ninfer.backends.cuda.hybrid_runner import CudaHybridRunner

    _, graphed = _runners(next_artifact)
    try:
        prompts = {lane: _prompt(lane, 30, graphed.info.vocab_size) for lane in range(2)}
        with_graphs = _generate(graphed, [0, 1], prompts, 20)
    finally:
        graphed.close()
    direct = CudaHybridRunner(next_artifact, page_size=PAGE, num_pages=BATCH * PAGES_PER_LANE + 4, max_batch=BATCH,
                              max_context=MAX_CTX, kv_dtype="f32", cuda_graph=False)
    try:
        assert _generate(direct, [0, 1], prompts, 20) == with_graphs
    finally:
        direct.close()


def test_greedy_256_tokens_alone_and_batched_match_the_reference(greedy_artifact):
    reference, cuda = _runners(greedy_artifact, kv_dtype="f32")
    try:
        vocab = reference.info.vocab_size
        prompts = {lane: _prompt(lane, 20 + 9 * lane, vocab) for lane in range(BATCH)}
        alone_ref = _generate(reference, [1], prompts, 255)
        alone_gpu = _generate(cuda, [1], prompts, 255)
        assert alone_gpu == alone_ref
        batched = _generate(cuda, list(range(BATCH)), prompts, 255)
        assert batched[1] == alone_gpu[1]
        assert batched == _generate(reference, list(range(BATCH)), prompts, 255)
    finally:
        cuda.close()


def test_one_row_moe_router_options_give_the_reference_tokens(tmp_path_factory):
    """A lane decoding alone on the MoE model with ``HybridForward.router_prefetch`` (the o / out GEMVs
    asking L2 for the router) and each ``CudaMoe.router_gemv`` build (the router as an fp32 GEMV), set
    before the decode graphs are captured: the reference's greedy tokens over 128 steps."""
    from ninfer.backends.cuda import moe
    from ninfer.backends.cuda.hybrid_forward import HybridForward

    name = "tiny-qwen3.5-moe"
    artifact = _artifact(tmp_path_factory, name, *GREEDY_CONFIGS[name])
    want = None
    defaults = HybridForward.router_prefetch, moe.CudaMoe.router_gemv
    for build in moe.ROUTER_GEMVS:
        HybridForward.router_prefetch, moe.CudaMoe.router_gemv = 1 << 20, build
        try:
            reference, cuda = _runners(artifact)
            captured = cuda.forward.router_prefetch, cuda.forward.moe.router_gemv
        finally:
            HybridForward.router_prefetch, moe.CudaMoe.router_gemv = defaults
        try:
            assert captured == (1 << 20, build)
            prompts = {1: _prompt(1, 29, reference.info.vocab_size)}
            want = want or _generate(reference, [1], prompts, 128)
            assert _generate(cuda, [1], prompts, 128) == want, build
        finally:
            cuda.close()


def test_every_decode_fusion_gives_the_same_tokens(greedy_artifact):
    """``fused_step``, ``merged_attention`` and, on a MoE model, ``fold_route`` / ``fold_combine`` (set
    before the decode graphs are captured): the greedy tokens of four lanes over 64 steps are those of
    the unfused runner (the simulator finds each step's values bit for bit the same; the GPU's test is
    that nothing there breaks them: tickets, fences, the order of blocks)."""
    from ninfer.backends.cuda import moe
    from ninfer.backends.cuda.hybrid_forward import HybridForward

    _, plain = _runners(greedy_artifact)
    try:
        prompts = {lane: _prompt(lane, 20 + 9 * lane, plain.info.vocab_size) for lane in range(BATCH)}
        want = _generate(plain, list(range(BATCH)), prompts, 64)
    finally:
        plain.close()
    fusions = [(HybridForward, "fused_step"), (HybridForward, "merged_attention"), (moe.CudaMoe, "fold_route"),
               (moe.CudaMoe, "fold_combine")]
    defaults = [getattr(owner, option) for owner, option in fusions]
    for owner, option in fusions:
        setattr(owner, option, True)
    try:
        _, fused = _runners(greedy_artifact)  # its decode graphs are captured with every fusion on
    finally:
        for (owner, option), value in zip(fusions, defaults):
            setattr(owner, option, value)
    for owner, option in fusions:  # and any launch outside them too
        target = fused.forward if owner is HybridForward else fused.forward.moe
        if target is not None:
            setattr(target, option, True)
    try:
        assert _generate(fused, list(range(BATCH)), prompts, 64) == want
    finally:
        fused.close()


@pytest.mark.parametrize("name, kv_dtype", [("wide", "bf16"), ("next-dense", "f32")])
def test_roped_attention_gives_the_three_launch_tokens(tmp_path_factory, name, kv_dtype):
    """``roped_attention`` (the decode attention's q/k norms, RoPE and append inside its split attention)
    against ``gated_qk_rope`` + ``gated_attention``: four lanes' greedy tokens over 40 steps and a last
    step's logits bit for bit (the simulator finds every value the same; here: the GPU's order of
    blocks, the loads before the grid wait). "wide" has head dim 256, 6 query heads a KV head."""
    artifact = _artifact(tmp_path_factory, f"{name}-roped", CONFIGS[name], 5)
    runs = []
    for roped in (False, True):
        _, runner = _runners(artifact, kv_dtype=kv_dtype)
        runner.forward.roped_attention = roped
        for rows, by_depth in runner.graphs.items():  # captured again with the option as set
            for graph in (g for pair in by_depth.values() for g in pair):
                graph.destroy()
            runner.graphs[rows] = runner._capture_decode(rows)
        try:
            prompts = {lane: _prompt(lane, 30 + 41 * lane, runner.info.vocab_size) for lane in range(BATCH)}
            tokens = _generate(runner, list(range(BATCH)), prompts, 40)
            batch = DecodeBatch(lanes=np.arange(BATCH), tokens=np.array([tokens[la][-1] for la in range(BATCH)]),
                                positions=np.array([len(prompts[la]) + 40 for la in range(BATCH)]),
                                page_tables=np.stack([_table(la) for la in range(BATCH)]),
                                sampling=[_greedy(la, 41) for la in range(BATCH)], return_logits=True)
            runs.append((tokens, runner.decode(batch).logits))
        finally:
            runner.close()
    (want, want_logits), (got, got_logits) = runs
    assert got == want
    assert np.array_equal(got_logits, want_logits)


# -- through the Engine -------------------------------------------------------------------------

def _engine_driver(artifact, **kw):
    from ninfer.backends.cuda.hybrid_runner import CudaHybridRunner
    from ninfer.engine import EngineConfig

    from tests.engine.conftest import CoreDriver

    base = dict(max_concurrency=2, max_context=160, kv_capacity=1024, prefill_chunk=24, page_size=16)
    base.update(kw)
    cfg = EngineConfig(**base)
    runner = CudaHybridRunner(artifact, page_size=cfg.page_size, num_pages=cfg.kv_pages, max_batch=cfg.max_concurrency,
                              max_context=cfg.max_context, state_slots=cfg.state_slots - cfg.max_concurrency,
                              kv_dtype="f32")
    return CoreDriver(cfg, runner=runner)


def _engine_prompt(i, n):
    return [(i * 31 + j * 17) % 900 + 3 for j in range(n)]


def _engine_alone(artifact, prompt, n):
    """The greedy output of ``prompt`` run alone through the Engine, nothing reused."""
    from tests.engine.conftest import out

    d = _engine_driver(artifact, max_concurrency=1, prefix_reuse=False, prefill_chunk=1024)
    try:
        s = d.submit(prompt, n)
        d.run()
        return out(s)
    finally:
        d.runner.close()


def test_engine_prefix_reuse_and_pauses_match_an_undisturbed_run(greedy_artifact):
    from tests.engine.conftest import end, out

    def alone(p, n):
        return _engine_alone(greedy_artifact, p, n)

    base = _engine_prompt(3, 45)
    d = _engine_driver(greedy_artifact, max_concurrency=1, device_state_slots=4)
    try:
        first = d.submit(base, 6)
        d.run()
        cont = base + out(first)[:-1] + [7, 8]
        second = d.submit(cont, 6)
        d.run()
        assert end(second).usage.cached_tokens == 45 + 5 and end(second).prefix_reuse_path == "checkpoint"
        assert out(second) == alone(cont, 6)
    finally:
        d.runner.close()
    for host_mib, route in ((16, "snapshot"), (0, "replay")):
        d = _engine_driver(greedy_artifact, max_concurrency=2, kv_capacity=96, max_context=96,
                           host_context_mib=host_mib, prefix_reuse=False)
        try:
            seqs = [d.submit(_engine_prompt(i, 40), 30) for i in range(2)]
            d.run()
            young = end(seqs[1]).scheduling
            assert young.preemptions >= 1
            assert (young.snapshot_restores if route == "snapshot" else young.replay_restores) >= 1
        finally:
            d.runner.close()
        for i, s in enumerate(seqs):
            assert out(s) == alone(_engine_prompt(i, 40), 30), route


def test_engine_turn_that_stops_with_a_step_launched_ahead_resumes_exactly(greedy_artifact):
    """Pipelined decode on the GPU: the step after a stop token runs, launched ahead, for the finished
    lane too, writing the lane's other StateImage; the turn's endpoint checkpoint is the state at its
    end, so the next turn resumes from it exactly."""
    from tests.engine.conftest import end, out

    d = _engine_driver(greedy_artifact, max_concurrency=1, device_state_slots=4)
    follows = []
    launch = d.runner.launch_decode
    d.runner.launch_decode = lambda batch, follow=False: (follows.append(follow), launch(batch, follow))[1]
    try:
        assert d.runner.info.pipelined_decode
        base = _engine_prompt(4, 45)
        free = _engine_alone(greedy_artifact, base, 8)
        stop = free[4]
        first = d.submit(base, 8, stop_ids={stop})
        d.run()
        answer = out(first)
        assert answer == free[: free.index(stop) + 1] and follows[-1]
        cont = base + answer + [7, 8]
        second = d.submit(cont, 6)
        d.run()
        assert end(second).usage.cached_tokens == 45 + len(answer) - 1
        assert end(second).prefix_reuse_path == "checkpoint"
    finally:
        d.runner.close()
    assert out(second) == _engine_alone(greedy_artifact, cont, 6)


@pytest.mark.parametrize("kv_dtype, tol", [("f32", 1e-3), ("bf16", 3e-2)])
@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_moe_model_logits_match_the_reference(tmp_path_factory, name, kv_dtype, tol):
    _check_logits(_artifact(tmp_path_factory, name, MOE_CONFIGS[name], 5), kv_dtype, tol)


@pytest.mark.parametrize("name, kv_dtype", [("wide", "bf16"), ("next-dense", "f32"), ("tiny-qwen3.5-moe", "bf16")])
def test_prefill_graph_replays_the_same_pass(tmp_path_factory, name, kv_dtype):
    """Whole 64-row sub-chunks replay the prefill graph captured at startup (DeltaNet, gated
    attention, MoE): the same logits, KV pages and recurrent state, bit for bit, as the pass launched
    kernel by kernel. Last in the file: the MoE case runs the MoE kernels."""
    config = {**CONFIGS, **MOE_CONFIGS}[name]
    _, cuda = _runners(_artifact(tmp_path_factory, name, config, 5), kv_dtype=kv_dtype)
    try:
        assert cuda.graph_prefill_rows == 64 and cuda.startup["prefill_graph"]["nodes"] > 0
        captured = dict(cuda._prefill_graphs)  # at startup: the passes that end a prompt and that stop at its K/V
        assert {outputs for _, outputs, _ in captured} == {"last", "none"}
        prompt = _prompt(1, 150, cuda.info.vocab_size)  # 64 + 64 + 22 rows

        def prefill(graph: bool):
            cuda.graph_prefill_rows = 64 if graph else None
            chunk = PrefillChunk(lane=1, tokens=prompt, start=0, page_table=_table(1), return_logits=True)
            return cuda.prefill(chunk).logits, cuda.read_pages(_table(1)[:10].tolist()), cuda.read_state(1)

        want = prefill(False)
        for _ in range(2):  # every row's logits: the first pass captures its graph, the second replays it
            for got, expected in zip(prefill(True), want):
                np.testing.assert_array_equal(got, expected)
            graphs = dict(cuda._prefill_graphs)
            assert {outputs for _, outputs, _ in graphs} == {"all", "last", "none"}
            assert all(graphs[key] is graph for key, graph in captured.items())  # replayed, not captured again
            captured = graphs
        # A prompt whose logits nobody reads stops after the last layer's mixer: the same pages and state.
        cuda.prefill(PrefillChunk(lane=2, tokens=prompt, start=0, page_table=_table(2)))
        np.testing.assert_array_equal(cuda.read_pages(_table(2)[:10].tolist()), want[1])
        np.testing.assert_array_equal(cuda.read_state(2), want[2])
    finally:
        cuda.close()
