"""The reference backend's mechanics: chunked prefill, batched decode, page sizes, page copies,
sampling state and input checks. Correctness of the model itself is test_parity.py's job; here
every way of feeding the same tokens must give the same logits as the plainest way."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from ninfer.artifact.bf16 import from_float32, to_float32
from ninfer.backends.reference import ReferenceRunner
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow
from ninfer.backends.sampling import sample_row
from ninfer.convert.random_model import PRESETS, make_random_artifact, random_weight
from ninfer.models.dense import tensor_names

GREEDY = SamplingRow()
# Same math, different GEMM shapes: BLAS may sum in a different order.
RTOL, ATOL = 1e-4, 1e-4


def random_weights(preset: str, seed: int = 0) -> dict[str, np.ndarray]:
    return {n: random_weight(n, s, seed) for n, s in tensor_names(PRESETS[preset]).items()}


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def model(request):
    return PRESETS[request.param], random_weights(request.param)


def make_runner(model, *, page_size=8, num_pages=64, max_batch=8, max_context=256) -> ReferenceRunner:
    config, weights = model
    return ReferenceRunner.from_weights(config, weights, page_size=page_size, num_pages=num_pages,
                                        max_batch=max_batch, max_context=max_context)


def prompt_of(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=length).astype(np.int32)


def decode_one(runner, lane, token, position, table, sampling=GREEDY):
    step = runner.decode(DecodeBatch(lanes=np.array([lane], np.int32), tokens=np.array([token], np.int32),
                                     positions=np.array([position], np.int32),
                                     page_tables=np.asarray(table, np.int32)[None, :], sampling=[sampling],
                                     return_logits=True))
    return int(step.tokens[0]), step.logits[0]


def generate(runner, prompt, table, *, chunks=None, steps=6, lane=0):
    """Prefill ``prompt`` in chunks of the given sizes, then decode greedily. Returns
    (prompt logits [n, vocab], decoded tokens, decode logits [steps, vocab])."""
    runner.bind_lane(lane, [])
    sizes = chunks or [len(prompt)]
    logits, start = [], 0
    for index, size in enumerate(sizes):
        last = index == len(sizes) - 1
        piece = prompt[start : start + size] if not last else prompt[start:]
        result = runner.prefill(PrefillChunk(lane=lane, tokens=piece, start=start, page_table=table,
                                             sample=GREEDY if last else None, return_logits=True))
        logits.append(result.logits)
        start += len(piece)
    tokens, step_logits = [int(result.tokens[0])], []
    for _ in range(steps):
        token, row = decode_one(runner, lane, tokens[-1], len(prompt) + len(tokens) - 1, table)
        tokens.append(token)
        step_logits.append(row)
    return np.concatenate(logits), tokens, np.stack(step_logits)


@pytest.mark.parametrize("chunks", [[1] * 5 + [100], [3, 3, 3, 3, 3, 100], [7, 100], [16, 100], [29, 1]])
def test_chunked_prefill_equals_one_shot(model, chunks):
    prompt = prompt_of(30, seed=1)
    table = np.arange(8, dtype=np.int32)
    whole = generate(make_runner(model), prompt, table)
    parts = generate(make_runner(model), prompt, table, chunks=chunks)
    np.testing.assert_allclose(parts[0], whole[0], rtol=RTOL, atol=ATOL)
    assert parts[1] == whole[1]
    np.testing.assert_allclose(parts[2], whole[2], rtol=RTOL, atol=ATOL)


def test_prefill_over_a_copied_prefix_equals_one_shot(model):
    """A prefix reused through copy_pages (the engine's prefix cache) gives the same logits."""
    prompt = prompt_of(21, seed=2)
    runner = make_runner(model)
    whole = generate(runner, prompt, np.arange(0, 8, dtype=np.int32))
    # Pages 0-1 hold positions 0-15 of the same prompt; copy them for a second sequence.
    runner.copy_pages([0, 1], [20, 21])
    table = np.array([20, 21, 22, 23, 24, 25], np.int32)
    runner.bind_lane(1, [])
    tail = runner.prefill(PrefillChunk(lane=1, tokens=prompt[16:], start=16, page_table=table, sample=GREEDY,
                                       return_logits=True))
    np.testing.assert_allclose(tail.logits, whole[0][16:], rtol=RTOL, atol=ATOL)
    assert int(tail.tokens[0]) == whole[1][0]


@pytest.mark.parametrize("batch", [3, 5, 8])
def test_batched_decode_equals_each_alone(model, batch):
    rng = np.random.default_rng(batch)
    lengths = rng.integers(1, 40, size=batch)
    # Scattered, interleaved pages: row i owns pages i, i + batch, i + 2 * batch, ...
    tables = np.full((batch, 12), -1, np.int32)
    for row in range(batch):
        tables[row, :6] = row + batch * np.arange(6)
    alone = []
    for row in range(batch):
        runner = make_runner(model)
        alone.append(generate(runner, prompt_of(int(lengths[row]), seed=row), tables[row, :6], steps=4))
    runner = make_runner(model)
    tokens = []
    for row in range(batch):
        runner.bind_lane(row, [])
        first = runner.prefill(PrefillChunk(lane=row, tokens=prompt_of(int(lengths[row]), seed=row), start=0,
                                            page_table=tables[row, :6], sample=GREEDY))
        tokens.append([int(first.tokens[0])])
    lanes = np.arange(batch, dtype=np.int32)[::-1].copy()  # rows in a different order from lanes
    for step in range(4):
        step_result = runner.decode(DecodeBatch(
            lanes=lanes, tokens=np.array([tokens[l][-1] for l in lanes], np.int32),
            positions=np.array([lengths[l] + step for l in lanes], np.int32), page_tables=tables[lanes],
            sampling=[GREEDY] * batch, return_logits=True))
        for i, lane in enumerate(lanes):
            tokens[lane].append(int(step_result.tokens[i]))
            np.testing.assert_allclose(step_result.logits[i], alone[lane][2][step], rtol=RTOL, atol=ATOL)
    for row in range(batch):
        assert tokens[row] == alone[row][1][:5]


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_page_size_does_not_change_results(model, page_size):
    prompt = prompt_of(37, seed=3)
    reference = generate(make_runner(model, page_size=8), prompt, np.arange(8, dtype=np.int32))
    pages = -(-50 // page_size)
    table = np.random.default_rng(page_size).permutation(pages + 3)[:pages].astype(np.int32)
    result = generate(make_runner(model, page_size=page_size, num_pages=pages + 3), prompt, table, chunks=[10, 100])
    np.testing.assert_allclose(result[0], reference[0], rtol=RTOL, atol=ATOL)
    assert result[1] == reference[1]


def test_read_and_write_pages_restore_a_sequence(model):
    """Pause: snapshot the pages, let another sequence overwrite them, restore, continue."""
    prompt = prompt_of(16, seed=4)
    table = np.array([5, 2, 7], np.int32)
    expected = generate(make_runner(model), prompt, table, steps=5)
    runner = make_runner(model)
    _, tokens, _ = generate(runner, prompt, table, steps=2)
    snapshot = runner.read_pages(table)
    assert snapshot.shape == (2, model[0].num_layers, 3, 8, model[0].num_kv_heads, model[0].head_dim)
    assert snapshot.nbytes == 3 * runner.page_bytes
    generate(runner, prompt_of(16, seed=5), table, steps=1)  # clobbers pages 5, 2, 7
    runner.write_pages(table, snapshot)
    runner.bind_lane(0, tokens[:-1])
    for _ in range(3):
        token, _ = decode_one(runner, 0, tokens[-1], len(prompt) + len(tokens) - 1, table)
        tokens.append(token)
    assert tokens == expected[1]


def test_sampling_uses_lane_counts_from_bind_and_decode_inputs(model):
    """Penalties count the generated tokens given to bind_lane plus every decode input since."""
    runner = make_runner(model)
    prompt = prompt_of(6, seed=6)
    table = np.arange(4, dtype=np.int32)
    row = SamplingRow(temperature=0.8, top_k=5, presence_penalty=1.5, frequency_penalty=0.7, seed=11, step=3)
    runner.bind_lane(2, [10, 10, 42])
    first = runner.prefill(PrefillChunk(lane=2, tokens=prompt, start=0, page_table=table, sample=row,
                                        return_logits=True))
    counts = np.zeros(model[0].vocab_size, np.int64)
    np.add.at(counts, [10, 10, 42], 1)
    assert int(first.tokens[0]) == sample_row(first.logits[-1], row, counts)
    token, logits = decode_one(runner, 2, 42, len(prompt), table, row)
    counts[42] += 1
    assert token == sample_row(logits, row, counts)


def test_penalties_steer_greedy_away_from_counted_tokens(model):
    runner = make_runner(model)
    prompt = prompt_of(6, seed=6)
    table = np.arange(4, dtype=np.int32)
    runner.bind_lane(1, [])
    favourite = int(runner.prefill(PrefillChunk(lane=1, tokens=prompt, start=0, page_table=table,
                                                sample=GREEDY)).tokens[0])
    penalised = SamplingRow(presence_penalty=100.0)
    runner.bind_lane(1, [favourite])  # as if it had been generated already
    first = int(runner.prefill(PrefillChunk(lane=1, tokens=prompt, start=0, page_table=table,
                                            sample=penalised)).tokens[0])
    assert first != favourite
    second, _ = decode_one(runner, 1, first, len(prompt), table, penalised)
    assert second not in (favourite, first)  # the decode input ``first`` now counts too


def test_runner_from_artifact_equals_runner_from_weights(tmp_path):
    path = tmp_path / "tiny.ninfer"
    make_random_artifact(path, "tiny-qwen3", seed=7)
    config = PRESETS["tiny-qwen3"]
    # The artifact stores bf16: round the same float32 weights the same way.
    weights = {n: to_float32(from_float32(random_weight(n, s, 7))) for n, s in tensor_names(config).items()}
    sizes = dict(page_size=8, num_pages=8, max_batch=1, max_context=64)
    prompt = prompt_of(12, seed=8)
    table = np.arange(8, dtype=np.int32)
    from_file = generate(ReferenceRunner(path, **sizes), prompt, table)
    from_memory = generate(ReferenceRunner.from_weights(config, weights, **sizes), prompt, table)
    np.testing.assert_array_equal(from_file[0], from_memory[0])
    assert from_file[1] == from_memory[1]


# -- rejections ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_runner():
    return make_runner((PRESETS["tiny-llama"], random_weights("tiny-llama")), num_pages=4, max_batch=2,
                       max_context=24)


@pytest.mark.parametrize(
    "chunk, message",
    [
        (dict(lane=2), r"prefill lane must lie in \[0, 2\), got 2"),
        (dict(tokens=[1, 1024]), r"token id 1024 is outside the vocabulary \[0, 1024\)"),
        (dict(tokens=[]), "the chunk is empty"),
        (dict(start=8, page_table=[0]), "row 0 has 1 pages, position 10 needs 2"),
        (dict(page_table=[4]), r"page ids \[4\] outside \[0, 4\)"),
        (dict(start=22), "position 24 exceeds max_context 24"),
        (dict(sample=SamplingRow(temperature=1.0, top_k=21)), r"prefill sample.top_k must be in 0..20, got 21"),
    ],
)
def test_prefill_rejects_bad_input(small_runner, chunk, message):
    fields = {**dict(lane=0, tokens=[1, 2, 3], start=0, page_table=[0, 1, 2, 3]), **chunk}
    fields["tokens"] = np.asarray(fields["tokens"], np.int32)
    fields["page_table"] = np.asarray(fields["page_table"], np.int32)
    with pytest.raises(ValueError, match=message):
        small_runner.prefill(PrefillChunk(**fields))


@pytest.mark.parametrize(
    "batch, message",
    [
        (dict(lanes=[0, 0]), r"decode lanes must be distinct"),
        (dict(positions=[3]), r"one entry per row"),
        (dict(page_tables=[[0, -1], [1, -1]], positions=[8, 2]), r"row 0 uses page ids \[0, -1\]"),
        (dict(lanes=[0, 1, 0], tokens=[1, 2, 3], positions=[0, 0, 0]), "3 rows exceed max_batch 2"),
        (dict(page_tables=[[0, 1], [0, 1]], positions=[5, 5]), "two rows write the same KV slot"),
        (dict(sampling=[GREEDY, SamplingRow(temperature=1.0, top_k=-1)]), r"decode sampling\[1\].top_k must be in 0..20"),
        (dict(sampling=[SamplingRow(temperature=float("nan"))] * 2), r"decode sampling\[0\].temperature must be finite"),
        (dict(sampling=[SamplingRow(top_p=1.5)] * 2), r"decode sampling\[0\].top_p must be in \[0, 1\]"),
        (dict(sampling=[SamplingRow(seed=1 << 63)] * 2), r"decode sampling\[0\]: seed must be a signed 64-bit"),
    ],
)
def test_decode_rejects_bad_input(small_runner, batch, message):
    fields = {**dict(lanes=[0, 1], tokens=[5, 6], positions=[3, 4], page_tables=[[0, 1], [2, 3]]), **batch}
    rows = len(fields["lanes"])
    fields.setdefault("sampling", [GREEDY] * rows)
    with pytest.raises(ValueError, match=message):
        small_runner.decode(DecodeBatch(lanes=np.asarray(fields["lanes"], np.int32),
                                        tokens=np.asarray(fields["tokens"], np.int32),
                                        positions=np.asarray(fields["positions"], np.int32),
                                        page_tables=np.asarray(fields["page_tables"], np.int32),
                                        sampling=fields["sampling"]))


def test_page_operations_reject_bad_pages(small_runner):
    with pytest.raises(ValueError, match=r"copy_pages dst: page ids must lie in \[0, 4\)"):
        small_runner.copy_pages([0], [4])
    with pytest.raises(ValueError, match="2 source pages but 1 destination pages"):
        small_runner.copy_pages([0, 1], [2])
    with pytest.raises(ValueError, match="write_pages: data shape"):
        small_runner.write_pages([0], np.zeros((2, 1, 1, 1, 1, 1), np.float32))


def test_page_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="page_size must be a power of two, got 12"):
        make_runner((PRESETS["tiny-llama"], random_weights("tiny-llama")), page_size=12)


def test_missing_and_misshapen_weights_are_named():
    config = PRESETS["tiny-llama"]
    weights = random_weights("tiny-llama")
    del weights["layers.1.down"]
    with pytest.raises(ValueError, match="'layers.1.down' is missing"):
        ReferenceRunner.from_weights(config, weights, num_pages=1, max_batch=1, max_context=8)
    weights = random_weights("tiny-llama")
    weights["final_norm"] = weights["final_norm"][:10]
    with pytest.raises(ValueError, match=r"'final_norm' has shape \(10,\), expected \(64,\)"):
        ReferenceRunner.from_weights(config, weights, num_pages=1, max_batch=1, max_context=8)


def test_a_closed_runner_says_so(model):
    runner = make_runner(model)
    runner.close()
    with pytest.raises(RuntimeError, match="the reference runner is closed"):
        runner.prefill(PrefillChunk(lane=0, tokens=np.array([1], np.int32), start=0,
                                    page_table=np.array([0], np.int32)))


def test_prefill_longer_than_one_forward_block(model):
    """Chunks beyond PREFILL_BLOCK are split inside the runner; the result must not show it."""
    from ninfer.backends.reference.forward import PREFILL_BLOCK

    prompt = prompt_of(PREFILL_BLOCK + 45, seed=9)
    table = np.arange(48, dtype=np.int32)
    whole = generate(make_runner(model, max_context=512), prompt, table, steps=2)
    parts = generate(make_runner(model, max_context=512), prompt, table, chunks=[100, 100, 100, 1000], steps=2)
    assert whole[0].shape[0] == len(prompt)
    np.testing.assert_allclose(whole[0], parts[0], rtol=RTOL, atol=ATOL)
    assert whole[1] == parts[1]


def test_pipelined_decode_follows_on_and_checks_its_order(model):
    """launch_decode(follow=True) feeds each row the step before's token, as the next decode would;
    a follow without that step, with other lanes or asking for logits, a third step in flight and a
    finish with none are refused by name."""
    runner, stepwise = make_runner(model), make_runner(model)
    prompts = [prompt_of(9, seed=1), prompt_of(4, seed=2)]
    tables = np.stack([np.arange(4, dtype=np.int32), np.arange(4, 8, dtype=np.int32)])
    row = SamplingRow(temperature=0.9, presence_penalty=0.5, seed=3)
    firsts = []
    for r in (runner, stepwise):
        firsts = []
        for lane, p in enumerate(prompts):
            r.bind_lane(lane, [])
            firsts.append(int(r.prefill(PrefillChunk(lane=lane, tokens=p, start=0, page_table=tables[lane],
                                                     sample=row)).tokens[0]))
    lanes = np.array([0, 1], np.int32)

    def batch(step, tokens):
        return DecodeBatch(lanes=lanes, tokens=np.asarray(tokens, np.int32),
                           positions=np.array([len(p) + step - 1 for p in prompts], np.int32), page_tables=tables,
                           sampling=[attrs.evolve(row, step=step)] * 2)

    want, tokens = [], firsts
    for step in (1, 2, 3):
        tokens = stepwise.decode(batch(step, tokens)).tokens.tolist()
        want.append(tokens)
    with pytest.raises(ValueError, match="lanes of the step in flight"):
        runner.launch_decode(batch(1, [0, 0]), follow=True)
    runner.launch_decode(batch(1, firsts))
    runner.launch_decode(batch(2, [0, 0]), follow=True)
    with pytest.raises(RuntimeError, match="two decode steps are in flight"):
        runner.launch_decode(batch(3, [0, 0]), follow=True)
    got = [runner.finish_decode().tokens.tolist()]
    with pytest.raises(ValueError, match="lanes of the step in flight"):
        runner.launch_decode(attrs.evolve(batch(3, [0]), lanes=lanes[:1], positions=batch(3, [0]).positions[:1],
                                          page_tables=tables[:1], sampling=[row]), follow=True)
    with pytest.raises(ValueError, match="cannot return logits"):
        runner.launch_decode(attrs.evolve(batch(3, [0, 0]), return_logits=True), follow=True)
    runner.launch_decode(batch(3, [0, 0]), follow=True)
    got += [runner.finish_decode().tokens.tolist(), runner.finish_decode().tokens.tolist()]
    assert got == want
    with pytest.raises(RuntimeError, match="no decode step is in flight"):
        runner.finish_decode()
