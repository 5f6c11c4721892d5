"""HybridRunner as the engine drives it: prefill chunks, decode batches and StateImages.

The model is the ``qwen3_next`` parity fixture (MoE, a dense layer, 3 DeltaNet + 1 attention
layer) converted by the product's converter.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from ninfer.artifact import open_artifact
from ninfer.backends.reference import HybridRunner
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow
from ninfer.convert.hf import convert_hf
from ninfer.models.hybrid import HybridConfig

FIXTURE = Path(__file__).parent / "fixtures" / "hybrid" / "qwen3_next"
GREEDY = SamplingRow(temperature=0.0)
PAGES = 32
PAGE = 4


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_runner") / "m.ninfer"
    convert_hf(FIXTURE, path)
    return path


@pytest.fixture
def runner(artifact):
    return HybridRunner(artifact, page_size=PAGE, num_pages=PAGES, max_batch=3, max_context=128, state_slots=2)


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 256, n).astype(np.int32)


def table(first: int, n: int = 8) -> np.ndarray:
    return np.arange(first, first + n, dtype=np.int32)


def prefill(runner, lane, tokens, start, pages, sample=True):
    return runner.prefill(PrefillChunk(lane=lane, tokens=tokens, start=start, page_table=pages,
                                       sample=GREEDY if sample else None, return_logits=True))


def decode(runner, lanes, tokens, positions, tables):
    return runner.decode(DecodeBatch(lanes=np.array(lanes), tokens=np.array(tokens), positions=np.array(positions),
                                     page_tables=np.stack(tables), sampling=[GREEDY] * len(lanes),
                                     return_logits=True))


def generate(runner, lane, pages, first_token, position, steps):
    tokens, logits = [first_token], []
    for _ in range(steps):
        r = decode(runner, [lane], [tokens[-1]], [position], [pages])
        tokens.append(int(r.tokens[0]))
        logits.append(r.logits[0])
        position += 1
    return tokens, np.stack(logits)


def test_prefill_in_chunks_equals_one_shot(runner):
    ids = prompt(30)
    whole = prefill(runner, 0, ids, 0, table(0))
    whole_state = runner.read_state(0)
    pieces = []
    for lo, hi in [(0, 7), (7, 8), (8, 30)]:
        pieces.append(prefill(runner, 1, ids[lo:hi], lo, table(8), sample=hi == 30))
    # Same math, other matrix shapes: BLAS sums in another order, so fp32 rounding differs (~2e-5).
    np.testing.assert_allclose(np.concatenate([p.logits for p in pieces]), whole.logits, rtol=0, atol=1e-4)
    np.testing.assert_allclose(runner.read_state(1), whole_state, rtol=0, atol=1e-4)
    assert pieces[-1].tokens.tolist() == whole.tokens.tolist()
    assert runner.state_length(1) == 30


def test_decode_batch_equals_decoding_each_lane_alone(runner, artifact):
    alone = HybridRunner(artifact, page_size=PAGE, num_pages=PAGES, max_batch=3, max_context=128)
    lens = (5, 11)
    firsts = [int(prefill(r, lane, prompt(n, seed=lane), 0, table(8 * lane)).tokens[0])
              for r in (runner, alone) for lane, n in enumerate(lens)]
    # Lanes with different lengths, decoded together (in reverse lane order) and one by one.
    batch = decode(runner, [1, 0], [firsts[1], firsts[0]], [lens[1], lens[0]], [table(8), table(0)])
    for row, lane in enumerate([1, 0]):
        one = decode(alone, [lane], [firsts[2 + lane]], [lens[lane]], [table(8 * lane)])
        np.testing.assert_allclose(batch.logits[row], one.logits[0], rtol=0, atol=1e-4)
        assert batch.tokens[row] == one.tokens[0]


def test_state_snapshot_and_restore_is_exact(runner):
    """Pause by snapshot: state + KV pages to the host, lane reused, then put back: bit-exact."""
    ids = prompt(20, seed=4)
    first = int(prefill(runner, 0, ids, 0, table(0)).tokens[0])
    image = runner.read_state(0)
    pages = runner.read_pages(table(0, 6))
    want_tokens, want_logits = generate(runner, 0, table(0), first, 20, 6)
    # Something else runs on lane 0 and overwrites its pages and state.
    prefill(runner, 0, prompt(23, seed=9), 0, table(0))
    runner.write_pages(table(0, 6), pages)
    runner.write_state(0, image, length=20)
    tokens, logits = generate(runner, 0, table(0), first, 20, 6)
    assert tokens == want_tokens
    np.testing.assert_array_equal(logits, want_logits)


def test_checkpoint_in_extra_slot_serves_another_lane(runner):
    """Prefix reuse: capture the state at a boundary, copy it into another lane, continue there."""
    ids = prompt(26, seed=6)
    prefill(runner, 0, ids[:16], 0, table(0), sample=False)
    runner.copy_state(0, 3)  # slot 3 = first extra slot
    assert runner.state_length(3) == 16
    full = prefill(runner, 0, ids[16:], 16, table(0))
    # Lane 2 shares the first 16 tokens' KV pages (whole pages: 16 = 4 pages of 4) and the state.
    runner.copy_pages(table(0, 4), table(16, 4))
    runner.copy_state(3, 2)
    reused = prefill(runner, 2, ids[16:], 16, table(16))
    np.testing.assert_array_equal(reused.logits, full.logits)
    np.testing.assert_array_equal(runner.read_state(2), runner.read_state(0))


def test_state_layout_and_size(runner):
    config = runner.config
    assert isinstance(config, HybridConfig)
    n_linear = len(config.linear_layers)
    assert n_linear == 3 and config.attention_layers == (3,)
    per_layer = (config.conv_kernel - 1) * config.conv_dim + config.linear_num_v_heads * 16 * 16
    assert runner.state_floats == config.state_floats == n_linear * per_layer
    assert runner.num_state_slots == 5
    assert runner.read_state(4).shape == (runner.state_floats,)
    # KV pages hold the attention layers only.
    assert runner.read_pages([0]).shape == (2, 1, 1, PAGE, config.num_kv_heads, config.head_dim)


def test_a_chunk_that_does_not_continue_the_state_is_refused(runner):
    ids = prompt(12)
    prefill(runner, 0, ids[:8], 0, table(0), sample=False)
    with pytest.raises(ValueError, match="summarises 8 tokens"):
        prefill(runner, 0, ids[8:], 9, table(0))
    with pytest.raises(ValueError, match="summarises 8 tokens"):
        decode(runner, [0], [5], [10], [table(0)])
    runner.write_state(0, runner.read_state(0))  # unknown length: trusted
    prefill(runner, 0, ids[8:], 8, table(0))


def test_decode_rows_that_write_one_kv_slot_are_refused(runner):
    """The protocol checks are the dense runner's: a page shared without copy-on-write is refused."""
    for lane in (0, 1):
        prefill(runner, lane, prompt(5), 0, table(0), sample=False)
    with pytest.raises(ValueError, match="two rows write the same KV slot"):
        decode(runner, [0, 1], [5, 6], [5, 5], [table(0), table(0)])


