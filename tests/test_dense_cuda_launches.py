"""The dense CUDA forward's launches, checked on the CPU against ptx/manifest.json (tests/fake_cuda.py).

At the Qwen3-8B shape (2 layers): every kernel of a decode step of 1..8 rows is in ``kernel_names()``
(modules cannot load during graph capture), with and without fragment-order copies of the weights
(whose FRAG builds, and only those, read them), each fused decode GEMM stays inside its buffers, and the
step overlaps its launches exactly where its GEMMs are all the fp32 GEMV (else its attention and staged
ring GEMMs overlap); a cuBLASLt prefill launches
the chunked rope (a thread per 16 dims of a head) over exactly its rows and the persistent attention
at no more blocks than the GPU holds or there are items.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

fw = pytest.importorskip("ninfer.backends.cuda.forward")

from fake_cuda import FakeDevice, FakeKernels, check_decode_gemm  # noqa: E402

from ninfer.backends.cuda.weights import device_layout  # noqa: E402
from ninfer.convert.random_model import LARGE_PRESETS  # noqa: E402

CONFIG = attrs.evolve(LARGE_PRESETS["qwen3-8b"], num_layers=2)
MAX_BATCH = 8


class FakeLt:
    """cuBLASLt's place in the prefill: records each GEMM's shape and options."""

    def __init__(self):
        self.calls = []
        self.rows = []

    def matmul(self, y, x, w, rows, n, k, stream, accumulate=False, out_bf16=False):
        assert x.nbytes >= rows * k * 2 and w.nbytes >= n * k * 2
        assert y.nbytes >= rows * n * (2 if out_bf16 else 4)
        self.calls.append((n, k, accumulate, out_bf16))
        self.rows.append(rows)


def forward(max_rows=64, lt=None, fragments=False):
    """The Forward of a runner, with the fragment-order copies of ``fw.FRAGMENT_ORDER`` or none."""
    device = FakeDevice()
    buffers = fw.StepBuffers(device, CONFIG, page_size=16, num_pages=64, max_batch=MAX_BATCH, max_context=256,
                             max_rows=max_rows, kv_dtype="bf16", tensor_core_prefill=lt is not None)
    layout = device_layout(CONFIG)
    weights = {name: device.alloc(int(np.prod(shape)) * (2 if kind == "bf16" else 4), name)
               for name, (shape, kind) in layout.items()}
    copies = {name: device.alloc(fw.fragment_bytes(*layout[name][0], fw.fragment_tiles(matrix), matrix == "gate_up"),
                                 name + " fragments")
              for name in layout for matrix in fw.FRAGMENT_ORDER if fragments and name.endswith("." + matrix)}
    return fw.Forward(FakeKernels(), CONFIG, weights, buffers, page_size=16, kv_dtype="bf16", lt=lt,
                      fragments=copies)


@pytest.mark.parametrize("fragments", [False, True])
def test_decode_launches_are_preloaded_in_bounds_and_overlapped_where_they_preload(fragments):
    """Every launch overlaps its predecessor where the step's GEMMs are the fp32 GEMV (it preloads);
    with tensor-core GEMMs the attention launches do, and the staged o and down GEMMs (``staged``), in
    their ring shape, which copies its first slots of weights before the wait. With fragment-order
    copies the tensor-core GEMMs are FRAG builds (``f``), read from the copies."""
    fwd = forward(fragments=fragments)
    assert fwd.staged == {"o": fw.STAGED_SHAPE, "down": fw.STAGED_SHAPE}
    ring = fw.decode_gemm_name("o", "residual", False, MAX_BATCH, shape=fw.STAGED_SHAPE) + ("fn" if fragments else "n")
    assert fwd.k[ring].meta["shared"] > 0  # a ring: its first slots go out before the wait
    preloaded = set(fwd.kernel_names())
    for staged in (fwd.staged, {}):
        fwd.staged = staged
        for rows in range(1, MAX_BATCH + 1):
            fwd.k.log.clear()
            fwd.k.overlaps.clear()
            fwd.decode(rows, None)
            launched = [kernel.name for kernel, _, _ in fwd.k.log]
            assert set(launched) <= preloaded, sorted(set(launched) - preloaded)
            for kernel, grid, args in fwd.k.log:
                if "epilogue" in kernel.meta:
                    check_decode_gemm(kernel, grid, *args)
                    # a FRAG build reads a copy, every other GEMM the row-major weights
                    frag = bool(kernel.meta.get("frag"))
                    assert frag == args[2].label.endswith(" fragments"), kernel.name
                    if kernel.name.startswith("mma_gemv_") and "t4w8u1s3" not in kernel.name:  # but the LM head's
                        assert frag == fragments, kernel.name
            fp32_only = all(fw.DECODE_GEMMS[matrix][rows] == "fp32" for matrix in fw.DECODE_GEMMS)
            assert launched[0] == "count_tokens" and not fwd.k.overlaps[0]
            assert any(name.startswith("gemv_normed_swiglu_m") for name in launched) == fp32_only
            if fp32_only:
                assert all(fwd.k.overlaps[1:]), (rows, fwd.k.overlaps)
                continue
            # decode attention overlaps the q/k/v GEMM (it stages keys before it waits), the staged GEMMs theirs
            layer = [fwd.decode_attention_name] + [ring] * len(staged)
            overlapped = [name for name, on in zip(launched, fwd.k.overlaps) if on]
            assert overlapped == layer * CONFIG.num_layers, (rows, overlapped)
            # o and down in the ring shape: staged, or unstaged where DECODE_GEMMS picks it anyway
            assert launched.count(ring) == (2 * CONFIG.num_layers if staged or rows >= 7 else 0), rows
    fwd.overlap = False  # the master switch: nothing overlaps, and nothing is staged
    fwd.staged = {"o": fw.STAGED_SHAPE, "down": fw.STAGED_SHAPE}
    fwd.k.log.clear()
    fwd.k.overlaps.clear()
    fwd.decode(4, None)
    assert not any(fwd.k.overlaps) and ring not in [kernel.name for kernel, _, _ in fwd.k.log]


@pytest.mark.parametrize("rows", [300, 64])
def test_cublaslt_prefill_ropes_exactly_its_rows(rows):
    lt = FakeLt()
    fwd = forward(max_rows=512, lt=lt)
    fwd.layers(rows, None)
    ropes = [(grid, args) for kernel, grid, args in fwd.k.log if kernel.name == "rope_kv_bf16_qkv_bf16"]
    assert len(ropes) == CONFIG.num_layers
    kernel = fwd.k["rope_kv_bf16_qkv_bf16"]
    threads = kernel.meta["threads"]
    per_row = (CONFIG.num_heads + 2 * CONFIG.num_kv_heads) * CONFIG.head_dim // kernel.meta["dims_per_thread"]
    for grid, args in ropes:
        assert (grid[0] - 1) * threads < per_row <= grid[0] * threads
        assert grid[1] == -(-rows // fw.ROPE_ROWS_PER_THREAD)  # every row, each block a few in turn
        assert args[-1] == rows
    # qkv and gate_up come out in bf16 (rope and SiLU-mul read them), o and down add into x.
    assert (CONFIG.qkv_size, CONFIG.hidden_size, False, True) in lt.calls
    assert (CONFIG.hidden_size, CONFIG.intermediate_size, True, False) in lt.calls
    # The tensor-core attention (bf16 out) runs persistent: one block an SM, or one an item if fewer.
    attention = [(kernel, grid) for kernel, grid, _ in fwd.k.log if kernel.name == fw.PREFILL_ATTENTION[128] + "_bf16"]
    assert len(attention) == CONFIG.num_layers
    for kernel, grid in attention:
        items = CONFIG.num_heads * -(-rows // kernel.meta["rows"])
        assert kernel.meta["persistent"] == 1 and grid == (min(items, fwd.k.device.sm_count),)


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_a_prefill_pass_runs_its_last_layer_past_the_kv_for_its_outputs_alone(tensor_cores):
    """``layers(outputs=...)``: every layer appends its K/V (the rope); past the last one's, "none"
    launches nothing, and "last" (with the tensor-core attention: cuBLASLt GEMMs) attends, projects
    and normalises only the last row, read from its place in ``qkv`` and the inputs, its residual
    and hidden state at theirs; the fp32 path runs every row."""
    lt = FakeLt() if tensor_cores else None
    fwd = forward(max_rows=512, lt=lt)
    b, rows, c = fwd.b, 300, CONFIG
    launches = {}
    for outputs in ("all", "last", "none"):
        fwd.k.log.clear()
        if lt:
            lt.calls.clear()
            lt.rows.clear()
        fwd.layers(rows, None, outputs=outputs)
        log = fwd.k.log
        ropes = [i for i, (kernel, _, _) in enumerate(log) if kernel.name.startswith("rope_kv")]
        assert len(ropes) == c.num_layers
        tail = log[ropes[-1] + 1:]
        launches[outputs] = (len(log), list(lt.rows) if lt else [])
        if outputs == "none":
            assert tail == []
        elif outputs == "last" and tensor_cores:
            attention, grid, args = tail[0]
            assert attention.name == fw.PREFILL_ATTENTION[128] + "_bf16"
            first = rows - 1
            assert args[0].addr == b.qkv.addr + first * c.qkv_size * 2 and args[-5] == 1
            assert args[5].addr == b.inputs.d_row_table.addr + 4 * first
            assert args[6].addr == b.inputs.d_positions.addr + 4 * first
            final = tail[-1]
            assert final[0].name == "rmsnorm" and final[1] == (1,)
            assert final[2][0].addr == b.h.addr + first * c.hidden_size * 4
            assert final[2][1].addr == b.x.addr + first * c.hidden_size * 4
    if tensor_cores:  # o, gate_up and down of the last layer on one row
        assert launches["last"][1] == launches["all"][1][:-3] + [1, 1, 1]
        assert launches["none"][1] == launches["all"][1][:-3]
        assert launches["last"][0] == launches["all"][0]
    else:
        assert launches["last"] == launches["all"]
    assert launches["none"][0] < launches["all"][0]


def test_prefill_attention_grid():
    """A block per (head, row tile), or for a persistent kernel as many blocks as fit the GPU (each
    then takes items in rounds) but never more than there are items."""
    assert fw.prefill_attention_grid({"rows": 128}, 32, 8192, 132) == (32, 64)
    assert fw.prefill_attention_grid({"rows": 128}, 32, 129, 132) == (32, 2)
    assert fw.prefill_attention_grid({"rows": 128, "persistent": 1}, 32, 8192, 132) == (132,)
    assert fw.prefill_attention_grid({"rows": 128, "persistent": 1}, 32, 300, 132) == (96,)
    assert fw.prefill_attention_grid({"rows": 128, "persistent": 2}, 8, 8192, 132) == (264,)


def test_decode_graph_depths_hold_every_split():
    """A step is captured at each depth of ``decode_depths`` and runs at the shallowest holding its
    splits: attention's grid is that deep, and no depth leaves a split of the longest row out."""
    fwd = forward()  # max_context 256: splits of 32 keys at most 8 deep
    depths = fwd.decode_depths()
    assert depths == (1, 2, 3, 4, 5, 6, 8)
    for rows in (1, 8):
        for length in range(1, 257):
            split = fwd.decode_split(length, rows)
            depth = fwd.decode_depth(split, length)
            shallower = depths[depths.index(depth) - 1] if depth > 1 else 0
            assert depth * split >= length > shallower * split, (rows, length, split, depth)
    for depth in fwd.decode_depths():
        fwd.k.log.clear()
        fwd.decode(2, None, depth)
        grids = [grid for kernel, grid, _ in fwd.k.log if kernel.name.startswith("decode_attention")]
        assert len(grids) == CONFIG.num_layers and all(grid[2] == depth for grid in grids)


