"""CudaRunner against the reference backend on tiny random Llama / Qwen3 artifacts (GPU only).

Tolerances: with an fp32 KV pool the two backends differ only by fp32 summation order, so logits
agree to 1e-4 relative and greedy tokens are identical; with the bf16 pool (the default) logits
agree to 2e-2 relative (bf16 keeps 8 mantissa bits of K and V); with prefill GEMMs on the tensor
cores (bf16 activations) to 3e-2.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from ninfer.artifact.bf16 import to_float32  # noqa: E402
from ninfer.backends.reference import ReferenceRunner  # noqa: E402
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow  # noqa: E402
from ninfer.convert.random_model import make_random_artifact  # noqa: E402
from ninfer.models.dense import DenseConfig  # noqa: E402

CONFIGS = {
    "llama": DenseConfig(architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=256, intermediate_size=512,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=10000.0, attention_bias=True),
    "qwen3": DenseConfig(architecture="Qwen3ForCausalLM", vocab_size=2048, hidden_size=256, intermediate_size=384,
                         num_layers=3, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, qk_norm=True),
}
# Tied embeddings make random models repeat one token, so the tied LM head only gets a logits test.
TIED = attrs.evolve(CONFIGS["qwen3"], tie_word_embeddings=True)
PAGE, MAX_CTX, BATCH = 16, 512, 8
PAGES_PER_LANE = MAX_CTX // PAGE


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def artifact(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / f"{request.param}.ninfer"
    make_random_artifact(path, CONFIGS[request.param], seed=3)
    from ninfer.artifact import open_artifact

    return open_artifact(path)


def _runners(artifact, kv_dtype="f32", cuda_graph=True, prefill_gemm="fp32"):
    from ninfer.backends.cuda import CudaRunner

    kw = dict(page_size=PAGE, num_pages=BATCH * PAGES_PER_LANE + 4, max_batch=BATCH, max_context=MAX_CTX)
    return ReferenceRunner(artifact, **kw), CudaRunner(artifact, kv_dtype=kv_dtype, cuda_graph=cuda_graph,
                                                       max_prefill_rows=64, prefill_gemm=prefill_gemm, **kw)


def _table(lane):
    # Lanes own interleaved, non-contiguous pages so page-table indexing is exercised.
    return (np.arange(PAGES_PER_LANE) * BATCH + lane).astype(np.int32)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kv_dtype,prefill_gemm,tol", [("f32", "fp32", 1e-4), ("bf16", "fp32", 2e-2),
                                                        ("f32", "cublaslt", 3e-2)])
def test_prefill_logits_match_reference(artifact, kv_dtype, prefill_gemm, tol):
    """cublaslt: prefill GEMMs on bf16 activations (tensor cores), hence the bf16-level tolerance."""
    ref, gpu = _runners(artifact, kv_dtype, prefill_gemm=prefill_gemm)
    try:
        prompt = np.random.default_rng(0).integers(0, ref.info.vocab_size, 150).astype(np.int32)
        # Two chunks (the second over a reused prefix), the first longer than max_prefill_rows.
        for start, stop in ((0, 100), (100, 150)):
            chunk = PrefillChunk(lane=1, tokens=prompt[start:stop], start=start, page_table=_table(1),
                                 return_logits=True)
            want = ref.prefill(chunk).logits
            got = gpu.prefill(chunk).logits
            assert _rel(got, want) < tol
        pages = _table(1)[:3]
        kv = gpu.read_pages(pages)  # the pool's own storage: bf16 pages come back as bit patterns
        assert kv.nbytes == 3 * gpu.page_bytes
        assert _rel(to_float32(kv) if kv.dtype == np.uint16 else kv, ref.read_pages(pages)) < tol
    finally:
        gpu.close()


def test_tuned_prefill_gemms_prefill_as_the_reference(artifact, monkeypatch):
    """cublaslt-tuned: startup prefills one sub-chunk in lane 0 and times every algorithm of each GEMM
    it ran over all the layers (TUNE_MIN_ROWS lowered to this test's 64-row sub-chunks); lane 0 then
    prefills like the reference. Fewer rows than asked for keep the heuristic's picks."""
    from ninfer.backends.cuda import cublaslt

    monkeypatch.setattr(cublaslt, "TUNE_MIN_ROWS", 64)
    ref, gpu = _runners(artifact, prefill_gemm="cublaslt-tuned")
    try:
        tuning = gpu.startup["prefill_gemm_tuning"]
        assert tuning["rows"] == 64 and tuning["seconds"] > 0
        gemms = tuning["gemms"]  # qkv, o, gate_up and down: four shapes of 64 rows
        assert len(gemms) == 4 and all(shape.startswith("64x") for shape in gemms), gemms
        for timed in gemms.values():
            assert 0 <= timed["chose"] < len(timed["ms"]) and 0 < timed["ms"][timed["chose"]] < float("inf")
        prompt = np.random.default_rng(1).integers(0, ref.info.vocab_size, 100).astype(np.int32)
        chunk = PrefillChunk(lane=0, tokens=prompt, start=0, page_table=_table(0), return_logits=True)
        assert _rel(gpu.prefill(chunk).logits, ref.prefill(chunk).logits) < 3e-2
        assert gpu.tune_prefill_gemms(min_rows=65) == {"rows": 64, "seconds": 0.0, "gemms": {}}
    finally:
        gpu.close()


@pytest.mark.parametrize("prefill_gemm", ["fp32", "cublaslt"])
def test_prefill_graph_replays_the_same_pass(artifact, prefill_gemm):
    """Whole sub-chunks replay the prefill graph captured at startup: the same logits and KV bits as
    the pass launched kernel by kernel. Once cuBLASLt's algorithms change (tuning), the next whole
    sub-chunk runs kernel by kernel and the one after is captured anew, again with the same bits."""
    _, gpu = _runners(artifact, "bf16", prefill_gemm=prefill_gemm)
    try:
        assert gpu.graph_prefill_rows == 64 and gpu.startup["prefill_graph"]["rows"] == 64
        assert gpu.startup["prefill_graph"]["nodes"] > 0
        prompt = np.random.default_rng(2).integers(0, gpu.info.vocab_size, 150).astype(np.int32)  # 64 + 64 + 22 rows

        def prefill(graph: bool):
            gpu.graph_prefill_rows = 64 if graph else None
            chunk = PrefillChunk(lane=1, tokens=prompt, start=0, page_table=_table(1), return_logits=True)
            return gpu.prefill(chunk).logits, gpu.read_pages(_table(1)[:10])

        assert gpu.startup["prefill_graph"]["kv_only_nodes"] > 0
        captured = dict(gpu._prefill_graphs)  # at startup: the passes that end a prompt and that stop at its K/V
        assert {outputs for _, outputs, _ in captured} == {"last", "none"}
        want = prefill(False)
        for got, expected in zip(prefill(True), want):
            np.testing.assert_array_equal(got, expected)
        graphs = dict(gpu._prefill_graphs)  # every row's logits: launched first, then captured
        assert {outputs for _, outputs, _ in graphs} == {"all", "last", "none"}
        assert all(graphs[key] is graph for key, graph in captured.items())
        for got, expected in zip(prefill(True), want):
            np.testing.assert_array_equal(got, expected)
        assert gpu._prefill_graphs == graphs  # replayed, not captured again
        if prefill_gemm == "cublaslt":
            before = gpu.forward.lt.generation
            gpu.tune_prefill_gemms(min_rows=0)  # plans again with more algorithms, picks the fastest
            assert gpu.forward.lt.generation > before
            want = prefill(False)
            for got, expected in zip(prefill(True), want):
                np.testing.assert_array_equal(got, expected)
            assert list(gpu._prefill_graphs) == [(64, "all", gpu.forward.lt.generation)]  # the stale ones went
            assert all(graph is not old for graph in gpu._prefill_graphs.values() for old in captured.values())
    finally:
        gpu.close()


@pytest.mark.parametrize("graph", [True, False])
@pytest.mark.parametrize("length", [150, 128])  # the sampled sub-chunk: 22 rows (launched), a whole 64
def test_a_prefill_to_its_last_row_writes_the_same_kv_and_hidden_state(artifact, graph, length):
    """A prompt that samples runs its sub-chunks in the middle up to the last layer's K/V append and its
    last sub-chunk's last layer past it for the last row alone (``Forward.layers``' ``outputs``): the
    KV pages bit for bit those of a pass with every row's logits, the last row's hidden state as that
    pass's to bf16 precision (one-row GEMMs add in another order), and the sampled token the
    logits' best but for a near tie."""
    from ninfer.backends.cuda import runtime as rt

    _, gpu = _runners(artifact, "bf16", prefill_gemm="cublaslt")
    try:
        gpu.graph_prefill_rows = 64 if graph else None
        prompt = np.random.default_rng(3).integers(0, gpu.info.vocab_size, length).astype(np.int32)
        hidden = gpu.config.hidden_size
        last_row = gpu.buffers.h.at((length - 1) % 64 * hidden * 4, hidden * 4)

        def read_hidden():
            h = np.empty(hidden, np.float32)
            rt.copy_d2h(h, last_row, gpu.stream)
            rt.synchronize(gpu.stream)
            return h

        gpu.bind_lane(2, [])
        token = int(gpu.prefill(PrefillChunk(lane=2, tokens=prompt, start=0, page_table=_table(2),
                                             sample=SamplingRow())).tokens[0])
        got = read_hidden()
        full = gpu.prefill(PrefillChunk(lane=1, tokens=prompt, start=0, page_table=_table(1), return_logits=True))
        np.testing.assert_array_equal(gpu.read_pages(_table(2)[:10]), gpu.read_pages(_table(1)[:10]))
        assert _rel(got, read_hidden()) < 1e-2
        logits = full.logits[-1]
        assert logits[token] >= logits.max() - 1e-2 * np.abs(logits).max()
    finally:
        gpu.close()


def test_tied_lm_head_logits(tmp_path):
    from ninfer.artifact import open_artifact

    make_random_artifact(tmp_path / "tied.ninfer", TIED, seed=4)
    ref, gpu = _runners(open_artifact(tmp_path / "tied.ninfer"))
    try:
        chunk = PrefillChunk(lane=0, tokens=np.arange(70, dtype=np.int32), start=0, page_table=_table(0),
                             return_logits=True)
        assert _rel(gpu.prefill(chunk).logits, ref.prefill(chunk).logits) < 1e-4
    finally:
        gpu.close()


def _generate(runner, prompts, steps, sampling, pipelined=False):
    """Prefill each prompt on its own lane, then decode all lanes together for ``steps`` steps.
    ``pipelined``: each step after the first is launched before the one before it is read, its
    input tokens taken on the device (``launch_decode(follow=True)``)."""
    outputs = []
    for lane, prompt in enumerate(prompts):
        runner.bind_lane(lane, [])
        first = runner.prefill(PrefillChunk(lane=lane, tokens=prompt, start=0, page_table=_table(lane),
                                            sample=sampling(lane, 0)))
        outputs.append([int(first.tokens[0])])
    lanes = np.arange(len(prompts), dtype=np.int32)

    def batch(step):
        return DecodeBatch(
            lanes=lanes, tokens=np.array([o[-1] for o in outputs], np.int32),
            positions=np.array([len(p) + step - 1 for p in prompts], np.int32),
            page_tables=np.stack([_table(lane) for lane in lanes]),
            sampling=[sampling(int(lane), step) for lane in lanes])

    if pipelined and steps > 1:
        runner.launch_decode(batch(1))
    for step in range(1, steps):
        if not pipelined:
            result = runner.decode(batch(step))
        else:
            if step + 1 < steps:
                runner.launch_decode(batch(step + 1), follow=True)
            result = runner.finish_decode()
        for o, t in zip(outputs, result.tokens):
            o.append(int(t))
    return outputs


def test_greedy_256_tokens_alone_identical(artifact):
    ref, gpu = _runners(artifact)
    try:
        prompt = [np.random.default_rng(5).integers(0, ref.info.vocab_size, 20).astype(np.int32)]
        greedy = lambda lane, step: SamplingRow()  # noqa: E731
        want = _generate(ref, prompt, 256, greedy)
        got = _generate(gpu, prompt, 256, greedy)
        assert got == want
        assert len(set(want[0])) > 5  # the model does not collapse onto one token
    finally:
        gpu.close()


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_batch_of_8_mixed_lengths_identical(artifact, cuda_graph):
    ref, gpu = _runners(artifact, cuda_graph=cuda_graph)
    try:
        rng = np.random.default_rng(9)
        prompts = [rng.integers(0, ref.info.vocab_size, n).astype(np.int32) for n in (1, 3, 17, 40, 64, 90, 200, 255)]
        greedy = lambda lane, step: SamplingRow()  # noqa: E731
        assert _generate(gpu, prompts, 256, greedy) == _generate(ref, prompts, 256, greedy)
    finally:
        gpu.close()


@pytest.mark.parametrize("rows", [3, 8])
def test_batch_with_chained_norms_identical(artifact, rows):
    """Steps of 3-8 rows with their norms chained from GEMM to GEMM (``Forward.chain_norm``: the
    residual GEMMs write the next norm's input) decode the reference's tokens too."""
    ref, gpu = _runners(artifact, cuda_graph=False)
    gpu.forward.chain_norm = True
    try:
        rng = np.random.default_rng(11)
        lengths = (2, 5, 9, 33, 70, 128, 180, 250)[-rows:]
        prompts = [rng.integers(0, ref.info.vocab_size, n).astype(np.int32) for n in lengths]
        greedy = lambda lane, step: SamplingRow()  # noqa: E731
        assert _generate(gpu, prompts, 64, greedy) == _generate(ref, prompts, 64, greedy)
    finally:
        gpu.close()


def test_seeded_sampling_with_penalties_matches_reference(artifact):
    ref, gpu = _runners(artifact)
    try:
        rng = np.random.default_rng(11)
        prompts = [rng.integers(0, ref.info.vocab_size, n).astype(np.int32) for n in (5, 30, 12)]

        def sampling(lane, step):
            return SamplingRow(temperature=0.8, top_p=0.95, min_p=0.02, top_k=0, presence_penalty=0.3,
                               frequency_penalty=0.2, seed=1000 + lane, step=step)

        assert _generate(gpu, prompts, 40, sampling) == _generate(ref, prompts, 40, sampling)
    finally:
        gpu.close()


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_pipelined_decode_matches_reference(artifact, cuda_graph):
    """Two steps in flight, the second fed the first's tokens on the device: the tokens (and the
    penalty counts they feed) are those of the reference one step at a time."""
    ref, gpu = _runners(artifact, cuda_graph=cuda_graph)
    try:
        rng = np.random.default_rng(12)
        prompts = [rng.integers(0, ref.info.vocab_size, n).astype(np.int32) for n in (7, 33, 2, 60)]

        def sampling(lane, step):
            return SamplingRow(temperature=0.9, top_k=0, presence_penalty=0.5, frequency_penalty=0.4,
                               seed=77 + lane, step=step)

        want = _generate(ref, prompts, 40, sampling)
        assert _generate(gpu, prompts, 40, sampling, pipelined=True) == want
        with pytest.raises(ValueError, match="lanes of the step in flight"):
            gpu.launch_decode(DecodeBatch(lanes=np.array([0]), tokens=np.array([1]), positions=np.array([0]),
                                          page_tables=_table(0)[None], sampling=[SamplingRow()]), follow=True)
    finally:
        gpu.close()


def test_pages_copy_and_round_trip(artifact):
    ref, gpu = _runners(artifact, kv_dtype="bf16")
    try:
        prompt = np.arange(40, dtype=np.int32) % ref.info.vocab_size
        gpu.prefill(PrefillChunk(lane=0, tokens=prompt, start=0, page_table=_table(0)))
        data = gpu.read_pages([0, 8])
        assert data.dtype == np.uint16 and data.nbytes == 2 * gpu.page_bytes  # bf16 stays bf16
        gpu.copy_pages([0, 8], [200, 201])
        assert np.array_equal(gpu.read_pages([200, 201]), data)
        gpu.write_pages([202, 203], data[:, :, ::-1].copy())
        assert np.array_equal(gpu.read_pages([203, 202]), data)
        gpu.copy_pages([202, 203], [203, 202])  # overlapping: reads before writes
        assert np.array_equal(gpu.read_pages([202, 203]), data)
        with pytest.raises(ValueError, match="page ids must lie"):
            gpu.read_pages([10_000])
    finally:
        gpu.close()


def test_prefill_reports_its_device_interval(artifact):
    """request_done work.gpu_seconds: every prefill returns its stream interval, readable once the
    work ends (a chunk that does not sample returns before that); the open intervals stay bounded."""
    _, gpu = _runners(artifact)
    try:
        assert gpu.info.times_device
        prompt = np.arange(200, dtype=np.int32) % gpu.info.vocab_size
        first = gpu.prefill(PrefillChunk(lane=0, tokens=prompt[:100], start=0, page_table=_table(0)))
        last = gpu.prefill(PrefillChunk(lane=0, tokens=prompt[100:], start=100, page_table=_table(0),
                                        sample=SamplingRow()))
        assert 0 < first.device_interval.seconds() < 1 and 0 < last.device_interval.seconds() < 1
        assert first.device_interval.seconds() == first.device_interval.seconds()  # read once, kept
        unread = [gpu.prefill(PrefillChunk(lane=1, tokens=prompt[:8], start=0, page_table=_table(1))).device_interval
                  for _ in range(3 * gpu._intervals.limit)]
        assert len(gpu._intervals._open) <= gpu._intervals.limit
        assert all(0 < iv.seconds() < 1 for iv in unread)
    finally:
        gpu.close()


def test_pages_round_trip_through_the_pinned_host_arena(artifact):
    """With a Host arena, snapshots are carved from one pinned allocation: the device copies land in it
    and leave from it, bit-exact against the staging path; a full arena falls back to pageable."""
    import gc

    from ninfer.backends.cuda import CudaRunner

    kw = dict(page_size=PAGE, num_pages=BATCH * PAGES_PER_LANE + 4, max_batch=BATCH, max_context=MAX_CTX)
    gpu = CudaRunner(artifact, kv_dtype="bf16", cuda_graph=False, max_prefill_rows=64, **kw)
    try:
        gpu.attach_host_arena(4 * gpu.page_bytes)
        arena = gpu.host_arena
        assert gpu.startup["host_arena_bytes"] == 4 * gpu.page_bytes and arena.capacity >= 3 * gpu.page_bytes
        prompt = np.arange(40, dtype=np.int32) % gpu.info.vocab_size
        gpu.prefill(PrefillChunk(lane=0, tokens=prompt, start=0, page_table=_table(0)))
        pages = _table(0)[:3].tolist()

        def staged(pages):  # no arena: through staging, contiguous
            gpu.host_arena = None
            try:
                return gpu.read_pages(pages)
            finally:
                gpu.host_arena = arena

        data = gpu.read_pages(pages)
        assert data.dtype == np.uint16 and arena.contains(data.transpose(2, 1, 0, 4, 3, 5))
        want = staged(pages)
        assert want.flags.c_contiguous and np.array_equal(data, want)
        gpu.write_pages([200, 201, 202], data)  # straight from the arena
        assert np.array_equal(staged([200, 201, 202]), want)
        assert gpu.host_arena_fallbacks == 0
        more = gpu.read_pages(pages)  # three pages more than the arena holds beside `data`
        assert gpu.host_arena_fallbacks == 1 and not arena.contains(more) and np.array_equal(more, want)
        del data, more
        gc.collect()
        assert arena.used == 0
    finally:
        gpu.close()


def test_bad_requests_are_rejected_by_field(artifact):
    _, gpu = _runners(artifact, cuda_graph=False)
    try:
        with pytest.raises(ValueError, match="prefill tokens: token id"):
            gpu.prefill(PrefillChunk(lane=0, tokens=np.array([10**6], np.int32), start=0, page_table=_table(0)))
        with pytest.raises(ValueError, match="prefill_gemm must be one of"):
            _runners(artifact, prefill_gemm="tf32")
        with pytest.raises(ValueError, match="decode lanes must be distinct"):
            gpu.decode(DecodeBatch(lanes=np.array([1, 1]), tokens=np.array([1, 2]), positions=np.array([0, 0]),
                                   page_tables=np.stack([_table(1)] * 2), sampling=[SamplingRow()] * 2))
    finally:
        gpu.close()
