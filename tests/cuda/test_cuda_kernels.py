"""Each kernel of ptx/ against NumPy on random inputs, edge sizes included (GPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.cuda
PTX_DIR = Path(__file__).resolve().parents[2] / "ptx"

from ninfer.artifact.bf16 import from_float32, to_float32  # noqa: E402
from ninfer.backends.reference.forward import attention as ref_attention  # noqa: E402
from ninfer.backends.reference.forward import rms_norm, silu  # noqa: E402
from ninfer.backends.runner import SamplingRow  # noqa: E402
from ninfer.backends.sampling import sample_row  # noqa: E402
from numba_kernels.gemm import fragment_order  # noqa: E402


@pytest.fixture(scope="module")
def gpu():
    from cuda_helpers import Gpu

    g = Gpu()
    yield g
    g.device.close()


def _err(got, want):
    from cuda_helpers import rel_err

    return rel_err(got, want)


@pytest.mark.parametrize("variant", ["", "_c4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(1, 8), (37, 24), (301, 1000), (4096, 256)])
def test_gemv_matches_numpy(gpu, rows, n, k, variant):
    rng = np.random.default_rng(rows * 1000 + n)
    w = from_float32(rng.standard_normal((n, k)))
    x = rng.standard_normal((rows, k)).astype(np.float32)
    y = gpu.empty(rows * n * 4)
    kernel = gpu.kernels[f"gemv_m{rows}{variant}"]
    gpu.launch(kernel.name, (-(-n // kernel.meta["cols"]),), (kernel.meta["threads"],),
               (y, gpu.put(x), gpu.put(w), rows, n, k, n))
    want = x.astype(np.float64) @ to_float32(w).T.astype(np.float64)
    assert _err(gpu.get(y, np.float32, (rows, n)), want) < 1e-6


def test_gemv_fewer_rows_than_compiled(gpu):
    """gemv_m8 with 3 rows must leave rows 3..7 of y untouched."""
    rng = np.random.default_rng(1)
    n, k = 50, 64
    w = from_float32(rng.standard_normal((n, k)))
    x = rng.standard_normal((8, k)).astype(np.float32)
    y = gpu.empty(8 * n * 4)
    gpu.launch("gemv_m8", (-(-n // 8),), (128,), (y, gpu.put(x), gpu.put(w), 3, n, k, n))
    got = gpu.get(y, np.float32, (8, n))
    assert _err(got[:3], x[:3] @ to_float32(w).T) < 1e-6
    assert np.isnan(got[3:]).all()


DECODE_GEMMS = sorted(name for name, entry in json.loads((PTX_DIR / "manifest.json").read_text())["kernels"].items()
                      if "epilogue" in entry["meta"])
# By bf16 parts per activation (0: the fp32 GEMV). The tensor cores' fp32 accumulation is not
# IEEE-exact (its error grows with k), so even three parts (all 24 bits) get 1e-5, not 1e-6.
DECODE_GEMM_TOLERANCE = {0: 1e-6, 2: 3e-5, 3: 1e-5}


@pytest.mark.parametrize("name", DECODE_GEMMS)
@pytest.mark.parametrize("rows,n,k", [(1, 37, 24), (3, 301, 1000), (8, 4096, 256), (5, 40, 4104)])
def test_decode_gemm_matches_numpy(gpu, name, rows, n, k):
    """Every fused decode GEMM (meta: epilogue, normed, terms, max_rows; chain, keep, next, head_norm) against
    float64 NumPy."""
    kernel = gpu.kernels[name]
    epilogue, normed = kernel.meta["epilogue"], kernel.meta["normed"]
    rows = min(rows, kernel.meta["max_rows"])
    rng = np.random.default_rng(rows * 7 + n + k)
    eps = 1e-6
    w = from_float32(rng.standard_normal((2 * n if epilogue == "swiglu" else n, k)))
    x = rng.standard_normal((rows, k)).astype(np.float32) * 3
    norm_w = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    y0 = rng.standard_normal((8, n)).astype(np.float32)
    h = rms_norm(x, norm_w, eps) if normed else x
    want = h.astype(np.float64) @ to_float32(w).T.astype(np.float64)
    if epilogue == "swiglu":
        want = silu(want[:, :n]) * want[:, n:]
    elif epilogue == "residual":
        want = want + y0[:rows]
    y = gpu.put(y0) if epilogue == "residual" else gpu.empty(8 * n * 4)
    kept = (gpu.empty(8 * k * 4),) if kernel.meta.get("keep") else ()  # the normalised rows, written too
    chain = kernel.meta.get("chain")
    x_in, extra = x, kept
    grid = -(-n // kernel.meta["cols"])
    if chain == "in":  # x comes as x * norm_w, with a producer's per-block sums of squares (16 columns a block)
        h = rms_norm(x, norm_w, eps)
        want = h.astype(np.float64) @ to_float32(w).T.astype(np.float64)
        if epilogue == "swiglu":
            want = silu(want[:, :n]) * want[:, n:]
        parts = -(-k // 16)
        sums = np.zeros((parts, 8), np.float32)
        sums[:, :rows] = np.pad(x * x, ((0, 0), (0, parts * 16 - k))).reshape(rows, parts, 16).sum(-1).T
        x_in, extra = x * norm_w, (gpu.put(sums), parts)
    elif chain == "out":  # the next norm's weights are per output column
        norm_w = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        extra = (gpu.empty(8 * n * 4), gpu.empty(grid * 8 * 4))
    elif epilogue == "conv":  # a DeltaNet in_proj's: no conv channels, so every column is stored (the conv's
        # own checks: tests/test_kernels_sim.py and the hybrid models of tests/cuda/test_cuda_hybrid.py)
        lanes, dummy = gpu.put(np.zeros(8, np.int32)), gpu.empty(64)
        extra = (dummy, dummy, 0, lanes, lanes, 0, dummy)
    elif kernel.meta.get("head_norm"):  # x: a split delta rule's unscaled output, each 8-wide head scaled here
        head_dim, splits = 8, 2
        partials = rng.uniform(0.5, 4, (rows, k // head_dim, splits)).astype(np.float32)
        inv = 1 / np.sqrt(partials.astype(np.float64).sum(-1) / head_dim + eps)
        h = (x.reshape(rows, -1, head_dim) * inv[..., None]).reshape(rows, k)
        want = h @ to_float32(w).T.astype(np.float64) + y0[:rows]
        extra = (gpu.put(partials), splits, head_dim)
    if kernel.meta.get("next"):  # "the next GEMM's weights" asked of L2: a hint that changes nothing
        then = gpu.put(np.zeros(4096 + 37 * 16, np.uint8))
        extra = (*extra, then, then.nbytes)
    if kernel.meta.get("frag"):  # the weights in the order the build reads them
        w = fragment_order(w, kernel.meta["tiles"], epilogue == "swiglu")
    gpu.launch(kernel.name, (grid,), (kernel.meta["threads"],),
               (y, gpu.put(x_in), gpu.put(w), gpu.put(norm_w), rows, n, k, n, eps, *extra))
    got = gpu.get(y, np.float32, (8, n))
    assert _err(got[:rows], want) < DECODE_GEMM_TOLERANCE[kernel.meta["terms"]]
    if chain == "out":  # x * norm_w of the new residual, and each block's sums of its squares
        xn = gpu.get(extra[0], np.float32, (8, n))
        assert np.array_equal(xn[:rows], got[:rows] * norm_w) and np.isnan(xn[rows:]).all()
        sums = gpu.get(extra[1], np.float32, (grid, 8))[:, :rows]
        squares = np.pad(got[:rows].astype(np.float64) ** 2, ((0, 0), (0, grid * kernel.meta["cols"] - n)))
        assert _err(sums, squares.reshape(rows, grid, -1).sum(-1).T) < 1e-6
    if kept:
        normed = gpu.get(kept[0], np.float32, (8, k))
        assert _err(normed[:rows], h) < 1e-6 and np.isnan(normed[rows:]).all()
    if epilogue == "residual":
        assert np.array_equal(got[rows:], y0[rows:])  # rows past ``rows`` untouched
    else:
        assert np.isnan(got[rows:]).all()


@pytest.mark.parametrize("rows,k,tiles,swiglu", [(2 * 40, 72, 4, True), (37, 64, 1, False), (6144, 4096, 1, False)])
def test_fragment_order_kernel_is_fragment_order(gpu, rows, k, tiles, swiglu):
    """``fragment_order_bf16`` (CudaRunner's copies for the FRAG decode GEMMs) writes what
    ``fragment_order`` computes, partial tiles and steps zero-filled."""
    from ninfer.backends.cuda.forward import fragment_bytes

    w = from_float32(np.random.default_rng(rows + k).standard_normal((rows, k)))
    want = fragment_order(w, tiles, swiglu)
    assert want.nbytes == fragment_bytes(rows, k, tiles, swiglu)
    out = gpu.empty(want.nbytes)
    chunks = want.nbytes // 16
    gpu.launch("fragment_order_bf16", (-(-chunks // 256),), (256,),
               (out, gpu.put(w), rows, k, tiles, int(swiglu), chunks))
    assert np.array_equal(gpu.get(out, np.uint16, want.shape), want)


@pytest.mark.parametrize("rows,n,k", [(9, 72, 104), (64, 64, 16), (130, 264, 304)])
def test_cublaslt_bf16_gemm_and_conversion(gpu, rows, n, k):
    from ninfer.backends.cuda.cublaslt import WORKSPACE_BYTES, LtMatmul

    rng = np.random.default_rng(rows * n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = from_float32(rng.standard_normal((n, k)))
    xb = gpu.empty(rows * k * 2)
    gpu.launch("to_bf16", (-(-(rows * k) // 256),), (256,), (xb, gpu.put(x), rows * k))
    assert np.array_equal(gpu.get(xb, np.uint16, (rows, k)), from_float32(x))
    lt = LtMatmul(gpu.device.alloc(WORKSPACE_BYTES, "lt"))
    try:
        y = gpu.empty(rows * n * 4)
        lt.matmul(y, xb, gpu.put(w), rows, n, k, gpu.stream)
        want = to_float32(from_float32(x)).astype(np.float64) @ to_float32(w).T.astype(np.float64)
        assert _err(gpu.get(y, np.float32, (rows, n)), want) < 1e-5
        yb = gpu.empty(rows * n * 2)  # bf16 out: the fp32 sums rounded once (another algorithm may sum them)
        lt.matmul(yb, xb, gpu.put(w), rows, n, k, gpu.stream, out_bf16=True)
        got = gpu.get(yb, np.uint16, (rows, n))
        assert np.abs(got.astype(np.int32) - from_float32(want.astype(np.float32)).astype(np.int32)).max() <= 1
        with pytest.raises(ValueError, match="stays fp32"):
            lt.matmul(yb, xb, gpu.put(w), rows, n, k, gpu.stream, accumulate=True, out_bf16=True)
    finally:
        lt.close()


@pytest.mark.parametrize("rows,n,k", [(9, 70, 100), (64, 64, 16), (130, 257, 300)])
def test_gemm_tiled_matches_numpy(gpu, rows, n, k):
    rng = np.random.default_rng(rows + n + k)
    w = from_float32(rng.standard_normal((n, k)))
    x = rng.standard_normal((rows, k)).astype(np.float32)
    y = gpu.empty(rows * n * 4)
    gpu.launch("gemm_tiled", (-(-n // 64), -(-rows // 64)), (256,), (y, gpu.put(x), gpu.put(w), rows, n, k, n))
    want = x.astype(np.float64) @ to_float32(w).T.astype(np.float64)
    assert _err(gpu.get(y, np.float32, (rows, n)), want) < 1e-6


@pytest.mark.parametrize("hidden", [4, 100, 4096, 9000])  # 9000: past the items a thread keeps
def test_norms_embed_silu(gpu, hidden):
    rng = np.random.default_rng(hidden)
    rows, vocab, eps = 5, 33, 1e-6
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    d = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    out = gpu.empty(rows * hidden * 4)
    gpu.launch("rmsnorm", (rows,), (1024,), (out, gpu.put(x), gpu.put(w), hidden, eps))
    assert _err(gpu.get(out, np.float32, (rows, hidden)), rms_norm(x, w, eps)) < 1e-6
    xd = gpu.put(x)
    gpu.launch("add_rmsnorm", (rows,), (96,), (xd, gpu.put(d), out, gpu.put(w), hidden, eps))
    assert _err(gpu.get(xd, np.float32, (rows, hidden)), x + d) < 1e-7
    assert _err(gpu.get(out, np.float32, (rows, hidden)), rms_norm(x + d, w, eps)) < 1e-6
    table = from_float32(rng.standard_normal((vocab, hidden)))
    tokens = rng.integers(0, vocab, rows).astype(np.int32)
    gpu.launch("embed", (-(-hidden // 256), rows), (256,), (out, gpu.put(table), gpu.put(tokens), hidden))
    assert np.array_equal(gpu.get(out, np.float32, (rows, hidden)), to_float32(table)[tokens])
    gu = rng.standard_normal((rows, 2 * hidden)).astype(np.float32) * 4
    gpu.launch("silu_mul", (-(-hidden // 256), rows), (256,), (out, gpu.put(gu), hidden))
    want = silu(gu[:, :hidden]) * gu[:, hidden:]
    assert _err(gpu.get(out, np.float32, (rows, hidden)), want) < 1e-6


@pytest.mark.parametrize("hidden", [4, 100, 4096, 9000])
def test_bf16_norms_and_silu_round_the_fp32_result(gpu, hidden):
    """The prefill variants writing bf16 for the tensor-core GEMM: bit for bit the fp32 kernel's
    output rounded to nearest even (what ``to_bf16`` made of it), at the prefill block width."""
    rng = np.random.default_rng(hidden + 1)
    rows, eps, threads = 9, 1e-6, 512
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    d = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = gpu.put((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    out, out_bf16 = gpu.empty(rows * hidden * 4), gpu.empty(rows * hidden * 2)

    def same(want_f32):
        got = gpu.get(out_bf16, np.uint16, want_f32.shape)
        assert np.array_equal(got, from_float32(want_f32))

    gpu.launch("rmsnorm", (rows,), (threads,), (out, gpu.put(x), w, hidden, eps))
    gpu.launch("rmsnorm_bf16", (rows,), (threads,), (out_bf16, gpu.put(x), w, hidden, eps))
    same(gpu.get(out, np.float32, (rows, hidden)))
    x1, x2 = gpu.put(x), gpu.put(x)
    gpu.launch("add_rmsnorm", (rows,), (threads,), (x1, gpu.put(d), out, w, hidden, eps))
    gpu.launch("add_rmsnorm_bf16", (rows,), (threads,), (x2, gpu.put(d), out_bf16, w, hidden, eps))
    assert np.array_equal(gpu.get(x2, np.float32, (rows, hidden)), gpu.get(x1, np.float32, (rows, hidden)))
    same(gpu.get(out, np.float32, (rows, hidden)))
    # silu_mul_bf16 reads gate and up in bf16 (the cuBLASLt GEMM's output): the fp32 kernel on them.
    gu = from_float32(rng.standard_normal((rows, 2 * hidden)).astype(np.float32) * 4)
    gpu.launch("silu_mul", (-(-hidden // 256), rows), (256,), (out, gpu.put(to_float32(gu)), hidden))
    items = gpu.kernels["silu_mul_bf16"].meta["items"]
    gpu.launch("silu_mul_bf16", (-(-hidden // (256 * items)), rows), (256,), (out_bf16, gpu.put(gu), hidden))
    same(gpu.get(out, np.float32, (rows, hidden)))


@pytest.mark.parametrize("name,hidden", [("rmsnorm_rows_bf16", 4), ("rmsnorm_rows_bf16", 100),
                                         ("rmsnorm_rows_bf16", 4096), ("rmsnorm_rows_bf16", 9000),
                                         ("rmsnorm_block_bf16", 8), ("rmsnorm_block_bf16", 1000),
                                         ("rmsnorm_block_bf16", 4096)])
def test_row_norm_rounds_the_fp32_result(gpu, name, hidden):
    """The prefill's norms (``rmsnorm_rows_bf16``: a warp a row; ``rmsnorm_block_bf16``: a block a row
    from registers) against the fp32 ``rmsnorm`` rounded to bf16: their sums of squares add in another
    order, so a value may land one bf16 step away."""
    rng = np.random.default_rng(hidden + 2)
    rows, eps = 19, 1e-6  # not a multiple of the rows kernel's 8 rows a block
    x = gpu.put(rng.standard_normal((rows, hidden)).astype(np.float32) * 3)
    w = gpu.put((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    out = gpu.empty(rows * hidden * 4)
    gpu.launch("rmsnorm", (rows,), (1024,), (out, x, w, hidden, eps))
    meta = gpu.kernels[name].meta
    want = from_float32(gpu.get(out, np.float32, (rows, hidden))).astype(np.int32)
    for blocks in (-(-rows // meta.get("rows", 1)), 1):  # every row at once; one block taking every row
        out_bf16 = gpu.put(np.zeros((rows, hidden), np.uint16))
        gpu.launch(name, (blocks,), (meta["threads"],), (out_bf16, x, w, rows, hidden, eps))
        got = gpu.get(out_bf16, np.uint16, (rows, hidden)).astype(np.int32)
        assert np.abs(got - want).max() <= 1
        assert np.mean(got != want) < 1e-2


def _rope_ref(x, cos, sin):
    half = x.shape[-1] // 2
    return np.concatenate([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin], -1)


def _qkv_inputs(rng, rows, H, KV, D, max_ctx):
    """A random fused qkv activation, q/k norm weights, qkv bias and RoPE tables (base 10000)."""
    width = (H + 2 * KV) * D
    qkv = rng.standard_normal((rows, width)).astype(np.float32)
    qn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    kn = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(width)).astype(np.float32)
    angles = np.arange(max_ctx)[:, None] * (1.0 / 10000 ** (np.arange(0, D, 2) / D))[None]
    return qkv, qn, kn, bias, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 128), (4, 64), (8, 128)])
def test_rope_kv_and_paged_attention(gpu, kv_dtype, group, head_dim):
    """Prefill-style rows of two sequences with shuffled pages, contexts crossing split borders."""
    rng = np.random.default_rng(group * head_dim)
    KV, D, ps, layers, layer = 2, head_dim, 16, 2, 1
    H = KV * group
    lengths = [700, 37]  # 700 keys = 3 splits of 256
    max_ctx = 768
    max_pages = max_ctx // ps
    num_pages = 2 * max_pages + 3
    perm = rng.permutation(num_pages)
    tables = np.stack([perm[:max_pages], perm[max_pages:2 * max_pages]]).astype(np.int32)
    # Rows: the last 5 positions of sequence 0 and the last 3 of sequence 1.
    row_table = np.array([0] * 5 + [1] * 3, np.int32)
    positions = np.array([lengths[0] - 5 + i for i in range(5)] + [lengths[1] - 3 + i for i in range(3)], np.int32)
    rows = len(row_table)
    width = (H + 2 * KV) * D
    qkv, qn, kn, bias, cos, sin = _qkv_inputs(rng, rows, H, KV, D, max_ctx)
    itemsize = 4 if kv_dtype == "f32" else 2
    page_elems = layers * 2 * KV * ps * D
    # Earlier positions' K/V: random, written straight into the pool.
    hist_k = rng.standard_normal((2, max_ctx, KV, D)).astype(np.float32)
    hist_v = rng.standard_normal((2, max_ctx, KV, D)).astype(np.float32)
    if kv_dtype == "bf16":
        hist_k, hist_v = to_float32(from_float32(hist_k)), to_float32(from_float32(hist_v))
    pool = np.zeros((num_pages, layers, 2, KV, ps, D), np.float32)
    for s in range(2):
        for t in range(lengths[s]):
            p, slot = tables[s, t // ps], t % ps
            pool[p, layer, 0, :, slot] = hist_k[s, t]
            pool[p, layer, 1, :, slot] = hist_v[s, t]
    pool_dev = gpu.put(from_float32(pool) if kv_dtype == "bf16" else pool)
    layer_kv = pool_dev.at(layer * 2 * KV * ps * D * itemsize)
    qkv_dev = gpu.put(qkv)
    args = (qkv_dev, gpu.put(bias), gpu.put(qn), gpu.put(kn), gpu.put(cos), gpu.put(sin), layer_kv, page_elems,
            gpu.put(tables), max_pages, gpu.put(row_table), gpu.put(positions), H, KV, D, ps, 1, 1, 1e-6)
    rope = gpu.kernels[f"rope_kv_{kv_dtype}"]
    gpu.launch(rope.name, (rows, -(-(H + 2 * KV) // rope.meta["heads_per_block"])), (rope.meta["threads"],), args)
    # Reference for the rope part.
    x = qkv + bias
    q = x[:, :H * D].reshape(rows, H, D)
    k = x[:, H * D:(H + KV) * D].reshape(rows, KV, D)
    v = x[:, (H + KV) * D:].reshape(rows, KV, D)
    c, s_ = cos[positions][:, None], sin[positions][:, None]
    q = _rope_ref(rms_norm(q, qn, 1e-6), c, s_)
    k = _rope_ref(rms_norm(k, kn, 1e-6), c, s_)
    got_q = gpu.get(qkv_dev, np.float32, (rows, width))[:, :H * D].reshape(rows, H, D)
    assert _err(got_q, q) < 1e-5
    for r in range(rows):
        sq, t = row_table[r], positions[r]
        hist_k[sq, t] = k[r]
        hist_v[sq, t] = v[r]
    if kv_dtype == "bf16":
        hist_k, hist_v = to_float32(from_float32(hist_k)), to_float32(from_float32(hist_v))
    got_pool = gpu.get(pool_dev, np.uint16 if kv_dtype == "bf16" else np.float32, pool.shape)
    got_pool = to_float32(got_pool) if kv_dtype == "bf16" else got_pool
    for r in range(rows):
        sq, t = row_table[r], positions[r]
        p, slot = tables[sq, t // ps], t % ps
        assert _err(got_pool[p, layer, 0, :, slot], hist_k[sq, t]) < (1e-6 if kv_dtype == "f32" else 1e-2)
        assert np.array_equal(got_pool[p, layer, 1, :, slot], hist_v[sq, t])
    # Attention: split partials, then combine (splits of 256 and of 32 keys).
    for split in (256, 32, 96):
        _check_attention(gpu, kv_dtype, group, D, H, KV, ps, split, max_ctx, max_pages, tables, row_table, positions,
                         qkv_dev, layer_kv, page_elems, got_q, hist_k, hist_v)


@pytest.mark.parametrize("group,head_dim", [(4, 128), (2, 64), (1, 256)])
def test_rope_from_bf16_qkv_is_the_fp32_kernel_rounded(gpu, group, head_dim):
    """``rope_kv_bf16_qkv_bf16`` (the cuBLASLt prefill's: qkv as its GEMM wrote it, in bf16, a thread
    per 16 dims of a head) against ``rope_kv_bf16`` on the same bf16 values widened: q and the pool
    within one bf16 step (the q/k norm's squares add in another order), mostly equal."""
    rng = np.random.default_rng(group + head_dim)
    KV, D, ps, max_ctx = 2, head_dim, 16, 64
    H, rows = KV * group, 21
    max_pages = max_ctx // ps
    qkv, qn, kn, bias, cos, sin = _qkv_inputs(rng, rows, H, KV, D, max_ctx)
    qkv16 = from_float32(qkv)
    tables = rng.permutation(max_pages).astype(np.int32)[None]
    row_table = np.zeros(rows, np.int32)
    positions = np.arange(rows, dtype=np.int32) + 30
    page_elems = 2 * KV * ps * D
    results = {}
    extra = from_float32(rng.standard_normal((5, qkv.shape[1])))  # rows past the count: left alone
    for name, qkv_in in (("rope_kv_bf16", to_float32(qkv16)), ("rope_kv_bf16_qkv_bf16", qkv16)):
        pool = gpu.put(np.zeros(max_pages * page_elems, np.uint16))
        qkv_dev = gpu.put(np.concatenate([qkv_in, extra]) if qkv_in.dtype == np.uint16 else qkv_in)
        rope = gpu.kernels[name]
        args = (qkv_dev, gpu.put(bias), gpu.put(qn), gpu.put(kn), gpu.put(cos), gpu.put(sin), pool, page_elems,
                gpu.put(tables), max_pages, gpu.put(row_table), gpu.put(positions), H, KV, D, ps, 1, 1, 1e-6)
        if "dims_per_thread" in rope.meta:
            from ninfer.backends.cuda.forward import rope_chunks_grid

            grid = rope_chunks_grid(rope.meta, rows, H + 2 * KV, D)
            gpu.launch(name, (grid[0], min(grid[1], 4)), (rope.meta["threads"],), args + (rows,))  # rows loop over y
        else:
            gpu.launch(name, (rows, -(-(H + 2 * KV) // rope.meta["heads_per_block"])), (rope.meta["threads"],), args)
        q = gpu.get(qkv_dev, qkv_in.dtype, (rows + (5 if qkv_in.dtype == np.uint16 else 0), qkv_in.shape[1]))
        if qkv_in.dtype == np.uint16:
            assert np.array_equal(q[rows:], extra)
        q = q[:rows, :H * D]
        q = from_float32(q) if q.dtype == np.float32 else q
        results[name] = (q, gpu.get(pool, np.uint16, (max_pages * page_elems,)))
    for got, want in zip(results["rope_kv_bf16_qkv_bf16"], results["rope_kv_bf16"]):
        step = np.abs(to_float32(got) - to_float32(want)) / np.maximum(np.abs(to_float32(want)), 1e-30)
        assert step.max() <= 2 ** -7  # one bf16 step at most
        assert np.mean(got != want) < 2e-2
    assert np.count_nonzero(results["rope_kv_bf16"][1]) > 0


def _check_attention(gpu, kv_dtype, group, D, H, KV, ps, split, max_ctx, max_pages, tables, row_table, positions,
                     qkv_dev, layer_kv, page_elems, got_q, hist_k, hist_v):
    rows = len(row_table)
    n_splits = -(-max_ctx // split)
    split_ptr = gpu.put(np.array([split], np.int32))
    part_o = gpu.empty(rows * H * n_splits * D * 4)
    part_ml = gpu.empty(rows * H * n_splits * 2 * 4)
    out = gpu.empty(rows * H * D * 4)
    scale = float(np.float32(D ** -0.5))
    gpu.launch(f"attention_g{group}_d{D}_{kv_dtype}", (KV, rows, n_splits), (128,),
               (qkv_dev, layer_kv, page_elems, gpu.put(tables), max_pages, gpu.put(row_table), gpu.put(positions),
                part_o, part_ml, H, KV, ps.bit_length() - 1, split_ptr, n_splits, scale))
    gpu.launch("attention_combine", (H, rows), (4 * D,), (out, part_o, part_ml, gpu.put(positions), H, n_splits, D, split_ptr))
    got = gpu.get(out, np.float32, (rows, H * D))
    for r in range(rows):
        sq, t = row_table[r], positions[r]
        want = ref_attention(got_q[r][None, None], hist_k[sq][None, :t + 1], hist_v[sq][None, :t + 1],
                             np.array([[t]]), scale)
        # Softmax turns the ~1e-6 relative rounding of k (GPU vs NumPy rope) into ~1e-5 absolute
        # score error at |score| ~ 10, hence 1e-4 rather than fp32's 1e-6.
        assert _err(got[r], want.reshape(-1)) < 1e-4, r


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (2, 128), (4, 128), (8, 64), (8, 128)])
def test_decode_attention_appends_and_attends(gpu, kv_dtype, group, head_dim):
    """One launch per layer: rope + norm + bias, the KV append and split attention with its merge.

    Four decode rows (each its own sequence, shuffled pages) with 700, 37, 1 and 96 keys: the new
    key alone, a split ending exactly at the new key, one split (direct output) and up to 22 (over
    the bf16 pool on tensor cores, over the fp32 pool on CUDA cores)."""
    _decode_attention_case(gpu, kv_dtype, group, head_dim, 16, [700, 37, 1, 96], 768,
                           ((32, 1, 0, 0), (256, 2, 1, -48), (96, 3, 0.5, 16), (768, 3, 0, 4096), (32, 0, 1, 0)))


@pytest.mark.parametrize("ps", [4, 64])
@pytest.mark.parametrize("group,head_dim", [(1, 128), (4, 128), (8, 64)])
def test_decode_attention_over_other_page_sizes(gpu, group, head_dim, ps):
    """The bf16 pool's kernel with pages of 4 keys (a tensor-core tile of 16 keys spans pages) and of 64
    (a page holds tiles of several warps): rows of 2300, 37 and 1 keys in one split (a warp folds 36
    tiles) and in splits of 64 and 256."""
    _decode_attention_case(gpu, "bf16", group, head_dim, ps, [2300, 37, 1], 2304,
                           ((2304, 0, 0, 0), (64, 1, 0, 0), (256, 2, 0.5, 16)))


def _decode_attention_case(gpu, kv_dtype, group, head_dim, ps, lengths, max_ctx, launches):
    """``decode_attention`` of ``lengths`` keys a row (the last appended by the launch)
    over pages of ``ps`` keys against NumPy, once per (split length, prefetch bits, share of the pool's
    bytes and bytes more that the launch asks L2 for) of ``launches``; then the appended K/V."""
    rng = np.random.default_rng(7 * group + head_dim + ps)
    KV, D, layers, layer = 2, head_dim, 2, 1
    H = KV * group
    lengths = np.array(lengths)
    rows = len(lengths)
    max_pages = max_ctx // ps
    num_pages = rows * max_pages + 3
    tables = rng.permutation(num_pages)[:rows * max_pages].reshape(rows, max_pages).astype(np.int32)
    positions = (lengths - 1).astype(np.int32)
    qkv, qn, kn, bias, cos, sin = _qkv_inputs(rng, rows, H, KV, D, max_ctx)
    as_pool = (lambda a: to_float32(from_float32(a))) if kv_dtype == "bf16" else (lambda a: a)
    hist_k = as_pool(rng.standard_normal((rows, max_ctx, KV, D)).astype(np.float32))
    hist_v = as_pool(rng.standard_normal((rows, max_ctx, KV, D)).astype(np.float32))
    pool = np.zeros((num_pages, layers, 2, KV, ps, D), np.float32)
    for r in range(rows):
        for t in range(lengths[r] - 1):  # earlier positions; the step appends the last
            pool[tables[r, t // ps], layer, :, :, t % ps] = hist_k[r, t], hist_v[r, t]
    # What the step must compute: q and the new k post-processed like rope_kv, v with its bias.
    x = qkv + bias
    c, s_ = cos[positions][:, None], sin[positions][:, None]
    q = _rope_ref(rms_norm(x[:, :H * D].reshape(rows, H, D), qn, 1e-6), c, s_)
    hist_k[np.arange(rows), positions] = as_pool(_rope_ref(rms_norm(x[:, H * D:(H + KV) * D].reshape(rows, KV, D),
                                                                     kn, 1e-6), c, s_))
    hist_v[np.arange(rows), positions] = as_pool(x[:, (H + KV) * D:].reshape(rows, KV, D))
    scale = float(np.float32(D ** -0.5))
    want = [ref_attention(q[r][None, None], hist_k[r][None, :lengths[r]], hist_v[r][None, :lengths[r]],
                          np.zeros((1, 1, 1, 1, lengths[r]), np.float32), scale).reshape(-1) for r in range(rows)]
    itemsize = 4 if kv_dtype == "f32" else 2
    pool_dev = gpu.put(from_float32(pool) if kv_dtype == "bf16" else pool)
    layer_kv = pool_dev.at(layer * 2 * KV * ps * D * itemsize)
    counters = gpu.put(np.zeros(rows * KV, np.int32))
    d_qkv, d_tables, d_positions = gpu.put(qkv), gpu.put(tables), gpu.put(positions)
    name = f"decode_attention_g{group}_d{D}_{kv_dtype}"
    # A split of max_ctx: no merge; a length again: the tickets were reset. ``prefetch`` bits: 1, pages
    # asked of L2 before the wait; 2, the first ``ahead`` bytes of a "next kernel's weights" (the pool
    # itself) asked of L2 after it. Hints that must change nothing (the last block's share is a short one).
    pool_bytes = pool.size * itemsize
    for split, prefetch, share, more in launches:
        ahead = int(share * pool_bytes) + more
        n_splits = -(-max_ctx // split)
        part_o, part_ml = gpu.empty(rows * H * n_splits * D * 4), gpu.empty(rows * H * n_splits * 2 * 4)
        out = gpu.empty(rows * H * D * 4)
        gpu.launch(name, (KV, rows, n_splits), (gpu.kernels[name].meta["threads"],),
                   (d_qkv, gpu.put(bias), gpu.put(qn), gpu.put(kn), gpu.put(cos), gpu.put(sin), layer_kv, layer_kv,
                    pool.size // num_pages, d_tables, max_pages, gpu.put(np.arange(rows, dtype=np.int32)), d_positions,
                    out, part_o, part_ml, counters, H, KV, ps.bit_length() - 1,
                    gpu.put(np.array([split, prefetch], np.int32)), n_splits, scale, 1, 1, 1e-6, pool_dev, ahead))
        got = gpu.get(out, np.float32, (rows, H * D))
        for r in range(rows):
            assert _err(got[r], want[r]) < 1e-4, (split, r)
        assert not gpu.get(counters, np.int32, (rows * KV,)).any(), split
    got_pool = gpu.get(pool_dev, np.uint16 if kv_dtype == "bf16" else np.float32, pool.shape)
    got_pool = to_float32(got_pool) if kv_dtype == "bf16" else got_pool
    for r in range(rows):
        t = positions[r]
        page, slot = tables[r, t // ps], t % ps
        assert _err(got_pool[page, layer, 0, :, slot], hist_k[r, t]) < (1e-6 if kv_dtype == "f32" else 1e-2)
        assert np.array_equal(got_pool[page, layer, 1, :, slot], hist_v[r, t])


def _sample_gpu(gpu, logits, counts, lanes, rows_params):
    rows, vocab = logits.shape
    fparams = np.array([[p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty]
                        for p in rows_params], np.float32)
    iparams = np.array([[p.top_k if 1 <= p.top_k <= 20 else 0, lane] for p, lane in zip(rows_params, lanes)], np.int32)
    keys = np.array([[p.seed & (2**64 - 1), p.step] for p in rows_params], np.uint64)
    meta = gpu.kernels["sample"].meta
    parts = max(1, min(meta["max_parts"], -(-vocab // meta["threads"])))
    slots = rows * parts * meta["top_k_cap"] * 4
    out, part_v, part_i = gpu.empty(rows * 4), gpu.empty(slots), gpu.empty(slots)
    d_f, d_i = gpu.put(fparams), gpu.put(iparams)
    gpu.launch("sample_partial", (parts, rows), (meta["threads"],),
               (part_v, part_i, gpu.put(logits), gpu.put(counts), d_f, d_i, vocab, parts))
    gpu.launch("sample", (rows,), (meta["threads"],), (out, part_v, part_i, d_f, d_i, gpu.put(keys), vocab, parts))
    return gpu.get(out, np.int32, (rows,))


@pytest.mark.parametrize("vocab", [5, 1000, 16387, 151936])
def test_sampling_matches_the_rule(gpu, vocab):
    rng = np.random.default_rng(vocab)
    rows = 8
    params = [SamplingRow(), SamplingRow(presence_penalty=1.5, frequency_penalty=0.5),
              SamplingRow(temperature=0.7, seed=-3, step=4), SamplingRow(temperature=1.0, top_k=5, seed=9, step=0),
              SamplingRow(temperature=1.3, top_p=0.8, seed=2**62, step=11),
              SamplingRow(temperature=0.9, min_p=0.1, seed=42, step=1),
              SamplingRow(temperature=1.0, top_p=0.9, min_p=0.05, top_k=20, presence_penalty=0.4, seed=7, step=99),
              SamplingRow(temperature=2.0, seed=1, step=2)]
    lanes = np.arange(rows)
    counts = rng.integers(0, 3, (rows, vocab)).astype(np.int32) * (rng.random((rows, vocab)) < 0.1)
    counts = counts.astype(np.int32)
    for trial in range(3):
        logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
        logits[0, :3] = logits[0].max() + 1  # a tie: the lowest index wins
        # Ties that straddle vocabulary slices, among the top-k of a sampled row.
        logits[3, [vocab - 1, vocab // 2, 1]] = logits[3].max() + 0.5
        got = _sample_gpu(gpu, logits, counts, lanes, params)
        want = [sample_row(logits[i], params[i], counts[i]) for i in range(rows)]
        assert got.tolist() == want, trial


def test_typed_launch_rejects_bad_arguments(gpu):
    from ninfer.backends.cuda import runtime as rt

    kernel = gpu.kernels["silu_mul"]
    buf = gpu.empty(64)
    with pytest.raises(TypeError, match="argument 0 must be a DevicePtr"):
        kernel.launch((1,), (32,), (buf.addr, buf, 4), gpu.stream)
    with pytest.raises(TypeError, match="argument 2 must be an int"):
        kernel.launch((1,), (32,), (buf, buf, 4.0), gpu.stream)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        kernel.launch((1,), (32,), (buf, buf), gpu.stream)
    with pytest.raises(rt.CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        kernel.launch((1,), (4096,), (buf, buf, 4), gpu.stream)