def test_tensor_core_steps_chain_their_norms():
    """Where every decode GEMM is on the tensor cores, o and down write the next norm's input (with the
    weights of the norm that follows them) and the normed GEMMs after them read it; the first q/k/v
    (after the embedding) normalises its input itself. Fewer rows keep the normed fp32 GEMVs."""
    fwd = forward()
    fwd.chain_norm = True
    L = CONFIG.num_layers
    follows = [name for i in range(L)
               for name in (f"layers.{i}.mlp_norm", f"layers.{i + 1}.attn_norm" if i + 1 < L else "final_norm")]
    for rows in range(1, MAX_BATCH + 1):
        fwd.k.log.clear()
        fwd.k.overlaps.clear()
        fwd.decode(rows, None)
        gemms = [(kernel.meta, args) for kernel, _, args in fwd.k.log if "epilogue" in kernel.meta]
        chains = [meta.get("chain") for meta, _ in gemms]
        if not fw.chains_norms(rows):
            assert not any(chains), rows
            continue
        assert fwd.chains(rows)
        assert chains == [None, "out", "in", "out"] + ["in", "out", "in", "out"] * (L - 1) + ["in"], rows
        assert gemms[0][0]["normed"] == 1
        producers = [args for meta, args in gemms if meta.get("chain") == "out"]
        assert [args[3] for args in producers] == [fwd.w[name] for name in follows]  # each norm's weights
        assert all(args[-2] is fwd.b.xn for args in producers)
        consumers = [args for meta, args in gemms if meta.get("chain") == "in"]
        assert all(args[1] is fwd.b.xn and args[-2] is fwd.b.norm_part for args in consumers)
        assert all(fwd.k.overlaps[1:])  # a chained step overlaps every launch after count_tokens
    fwd.chain_norm = False  # the default: every step normalises in its GEMMs
    fwd.k.log.clear()
    fwd.decode(MAX_BATCH, None)
    assert not any(kernel.meta.get("chain") for kernel, _, _ in fwd.k.log)