def test_a_prefill_longer_than_one_block_equals_shorter_chunks(artifact):
    """Chunks beyond PREFILL_BLOCK are split inside the runner; the DeltaNet state carries over."""
    from ninfer.backends.reference.forward import PREFILL_BLOCK

    ids = prompt(PREFILL_BLOCK + 30, seed=4)
    big = HybridRunner(artifact, page_size=PAGE, num_pages=128, max_batch=1,
                       max_context=PREFILL_BLOCK + 64)
    pages = np.arange(128, dtype=np.int32)
    whole = prefill(big, 0, ids, 0, pages).logits
    split = 128  # a multiple of the delta rule's chunk, as PREFILL_BLOCK is: the same chunks either way
    first = prefill(big, 0, ids[:split], 0, pages).logits
    rest = prefill(big, 0, ids[split:], split, pages).logits
    # As in test_prefill_in_chunks_equals_one_shot: other matrix shapes, other fp32 rounding (which
    # OpenBLAS kernel runs depends on the CPU: on one host a logit of 0.566 came out 1.04e-4 apart).
    np.testing.assert_allclose(whole, np.concatenate([first, rest]), rtol=1e-4, atol=1e-4)


def test_state_calls_check_their_arguments(runner):
    with pytest.raises(ValueError, match=r"state slot in \[0, 5\)"):
        runner.read_state(5)
    with pytest.raises(ValueError, match="copy_state dst"):
        runner.copy_state(0, -1)
    with pytest.raises(ValueError, match="float32"):
        runner.write_state(0, np.zeros(runner.state_floats, np.float64))
    with pytest.raises(ValueError, match="float32"):
        runner.write_state(0, np.zeros(runner.state_floats - 1, np.float32))


