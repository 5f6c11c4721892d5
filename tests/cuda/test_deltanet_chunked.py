"""The chunked delta rule (deltanet_chunk_prep + deltanet_chunk_scan) on the GPU: the same o_raw and
final state as the per-token scan and the reference's chunked form, and a hybrid runner prefilling
with it (``HybridForward.chunked_rule``) greedy-decodes the reference's tokens. The CPU check of the
same kernels is tests/test_deltanet_chunked_sim.py (Numba's simulator)."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from ninfer.backends.reference import deltanet as ref  # noqa: E402
from ninfer.backends.reference.hybrid_runner import HybridRunner  # noqa: E402
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow  # noqa: E402
from ninfer.convert.random_model import HYBRID_PRESETS, make_random_artifact  # noqa: E402
from ninfer.models.hybrid import DENSE  # noqa: E402

from cuda_helpers import Gpu, rel_err  # noqa: E402

NK, NV = 2, 4
# test_cuda_hybrid.py's greedy model: tiny-qwen3-next with dense MLPs (DeltaNet: 2 key, 4 value heads of 16)
NEXT_DENSE = attrs.evolve(HYBRID_PRESETS["tiny-qwen3-next"], mlp_types=(DENSE,) * 4)


@pytest.mark.parametrize("dh, rows, seqs", [(128, 300, 1), (128, 64, 1), (128, 70, 2), (64, 200, 1),
                                            (32, 130, 1), (16, 100, 3)])
def test_chunked_rule_matches_the_scan_and_the_reference(dh, rows, seqs):
    gpu, rng = Gpu(), np.random.default_rng(11)
    key_dim, value_dim = NK * dh, NV * dh
    conv_dim = 2 * key_dim + value_dim
    in_size = conv_dim + value_dim + 2 * NV
    total, slots = rows * seqs, seqs + 2
    lanes = (np.arange(seqs, dtype=np.int32) * 2 + 1) % slots  # not 0 .. seqs - 1
    mixed = rng.standard_normal((total, conv_dim)).astype(np.float32)
    proj = rng.standard_normal((total, in_size)).astype(np.float32)
    states = (rng.standard_normal((slots, NV, dh, dh)) * 0.1).astype(np.float32)
    dt_bias, a_log = rng.standard_normal(NV).astype(np.float32), rng.standard_normal(NV).astype(np.float32)
    d_mixed, d_proj, d_lanes = gpu.put(mixed), gpu.put(proj), gpu.put(lanes)
    d_dt_bias, d_a_log = gpu.put(dt_bias), gpu.put(a_log)
    qk, gates = gpu.empty(total * 2 * key_dim * 4), gpu.empty(total * 2 * NV * 4)
    prep = gpu.kernels[f"deltanet_prep_k{dh}"]
    gpu.launch(prep.name, (total, NK + 1), (prep.meta["threads"],),
               (qk, gates, d_mixed, d_proj, NK, NV, in_size, d_dt_bias, d_a_log))
    # the per-token scan
    scan = gpu.kernels[f"deltanet_scan_k{dh}_v{dh}"]
    scan_states, scan_o = gpu.put(states), gpu.empty(total * value_dim * 4)
    gpu.launch(scan.name, (NV, scan.meta["splits"], seqs), (scan.meta["threads"],),
               (qk, gates, d_mixed, scan_o, scan_states, NV * dh * dh, d_lanes, rows, NK, NV))
    # the chunked form
    chunk_prep, chunk_scan = (gpu.kernels[f"deltanet_chunk_{k}_k{dh}_v{dh}"] for k in ("prep", "scan"))
    n_chunks = -(-rows // chunk_prep.meta["chunk"])
    scratch = gpu.empty(seqs * NV * n_chunks * chunk_prep.meta["chunk_floats"] * 4)
    chunk_states, chunk_o = gpu.put(states), gpu.empty(total * value_dim * 4)
    gpu.launch(chunk_prep.name, (NV, n_chunks, seqs), (chunk_prep.meta["threads"],),
               (scratch, qk, gates, d_mixed, d_proj, in_size, d_dt_bias, d_a_log, rows, NK, NV))
    gpu.launch(chunk_scan.name, (NV, chunk_scan.meta["splits"], seqs), (chunk_scan.meta["threads"],),
               (scratch, qk, chunk_o, chunk_states, NV * dh * dh, d_lanes, rows, NK, NV))
    got_o = gpu.get(chunk_o, np.float32, (seqs, rows, NV, dh))
    got_states = gpu.get(chunk_states, np.float32, states.shape)
    assert rel_err(got_o, gpu.get(scan_o, np.float32, got_o.shape)) < 1e-4
    assert rel_err(got_states, gpu.get(scan_states, np.float32, states.shape)) < 1e-4
    untouched = np.setdiff1d(np.arange(slots), lanes)
    np.testing.assert_array_equal(got_states[untouched], states[untouched])
    # and the reference's chunked form, from the prep's q / k
    qk_h = gpu.get(qk, np.float32, (seqs, rows, 2, NK, dh))
    v = mixed[:, 2 * key_dim:].reshape(seqs, rows, NV, dh)
    b = proj[:, conv_dim + value_dim:conv_dim + value_dim + NV].reshape(seqs, rows, NV)
    a = proj[:, conv_dim + value_dim + NV:].reshape(seqs, rows, NV)
    for s in range(seqs):
        q, k = (np.repeat(qk_h[s, :, i], NV // NK, axis=1) for i in (0, 1))
        g = -np.exp(a_log) * ref.softplus(a[s] + dt_bias)
        want_o, want_state = ref.chunked(q, k, v[s], g, ref.sigmoid(b[s]), states[lanes[s]])
        assert rel_err(got_o[s], want_o) < 1e-4
        assert rel_err(got_states[lanes[s]], want_state) < 1e-4


PAGE, MAX_CTX, BATCH = 16, 512, 2
PAGES_PER_LANE = MAX_CTX // PAGE


def _table(lane):
    return (np.arange(PAGES_PER_LANE) * BATCH + lane).astype(np.int32)


def _greedy(step=0):
    return SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
                       frequency_penalty=0.0, seed=0, step=step)


def _generate(runner, prompt, steps, lane=1):
    """Greedy: prefill (several chunks of up to max_prefill_rows), then ``steps`` decode steps."""
    r = runner.prefill(PrefillChunk(lane=lane, tokens=prompt, start=0, page_table=_table(lane), sample=_greedy()))
    out = [int(r.tokens[0])]
    for step in range(steps):
        batch = DecodeBatch(lanes=np.array([lane]), tokens=np.array([out[-1]]), positions=np.array([len(prompt) + step]),
                            page_tables=_table(lane)[None], sampling=[_greedy(step + 1)])
        out.append(int(runner.decode(batch).tokens[0]))
    return out


def test_runner_with_the_chunked_rule_greedy_matches_the_reference(tmp_path, monkeypatch):
    from ninfer.artifact import open_artifact
    from ninfer.backends.cuda.hybrid_forward import HybridForward
    from ninfer.backends.cuda.hybrid_runner import CudaHybridRunner

    path = tmp_path / "next.ninfer"
    make_random_artifact(path, NEXT_DENSE, seed=7)
    artifact = open_artifact(path)
    monkeypatch.setattr(HybridForward, "chunked_rule", True)  # the buffers carve its scratch
    kw = dict(page_size=PAGE, num_pages=BATCH * PAGES_PER_LANE + 4, max_batch=BATCH, max_context=MAX_CTX)
    reference = HybridRunner(artifact, **kw)
    cuda = CudaHybridRunner(artifact, kv_dtype="f32", max_prefill_rows=256, **kw)
    try:
        assert cuda.forward.chunked_rule and hasattr(cuda.buffers, "chunks")
        vocab = reference.info.vocab_size
        prompt = ((np.arange(200) * 37 + 5) % vocab).astype(np.int32)  # 4 chunks, the last partial
        assert _generate(cuda, prompt, 64) == _generate(reference, prompt, 64)
    finally:
        cuda.close()