def test_decode_attention_asks_l2_for_a_share_of_its_o_projection():
    """Each layer's ``decode_attention`` gets that layer's o projection and the first
    ``attention_prefetch`` of its bf16 bytes (a multiple of 16, inside the matrix); the step input's
    bits ask for it wherever the share is set, and for the keys only where ``kv_prefetch`` is on and a
    layer of them fits the budget."""
    fwd = forward()
    o_bytes = CONFIG.hidden_size * CONFIG.q_size * 2
    fwd.decode(4, None)
    launches = [args for kernel, _, args in fwd.k.log if kernel.name.startswith("decode_attention")]
    assert len(launches) == CONFIG.num_layers
    for i, args in enumerate(launches):
        target, nbytes = args[-2:]
        assert target is fwd.w[f"layers.{i}.o"] and target.nbytes == o_bytes
        assert nbytes == o_bytes * fwd.attention_prefetch // 16 * 16 and 0 < nbytes <= o_bytes and nbytes % 16 == 0
    fits = fwd.kv_prefetch_bytes // fwd.layer_kv_bytes_per_key
    assert fwd.decode_prefetch(fits) == fw.PREFETCH_O  # the keys are not asked for by default
    fwd.kv_prefetch = True
    assert fwd.decode_prefetch(fits) == fw.PREFETCH_KEYS | fw.PREFETCH_O
    assert fwd.decode_prefetch(fits + 1) == fw.PREFETCH_O
    fwd.attention_prefetch = 0.0
    assert fwd.decode_prefetch(fits + 1) == 0