def test_from_weights_matches_the_artifact(artifact):
    art = open_artifact(artifact, components=("text",))
    config = HybridConfig.from_json(art.config)
    weights = {info: art.tensor(info) for info in _names(art)}
    a = HybridRunner.from_weights(config, weights, page_size=PAGE, num_pages=8, max_batch=1, max_context=32)
    b = HybridRunner(art, page_size=PAGE, num_pages=8, max_batch=1, max_context=32)
    ids = prompt(9)
    np.testing.assert_array_equal(prefill(a, 0, ids, 0, table(0)).logits, prefill(b, 0, ids, 0, table(0)).logits)


def _names(art):
    from ninfer.models.hybrid import tensor_names

    return tensor_names(HybridConfig.from_json(art.config))


def test_router_softmax_top_k_and_renormalisation():
    from ninfer.backends.reference.hybrid import route

    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]], np.float32))
    top, weights = route(logits, 2, renormalise=False)
    assert top.tolist() == [[1, 3], [0, 1]]  # ties go to the lower expert id
    np.testing.assert_allclose(weights, [[0.4, 0.3], [0.25, 0.25]], rtol=1e-6)
    _, weights = route(logits, 2, renormalise=True)
    np.testing.assert_allclose(weights, [[4 / 7, 3 / 7], [0.5, 0.5]], rtol=1e-6)


def test_a_step_launched_ahead_leaves_the_collected_state(runner, artifact):
    """Pipelined decode: while the step launched ahead is in flight, the lanes' StateImages are as of
    the collected step (a checkpoint taken then resumes exactly there; writing a lane in flight is
    refused); once collected, as of it; the results are those of plain steps on another runner."""
    plain = HybridRunner(artifact, page_size=PAGE, num_pages=PAGES, max_batch=3, max_context=128)
    lens = (6, 9)
    firsts = [int(prefill(r, lane, prompt(n, seed=lane), 0, table(8 * lane)).tokens[0])
              for r in (runner, plain) for lane, n in enumerate(lens)]
    tables = np.stack([table(0), table(8)])
    assert runner.info.pipelined_decode
    first = DecodeBatch(lanes=np.array([0, 1]), tokens=np.array(firsts[:2]), positions=np.array(lens),
                        page_tables=tables, sampling=[GREEDY] * 2, return_logits=True)
    runner.launch_decode(first)
    runner.launch_decode(attrs.evolve(first, tokens=np.zeros(2, np.int32), positions=np.array(lens) + 1,
                                      return_logits=False), follow=True)
    one = runner.finish_decode()
    want_one = decode(plain, [0, 1], firsts[2:], list(lens), list(tables))
    assert one.tokens.tolist() == want_one.tokens.tolist()
    assert [runner.state_length(lane) for lane in (0, 1)] == [7, 10]
    np.testing.assert_array_equal(runner.read_state(0), plain.read_state(0))
    runner.copy_state(0, 3)  # a checkpoint of lane 0 after the collected step
    with pytest.raises(RuntimeError, match="in flight"):
        runner.write_state(1, plain.read_state(1))
    two = runner.finish_decode()
    want_two = decode(plain, [0, 1], want_one.tokens.tolist(), [7, 10], list(tables))
    assert two.tokens.tolist() == want_two.tokens.tolist()
    assert [runner.state_length(lane) for lane in (0, 1)] == [8, 11]
    np.testing.assert_array_equal(runner.read_state(1), plain.read_state(1))
    # Lane 0 dropped from the second step, say (it finished): its checkpoint resumes on lane 2.
    assert runner.state_length(3) == 7
    runner.copy_pages(table(0, 2), table(16, 2))
    runner.copy_state(3, 2)
    again = decode(runner, [2], [int(one.tokens[0])], [7], [table(16)])
    assert again.tokens[0] == two.tokens[0]
    np.testing.assert_allclose(again.logits[0], want_two.logits[0], rtol=0, atol=1e-4)  # one row, not two: BLAS rounding
