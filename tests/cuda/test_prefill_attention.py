"""The tensor-core prefill attention against NumPy attention on random inputs (GPU only).

The reference is float64 attention over the pool's own bf16 K/V and the unrounded fp32 q, so the
measured error is the kernel's: q and P rounded to bf16 before their MMAs (about 3e-3 relative).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from ninfer.artifact.bf16 import from_float32, to_float32  # noqa: E402
from ninfer.backends.cuda.forward import prefill_attention_grid  # noqa: E402

PAGE = 16
LAYERS = 2  # the launch reads layer 1, so the page stride and layer offset are exercised
TOLERANCE = 1e-2  # relative L2 per case; bf16 q and P give about 3e-3


@pytest.fixture(scope="module")
def gpu():
    from cuda_helpers import Gpu

    g = Gpu()
    yield g
    g.device.close()


def _run_case(gpu, rng, head_dim, group, sequences, kv_heads=2):
    """``sequences``: [(prefix, new_rows)] whose rows go into one launch, in this order.

    Returns the worst (relative L2 error, max abs error) against NumPy of the launches of every shape.
    """
    D, KV, H = head_dim, kv_heads, kv_heads * group
    lengths = [prefix + rows for prefix, rows in sequences]
    max_pages = max(-(-n // PAGE) for n in lengths) + 1
    num_pages = len(sequences) * max_pages
    tables = rng.permutation(num_pages).astype(np.int32).reshape(len(sequences), max_pages)
    pool = np.zeros((num_pages, LAYERS, 2, KV, PAGE, D), np.uint16)
    keys, values = [], []
    for seq, length in enumerate(lengths):
        kv = from_float32(rng.standard_normal((2, length, KV, D)).astype(np.float32))
        for pos in range(length):
            pool[tables[seq, pos // PAGE], 1, :, :, pos % PAGE] = kv[:, pos]
        keys.append(to_float32(kv[0]).astype(np.float64))
        values.append(to_float32(kv[1]).astype(np.float64))
    row_table = np.concatenate([np.full(n, s, np.int32) for s, (_, n) in enumerate(sequences)])
    positions = np.concatenate([np.arange(p, p + n, dtype=np.int32) for p, n in sequences])
    rows = row_table.size
    width = (H + 2 * KV) * D
    qkv = rng.standard_normal((rows, width)).astype(np.float32) * 2
    qkv[:, H * D:] = np.nan  # k and v columns: the kernel must read q only
    scale = D ** -0.5

    page_elems = LAYERS * 2 * KV * PAGE * D
    d_pool = gpu.put(pool)
    kc = d_pool.at(2 * KV * PAGE * D * 2)  # layer 1
    out = gpu.empty(rows * H * D * 4)
    d_qkv, d_tables, d_row_table, d_positions = (gpu.put(a) for a in (qkv, tables, row_table, positions))
    d_qkv16 = gpu.put(from_float32(qkv))  # what the _bf16 kernels read: q as the cuBLASLt GEMM writes it
    outputs = {}
    for name in _shapes(gpu, D):
        kernel = gpu.kernels[name]
        q_in = d_qkv16 if kernel.meta.get("out") == "bf16" else d_qkv
        args = (q_in, kc, page_elems, d_tables, max_pages, d_row_table, d_positions, out, rows, H, KV,
                PAGE.bit_length() - 1, float(scale * np.log2(np.e)))
        if kernel.meta.get("persistent"):  # three blocks taking item after item: the same bits as a block an item
            gpu.launch(name, prefill_attention_grid(kernel.meta, H, rows, 3), (kernel.meta["threads"],), args)
            persistent = gpu.get(out, np.uint32, (rows, H, D // (2 if kernel.meta.get("out") == "bf16" else 1)))
        gpu.launch(name, (H, -(-rows // kernel.meta["rows"])), (kernel.meta["threads"],), args)
        if kernel.meta.get("persistent"):
            np.testing.assert_array_equal(persistent, gpu.get(out, np.uint32, persistent.shape))
        if kernel.meta.get("out") == "bf16":  # the fp32 kernel's result (it rounds q as from_float32 does) rounded
            bits = gpu.get(out, np.uint16, (rows, H, D))
            np.testing.assert_array_equal(bits, from_float32(outputs[name.removesuffix("_bf16")]))
            outputs[name] = to_float32(bits)
        else:
            outputs[name] = gpu.get(out, np.float32, (rows, H, D))

    want = np.empty((rows, H, D))
    q = qkv[:, :H * D].reshape(rows, H, D).astype(np.float64)
    for seq in range(len(sequences)):
        sel = np.flatnonzero(row_table == seq)
        visible = np.arange(lengths[seq])[None, :] <= positions[sel][:, None]
        for h in range(H):
            scores = q[sel, h] @ keys[seq][:, h // group].T * scale
            scores = np.where(visible, scores, -np.inf)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            want[sel, h] = (p / p.sum(axis=1, keepdims=True)) @ values[seq][:, h // group]
    errors = []
    for name, got in outputs.items():
        assert np.all(np.isfinite(got)), f"{name}: an output element was not written"
        errors.append((float(np.linalg.norm(got - want) / np.linalg.norm(want)), float(np.abs(got - want).max())))
    return max(errors)


def _shapes(gpu, head_dim):
    """The kernel of this head_dim and every experimental shape of it in the manifest
    (``NINFER_PREFILL_VARIANTS=1`` builds), so a shape is checked before it is timed."""
    base = f"prefill_attention_d{head_dim}"
    return [name for name in gpu.kernels.entries if name == base or name.startswith(base + "_")]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_chunk_over_a_prefix_matches_numpy(gpu, head_dim, group):
    """A 150-row chunk after a 37-token prefix: neither a multiple of the 64-row or key tile nor of a page."""
    rng = np.random.default_rng(head_dim * 10 + group)
    rel, worst = _run_case(gpu, rng, head_dim, group, [(37, 150)])
    print(f"prefill_attention d{head_dim} g{group} 37+150 rows: rel {rel:.2e} max abs {worst:.2e}")
    assert rel < TOLERANCE


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rows,prefix", [(1, 0), (15, 0), (16, 0), (17, 0), (1, 100), (17, 63), (1000, 0),
                                         (1000, 129)])
def test_edge_sizes(gpu, head_dim, rows, prefix):
    rng = np.random.default_rng(rows * 7 + prefix + head_dim)
    rel, worst = _run_case(gpu, rng, head_dim, 4, [(prefix, rows)])
    print(f"prefill_attention d{head_dim} g4 {prefix}+{rows} rows: rel {rel:.2e} max abs {worst:.2e}")
    assert rel < TOLERANCE


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_several_sequences_in_one_launch(gpu, head_dim):
    """Rows of three sequences (different page tables and prefixes), tiles straddling their borders."""
    rng = np.random.default_rng(head_dim)
    rel, worst = _run_case(gpu, rng, head_dim, 2, [(0, 5), (200, 70), (31, 130), (0, 1)])
    print(f"prefill_attention d{head_dim} g2 4 sequences: rel {rel:.2e} max abs {worst:.2e}")
    assert rel < TOLERANCE