def test_batched_gemms_ask_l2_for_the_next_gemms_weights_where_set():
    """With ``gemm_prefetch`` set, a tensor-core step's q/k/v, o, gate/up and down launch their NEXT
    builds with the weights of the GEMM that follows them (o, gate/up, down, the next layer's q/k/v or
    the LM head) and at most the bytes asked; one- and two-row steps (fp32 GEMVs) and unset matrices
    keep the plain kernels."""
    fwd = forward()
    asks = {"o": 3 << 20, "gate_up": 1 << 40, "down": 5000}
    fwd.gemm_prefetch = {matrix: {rows: nbytes for rows in range(1, MAX_BATCH + 1)} for matrix, nbytes in asks.items()}
    L, w = CONFIG.num_layers, fwd.w
    following = {"o": [w[f"layers.{i}.gate_up"] for i in range(L)],
                 "gate_up": [w[f"layers.{i}.down"] for i in range(L)],
                 "down": [w[f"layers.{i + 1}.qkv"] for i in range(L - 1)] + [fwd.lm_head]}
    for rows in range(1, MAX_BATCH + 1):
        fwd.k.log.clear()
        fwd.decode(rows, None)
        seen = {"o": [], "gate_up": [], "down": []}
        for kernel, _, args in fwd.k.log:
            if kernel.meta.get("next"):
                matrix = "gate_up" if kernel.meta["epilogue"] == "swiglu" else "o" if args[1] is fwd.b.attn else "down"
                seen[matrix].append(args[-2:])
            elif "epilogue" in kernel.meta and rows > 2 and kernel.meta["epilogue"] != "store":
                raise AssertionError(f"{kernel.name}: no NEXT build at {rows} rows")
        if rows <= 2:
            assert not any(seen.values()), rows
            continue
        for matrix, launches in seen.items():
            assert [then for then, _ in launches] == following[matrix], (rows, matrix)
            asked = asks[matrix]
            assert all(ahead == min(asked, then.nbytes) // 16 * 16 for then, ahead in launches), (rows, matrix)


def test_default_gemm_prefetch_by_rows():
    """The default policy (forward.GEMM_PREFETCH, less gate/up's where down is staged): o and down ask
    for 8 MiB from 3 rows on, down 16 MiB at 7 and 8 rows; gate/up asks for nothing (the staged down
    copies its own first weights over gate/up's tail)."""
    fwd = forward()
    assert "gate_up" not in fwd.gemm_prefetch
    for rows in (3, 4, 7, 8):
        fwd.k.log.clear()
        fwd.decode(rows, None)
        asked = [(kernel.meta["epilogue"], args[1] is fwd.b.act, args[-1])
                 for kernel, _, args in fwd.k.log if kernel.meta.get("next")]
        assert {epilogue for epilogue, _, _ in asked} == {"residual"}, rows
        down = 16 << 20 if rows >= 7 else 8 << 20
        assert all(nbytes == (down if is_down else 8 << 20) for _, is_down, nbytes in asked), rows
        assert len(asked) == 2 * CONFIG.num_layers, rows
