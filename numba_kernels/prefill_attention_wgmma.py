"""Causal prefill attention on Hopper's warpgroup MMAs (wgmma, sm_90a): head_dim 64 and 128.

Same contract, parameters and grid as ``prefill_attention_d{D}`` (numba_kernels/prefill_attention.py:
the paged bf16 pool, rows of several sequences in one launch, heads fastest, last row tile first);
the difference is how the products are computed. A block is ``WGS`` warpgroups of 64 query rows
each, sharing every K/V tile. Per tile a warpgroup issues S = q·Kᵀ as 8 asynchronous 64 x BK x 16
wgmmas reading q and K straight from shared memory, waits, runs the online softmax on the
accumulators (as the mma.sync kernel does, per lane and its quad), packs P to bf16 in registers and
issues O += P·V as BK / 16 wgmmas of 64 x D x 16 with V read MN-major. One wgmma replaces 32
``mma.sync`` of a warp and needs no fragment loads: the instruction count per MMA, which held the
mma.sync kernel at about 240 TFLOP/s, drops by an order of magnitude.

Shared memory (dynamic, 1024-byte aligned at run time): q of the block's rows, then ``STAGES``
stages of K and V, each in 128-byte-swizzled panels of 64 dims (wgmma.py has the layout). K/V
tiles are copied with ``cp.async`` from the pages (a warp's rows from one page); q is read once
(from the fp32 ``qkv`` rounded to bf16, or, in the ``_bf16`` kernels, from the bf16 ``qkv`` that the
cuBLASLt prefill writes) and stored swizzled. How the stages pass between the copying and the
computing threads is the shape's hand-over (below): head_dim 128 has a copying warpgroup of its own
and mbarriers, head_dim 64 a block barrier a tile.

A block's work is items (a head and a tile of rows). Launched as a grid of (heads, row tiles) a block
has one; the shapes with a copying warpgroup are launched persistent (meta ``persistent``: one block an
SM, ``forward.prefill_attention_grid``), each block taking items in rounds, and the copying warpgroup
runs on into the next item's tiles while the computing ones finish an item and write it out.
"""

from __future__ import annotations

import math
import os

from numba import cuda, float32, int32, int64, uint32, uint64

from numba_kernels.common import (asm_statement, cp_async16, cp_async_commit, cp_async_wait, global_address, lds_u32,
                                  lds_u32x4, shared_address, store_u32x4, sts_u32, sts_u32x4)
from numba_kernels.mbarrier import cp_async_arrive, mbarrier_arrive, mbarrier_init, mbarrier_try_wait
from numba_kernels.mma import pack_bf16x2
from numba_kernels.prefill_attention import (SIGNATURE, SIGNATURE_BF16, exp2_approx, inverse_row_sums, page_of,
                                             q_pair_bf16, q_pair_f32, row_run, store_pair_bf16, store_pair_f32)
from numba_kernels.wgmma import (descriptor_low, descriptor_of, fence_proxy_async, make_mma_rs, make_mma_ss,
                                 make_setmaxnreg, make_wait, wgmma_commit, wgmma_fence)

NEG_INF = float32(-math.inf)
PANEL_ROW = 128  # bytes of a swizzled panel row: 64 bf16
# How a block's warpgroups hand the K/V stages over (the last item of a shape, and its name suffix):
# ""   a block barrier a tile; with three stages or more the scores of a tile fly with the P·V of the
#      tile before (PIPELINED below);
# "mb" mbarriers a stage (MBAR), so the warpgroups need not be at the same tile;
# "p"  mbarriers, and a copying warpgroup beside the two computing ones (PRODUCER);
# "pp" "p" with the computing warpgroups pipelined as PIPELINED (PIPE).
# A trailing "q" (QREG): each computing thread holds its rows of q as MMA A fragments in registers,
# so q·Kᵀ reads only K from shared memory (m64n64k16 from shared memory moves as many bytes as it
# multiplies).
# head_dim -> (warpgroups computing, keys a tile, stages, register cap, hand-over) of the production
# kernels. On the H200 (tools/bench_prefill_attention.py, Qwen3-8B's 32/8 heads, 8192 tokens; chunks
# of 1024 in brackets), head_dim 128: "ppq" with 64-key tiles in four stages 447-450 (426-429) TFLOP/s
# since a block finds its row run with a ballot (prefill_attention.row_run; 415-416 (397) before),
# where "pp" read 404 (387-388) in the same runs, and "pp" with the computing warpgroups taking turns
# to issue their MMAs (FlashAttention-3's ping-pong, named barriers) 400-402 (382-385), 409 (390) with
# "q"; earlier sessions: "pp" 403-411 (389-393);
# "p" unpipelined 378 (363); a block barrier a tile, two blocks an SM at 128 registers, 398 (357) (the
# head_dim 64 kernel's shape), 308 (295) uncapped, 376 (339) with 32-key tiles in 4 stages pipelined;
# the mma.sync kernel 239 (229), torch SDPA 584-600. Table in docs/benchmarks.md.
SHAPES = {128: (2, 64, 4, 168, "ppq"), 64: (2, 64, 2, 128, "")}
# Shapes to time against them (tools/bench_prefill_attention.py --variants), head_dim 128, name
# suffix wg{warpgroups}k{keys}s{stages}[m{registers}]{hand-over}.
VARIANTS = {"wg2k32s4m128": (2, 32, 4, 128, ""), "wg1k32s2m128": (1, 32, 2, 128, ""),
            "wg2k32s2m128": (2, 32, 2, 128, ""), "wg2k32s3m128": (2, 32, 3, 128, ""),
            "wg2k64s2m128": (2, 64, 2, 128, ""),
            "wg2k64s2m128mb": (2, 64, 2, 128, "mb"), "wg2k32s4m128mb": (2, 32, 4, 128, "mb"),
            "wg4k64s2m128mb": (4, 64, 2, 128, "mb"), "wg3k96s2m168mb": (3, 96, 2, 168, "mb"),
            "wg2k128s2p": (2, 128, 2, 168, "p"), "wg2k64s4p": (2, 64, 4, 168, "p"),
            "wg2k128s3p": (2, 128, 3, 168, "p"),
            "wg2k128s3pp": (2, 128, 3, 168, "pp"), "wg2k128s2pp": (2, 128, 2, 168, "pp"),
            "wg2k64s3pp": (2, 64, 3, 168, "pp"), "wg2k64s4pp": (2, 64, 4, 168, "pp"),
            "wg2k128s3ppq": (2, 128, 3, 168, "ppq")}


def make_prefill_attention_wgmma(D, WGS, BK, STAGES, HANDOVER, BF16=False):
    QREG = HANDOVER.endswith("q")
    HANDOVER = HANDOVER[:-1] if QREG else HANDOVER
    MBAR = HANDOVER in ("mb", "p", "pp")
    PRODUCER = HANDOVER in ("p", "pp")
    PIPE = HANDOVER == "pp"
    # PRODUCER (with MBAR): one more warpgroup, after the WGS that compute, does all the copying with
    # few registers, and gives the rest to them (setmaxnreg; the kernel is launched capped at 168).
    # PIPE (with PRODUCER): the computing warpgroups pipelined as PIPELINED below, which the registers
    # that the copier gives up make room for at 64- and 128-key tiles.
    ROWS = 64 * WGS
    Q_THREADS = 128 * WGS  # the threads that compute (and load q)
    THREADS = Q_THREADS + (128 if PRODUCER else 0)
    COPY_THREADS = 128 if PRODUCER else THREADS
    COPY_WARP0 = 4 * WGS if PRODUCER else 0  # the first copying warp
    COPY_WARPS = COPY_THREADS // 32
    WARPS = THREADS // 32
    KS = D // 16  # k-steps of q·Kᵀ
    NB = BK // 8  # 8-key column blocks of S
    KK = BK // 16  # k-steps of P·V
    DB = D // 8  # 8-dim column blocks of O
    DG = D // 8  # 16-byte chunks of a key row
    PANELS = D // 64
    Q_PANEL = ROWS * PANEL_ROW
    KV_PANEL = BK * PANEL_ROW
    V_AT = PANELS * KV_PANEL  # V's panels after K's in a stage
    STAGE = 2 * PANELS * KV_PANEL
    CHUNKS = BK * DG // COPY_THREADS  # 16-byte copies per thread per tile, of K and of V each
    WARP_ROWS = BK // COPY_WARPS
    STEP_ROWS = 32 // DG
    Q_CHUNKS = ROWS * DG // Q_THREADS
    O_REGS = DB * 4  # accumulators a thread: O (64 x D) and S (64 x BK) over 128 threads
    S_REGS = NB * 4
    P_REGS = KK * 4
    # MBAR: stages handed over by mbarriers instead of a block barrier a tile, so the warpgroups need
    # not be at the same tile: one's softmax can run under the other's MMAs.
    BARRIERS = 2 * STAGES
    PIPELINED = STAGES >= 3 and not MBAR  # scores of a tile overlap the P·V of the one before (needs a stage more)
    AHEAD = STAGES - 2 if PIPELINED else STAGES - 1  # tiles copied ahead of the one computed
    assert CHUNKS * STEP_ROWS == WARP_ROWS and WARP_ROWS & (WARP_ROWS - 1) == 0
    assert 2 <= STAGES <= len(cp_async_wait) + 1 and NB <= 16
    mma_s = make_mma_ss(BK)
    mma_s_rs = make_mma_rs(BK, trans_b=False, flagged=True)
    QA_REGS = 4 * KS if QREG else 1  # q's A fragments a thread (QREG)
    mma_o = make_mma_rs(D, trans_b=True)
    wait_s = make_wait(BK // 2)
    wait_o = make_wait(D // 2)
    wait_landed = cp_async_wait[AHEAD - 1]  # copies of tile it (committed AHEAD groups ago) have landed
    wait_s_behind_one = make_wait(BK // 2, behind=1)
    wait_all = cp_async_wait[0]
    copier_registers = make_setmaxnreg("dec", 40)
    # PRODUCER: the computing and the copying warpgroups each meet among themselves (named barriers 1
    # and 2), never all together after the start, so the copier can run into the next item.
    compute_threads_barrier = asm_statement(f"bar.sync 1, {Q_THREADS};")
    copier_barrier = asm_statement(f"bar.sync 2, {COPY_THREADS};")
    mma_registers = make_setmaxnreg("inc", 232)  # 128 x 40 + 256 x 232 = 384 x 168
    if PRODUCER:
        assert WGS == 2 and THREADS == 384

    def prefill_attention(qkv, kc, page_stride, page_tables, max_pages, row_table, positions, out, rows,
                          n_heads, n_kv, page_shift, scale_log2):
        sh = cuda.shared.array(0, uint32, alignment=16)
        sh_table = cuda.shared.array(ROWS, int32)
        sh_pos = cuda.shared.array(ROWS, int32)
        sh_last = cuda.shared.array(WARPS, int32)  # each warp's last position in a run of rows
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        wg = warp >> 2
        base = (shared_address(sh) + uint32(1023)) & uint32(0xFFFFFC00)
        kv_base = base + uint32(PANELS * Q_PANEL)
        bars = uint32(0)
        if MBAR:
            sh_bars = cuda.shared.array(BARRIERS, uint64)  # full[stage], then empty[stage]
            bars = shared_address(sh_bars)
            if tid == 0:
                for st in range(STAGES):
                    mbarrier_init(bars + uint32(8 * st), uint32(COPY_THREADS))  # every copier's copies landed
                    mbarrier_init(bars + uint32(8 * (STAGES + st)), uint32(4 * WGS))  # every MMA warp done
            fence_proxy_async()
        cuda.syncthreads()  # the barriers
        # The block's items (head, row tile), numbered as a grid of (heads, row tiles) with the last row
        # tile first would run them: launched as that grid a block has one; launched with fewer blocks
        # ("persistent" in the meta) each takes one of every round of gridDim items, and with a copying
        # warpgroup the copies of the next item's first tiles run under this item's last MMAs and output.
        row_tiles = (rows + ROWS - 1) // ROWS
        items = row_tiles * n_heads
        block = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
        blocks = cuda.gridDim.x * cuda.gridDim.y
        rounds = (items + blocks - 1) // blocks
        if PRODUCER:
            if wg == WGS:
                copier_registers()
                sh_ptable = cuda.shared.array(ROWS, int32)  # the copier's own copy of the item's rows
                sh_ppos = cuda.shared.array(ROWS, int32)
                done = int32(0)
                for turn in range(rounds):
                    item = item_of(turn, block, blocks)
                    if item >= items:
                        break
                    r0 = (row_tiles - 1 - item // n_heads) * ROWS
                    kvh = (item % n_heads) // (n_heads // n_kv)
                    load_rows(sh_ptable, sh_ppos, row_table, positions, r0, rows, tid - Q_THREADS)
                    copier_barrier()
                    done = produce(sh_ptable, sh_ppos, bars, kv_base, page_tables, max_pages, kc, kvh, page_stride,
                                   n_kv, page_shift, warp, lane, done)
                    copier_barrier()  # its rows are read: the next item may overwrite them
                return
            mma_registers()
        done = int32(0)
        for turn in range(rounds):
            item = item_of(turn, block, blocks)
            if item >= items:
                break
            done = compute_item(qkv, kc, page_stride, page_tables, max_pages, row_table, positions, out, rows,
                                n_heads, n_kv, page_shift, scale_log2, sh_table, sh_pos, sh_last, base, kv_base, bars,
                                row_tiles - 1 - item // n_heads, item % n_heads, done, tid, warp, lane, wg)

    @cuda.jit(device=True, inline=True)
    def item_of(turn, block, blocks):
        """The item ``block`` takes in round ``turn``: rounds go up and down the blocks in turn. Items
        come longest first (causal rows), so a block that took a longer item of one round takes a
        shorter one of the next. Taking every gridDim-th item instead left the first blocks more work
        than the last: 444 TFLOP/s against 463 at 8192 rows (455 as a block an item)."""
        return turn * blocks + (block if turn % 2 == 0 else blocks - 1 - block)

    @cuda.jit(device=True, inline=True)
    def load_rows(sh_table, sh_pos, row_table, positions, r0, rows, i):
        """Thread ``i`` (< ROWS does it) puts row r0 + i's table and position (-1 past the rows) into shared memory."""
        if 0 <= i < ROWS:
            r = r0 + i
            sh_table[i] = row_table[r] if r < rows else -1
            sh_pos[i] = positions[r] if r < rows else -1

    @cuda.jit(device=True, inline=True)
    def compute_barrier():
        """The computing threads meet (the whole block where there is no copying warpgroup)."""
        if PRODUCER:
            compute_threads_barrier()
        else:
            cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def compute_item(qkv, kc, page_stride, page_tables, max_pages, row_table, positions, out, rows, n_heads, n_kv,
                     page_shift, scale_log2, sh_table, sh_pos, sh_last, base, kv_base, bars, tile, head, done, tid,
                     warp, lane, wg):
        """The computing threads' (and, without a copying warpgroup, the copying) work of one item:
        its rows' attention over the K/V tiles of their runs, written to ``out``. Returns ``done``
        (the block's tiles so far) advanced past the item's."""
        g = lane >> 2
        t = lane & 3
        kvh = head // (n_heads // n_kv)
        r0 = tile * ROWS
        load_rows(sh_table, sh_pos, row_table, positions, r0, rows, tid)
        # q: 16-byte chunk c of row r (8 dims, rounded to bf16) at its swizzled place in panel c // 8.
        width = (n_heads + 2 * n_kv) * D
        for j in range(Q_CHUNKS):
            i = tid + j * Q_THREADS
            r = i // DG
            c = i % DG
            w0 = uint32(0)
            w1 = uint32(0)
            w2 = uint32(0)
            w3 = uint32(0)
            if r0 + r < rows:
                at = int64(r0 + r) * width + head * D + c * 8
                w0 = q_pair(qkv, at)
                w1 = q_pair(qkv, at + 2)
                w2 = q_pair(qkv, at + 4)
                w3 = q_pair(qkv, at + 6)
            sts_u32x4(base + q_place(r, c), w0, w1, w2, w3)
        q_low = descriptor_low(base + uint32(wg * 64 * PANEL_ROW), 16)
        if MBAR:
            fence_proxy_async()  # q, for the MMAs (no barrier a tile publishes it in this form)
        compute_barrier()  # sh_table / sh_pos (q is published by the fence and barrier of the first tile)
        qa = cuda.local.array(QA_REGS, uint32)
        if QREG:
            load_q_fragments(qa, base, wg * 64 + (warp & 3) * 16 + (lane >> 2), lane & 3)

        o = cuda.local.array(O_REGS, float32)
        for i in range(O_REGS):
            o[i] = float32(0.0)
        s = cuda.local.array(S_REGS, float32)
        p = cuda.local.array(P_REGS, uint32)  # P in bf16 pairs: the A fragments of P·V
        zero = float32(0.0)
        m_a = NEG_INF
        m_b = NEG_INF
        l_a = zero
        l_b = zero
        la = wg * 64 + (warp & 3) * 16 + g  # this lane's rows in the block: la and la + 8
        ra = r0 + la
        rb = ra + 8

        # Copies (without a copying warpgroup): rows j0 + c * STEP_ROWS of the tile, chunk lane % DG.
        copy_dst = cuda.local.array(CHUNKS, uint32)
        k_base = uint64(0)
        v_bytes = uint32(0)
        stride_bytes = uint32(0)
        in_page = int32(0)
        one_page = False
        warp_key = int32(0)
        lane_row = int32(0)
        if not PRODUCER:
            k_base, v_bytes, stride_bytes, in_page, one_page, warp_key, lane_row = copy_plan(
                copy_dst, kc, kvh, page_stride, n_kv, page_shift, warp, lane)
        seg = 0
        while seg < ROWS and sh_table[seg] >= 0:
            table, end, last, pos_a, pos_b, warp_last, warp_first = row_run(sh_table, sh_pos, seg, ROWS, la)
            if lane == 0:
                sh_last[warp] = warp_last
            compute_barrier()
            # The warpgroup's last position: its MMAs are issued by all four warps or none.
            wg_last = max(max(sh_last[4 * wg], sh_last[4 * wg + 1]), max(sh_last[4 * wg + 2], sh_last[4 * wg + 3]))
            kv_len = int32(last + 1)
            table_base = int32(table * max_pages)
            n_tiles = int32((kv_len + BK - 1) // BK)
            # The warpgroup's tiles: the causal mask leaves none for it past its last row's position.
            wg_tiles = int32(min(n_tiles, (wg_last + BK) // BK)) if wg_last >= 0 else int32(0)
            if MBAR:
                page = int32(0)
                if not PRODUCER:  # the computing warps copy too: the first tiles start flying
                    for st in range(AHEAD):
                        if st < n_tiles:
                            page = page_of(page_tables, table_base, int32(st * BK + warp_key), kv_len, page_shift)
                            refill(bars, done + st, page, kv_base, copy_dst, one_page, page_tables, table_base,
                                   k_base, stride_bytes, v_bytes, int32(st * BK + warp_key), lane_row, kv_len,
                                   page_shift, in_page)
                    page = page_of(page_tables, table_base, int32(AHEAD * BK + warp_key), kv_len, page_shift)
                if PIPE:
                    m_a, m_b, l_a, l_b = consume_pipelined(bars, done, n_tiles, kv_base, q_low, qa, s, p, o, warp_first,
                                                           pos_a, pos_b, t, m_a, m_b, l_a, l_b, scale_log2, lane)
                for it in range(0 if PIPE else n_tiles):
                    ahead = int32(it + AHEAD)
                    if not PRODUCER and ahead < n_tiles:
                        refill(bars, done + ahead, page, kv_base, copy_dst, one_page, page_tables, table_base,
                               k_base, stride_bytes, v_bytes, int32(ahead * BK + warp_key), lane_row, kv_len,
                               page_shift, in_page)
                        page = page_of(page_tables, table_base, int32(ahead * BK + BK + warp_key), kv_len,
                                       page_shift)
                    # Every warp waits for the tile, even one whose rows it cannot see: its own copies
                    # into the stage must land before it lets the stage be refilled.
                    wait_full(bars, done + it)
                    if it < wg_tiles:  # uniform over the warpgroup
                        m_a, m_b, l_a, l_b = compute_tile(s, p, o, q_low, qa, stage_at(kv_base, done + it),
                                                          int32(it * BK), warp_first, pos_a, pos_b, t, m_a, m_b,
                                                          l_a, l_b, scale_log2)
                    release(bars, done + it, lane)
                done += n_tiles
                compute_barrier()  # sh_last is read: the next run may overwrite it
                seg = end
                continue
            for st in range(AHEAD):  # the first tiles start flying
                if st < n_tiles:
                    page = page_of(page_tables, table_base, int32(st * BK + warp_key), kv_len, page_shift)
                    fetch_tile(kv_base + uint32(st * STAGE), copy_dst, page, one_page, page_tables, table_base,
                               k_base, stride_bytes, v_bytes, int32(st * BK + warp_key), lane_row, kv_len,
                               page_shift, in_page)
                cp_async_commit()
            page = page_of(page_tables, table_base, int32(AHEAD * BK + warp_key), kv_len, page_shift)
            if not PIPELINED:
                for it in range(n_tiles):
                    page = next_tile(it, n_tiles, page, kv_base, copy_dst, one_page, page_tables, table_base, k_base,
                                     stride_bytes, v_bytes, warp_key, lane_row, kv_len, page_shift, in_page)
                    if it < wg_tiles:  # uniform over the warpgroup
                        # (its P·V waited for before the next barrier lets copies overwrite this stage)
                        m_a, m_b, l_a, l_b = compute_tile(s, p, o, q_low, qa, stage_at(kv_base, it), int32(it * BK),
                                                          warp_first, pos_a, pos_b, t, m_a, m_b, l_a, l_b,
                                                          scale_log2)
            else:
                # Tile it's scores fly with tile it - 1's P·V, and its softmax runs under that P·V; O
                # is rescaled for tile it once the P·V of it - 1 is done. No MMA sits in a branch (ptxas
                # would serialize them all), so every warpgroup computes every tile of the run, even
                # the last one that the causal mask hides from its rows entirely.
                page = next_tile(0, n_tiles, page, kv_base, copy_dst, one_page, page_tables, table_base, k_base,
                                 stride_bytes, v_bytes, warp_key, lane_row, kv_len, page_shift, in_page)
                m_a, m_b, l_a, l_b = score_tile(s, p, o, q_low, qa, kv_base, int32(0), warp_first, pos_a, pos_b, t,
                                                m_a, m_b, l_a, l_b, scale_log2)
                for it in range(1, n_tiles):
                    page = next_tile(it, n_tiles, page, kv_base, copy_dst, one_page, page_tables, table_base, k_base,
                                     stride_bytes, v_bytes, warp_key, lane_row, kv_len, page_shift, in_page)
                    issue_scores(s, q_low, qa, stage_at(kv_base, it))
                    issue_values(o, p, stage_at(kv_base, it - 1))
                    wait_s_behind_one(s)  # the scores; the P·V (the newest group) may still run
                    m_a, m_b, l_a, l_b, alpha_a, alpha_b, rescaled = softmax_scores(
                        s, int32(it * BK), warp_first, pos_a, pos_b, t, m_a, m_b, l_a, l_b, scale_log2)
                    wait_o(o)  # P·V of tile it - 1: O and the P registers are free again
                    if rescaled:
                        rescale(o, alpha_a, alpha_b)
                    pack_p(s, p)
                issue_values(o, p, stage_at(kv_base, n_tiles - 1))
                wait_o(o)
            wait_all()
            cuda.syncthreads()
            seg = end

        inv_a, inv_b = inverse_row_sums(l_a, l_b)
        out_w = n_heads * D
        if BF16:
            store_rows_bf16(out, o, base, inv_a, inv_b, la, r0, rows, head * D, out_w, lane, t)
        else:
            for db in range(DB):
                col = head * D + db * 8 + 2 * t
                if ra < rows:
                    store_pair(out, int64(ra) * out_w + col, o[db * 4] * inv_a, o[db * 4 + 1] * inv_a)
                if rb < rows:
                    store_pair(out, int64(rb) * out_w + col, o[db * 4 + 2] * inv_b, o[db * 4 + 3] * inv_b)
        compute_barrier()  # every warp's output has left q's place: the next item's q may take it
        return done

    @cuda.jit(device=True, inline=True)
    def copy_plan(copy_dst, kc, kvh, page_stride, n_kv, page_shift, warp, lane):
        """A copying thread's part of every tile: its rows' places in a stage (``copy_dst``), its chunk
        of K of kv head ``kvh`` in page 0 and the byte distances from there (32-bit: the kernel is short
        of registers). Returns (k_base, v_bytes, stride_bytes, in_page, one_page, warp_key, lane_row)."""
        j0 = int32((warp - COPY_WARP0) * WARP_ROWS + lane // DG)
        chunk = lane % DG
        for c in range(CHUNKS):
            row = j0 + c * STEP_ROWS
            copy_dst[c] = uint32((chunk >> 3) * KV_PANEL + row * PANEL_ROW + 16 * ((chunk & 7) ^ (row & 7)))
        k_base = global_address(kc) + uint64(((kvh << page_shift) * D + chunk * 8) * 2)
        v_bytes = uint32((n_kv << page_shift) * D * 2)
        stride_bytes = uint32(page_stride * 2)
        in_page = int32((1 << page_shift) - 1)
        one_page = (1 << page_shift) >= WARP_ROWS
        warp_key = int32((warp - COPY_WARP0) * WARP_ROWS)
        lane_row = int32(lane // DG)
        return k_base, v_bytes, stride_bytes, in_page, one_page, warp_key, lane_row

    @cuda.jit(device=True, inline=True)
    def q_place(row, c):
        """Byte offset of row ``row``'s 16-byte chunk ``c`` (dims 8c..8c+7) in the q panels: panel c // 8,
        its row, the chunk swizzled by the row's low bits (wgmma.py's 128-byte swizzle)."""
        return uint32((c >> 3) * Q_PANEL + row * PANEL_ROW + 16 * ((c & 7) ^ (row & 7)))

    @cuda.jit(device=True, inline=True)
    def store_rows_bf16(out, o, base, inv_a, inv_b, la, r0, rows, col0, out_w, lane, t):
        """BF16: the warp's 16 rows of O, normalised and rounded, out through shared memory: each lane
        puts its pairs where q's rows were (the same swizzled place a 16-byte chunk of q had, so only
        this warp's rows are touched and a store of 8 rows hits 8 different bank groups), then the
        warp writes whole 16-byte chunks, a row's 256 bytes by 16 lanes, instead of 4-byte pairs that
        left half of every 32-byte sector they touched unwritten."""
        for db in range(DB):
            for h in range(2):  # rows la and la + 8
                row = la + 8 * h
                inv = inv_a if h == 0 else inv_b
                sts_u32(base + q_place(row, db) + uint32(4 * t),
                        pack_bf16x2(o[db * 4 + 2 * h] * inv, o[db * 4 + 2 * h + 1] * inv))
        cuda.syncwarp()
        first = la - (lane >> 2)  # the warp's first row in the block
        for k in range(DG // 2):  # 16 rows x DG chunks over 32 lanes
            i = lane + 32 * k
            row = first + i // DG
            c = i % DG
            w0, w1, w2, w3 = lds_u32x4(base + q_place(row, c))
            if r0 + row < rows:
                store_u32x4(out, (int64(r0 + row) * out_w + col0 + c * 8) >> 1, w0, w1, w2, w3)

    @cuda.jit(device=True, inline=True)
    def stage_at(kv_base, tile):
        """Shared address of the stage holding ``tile`` (unsigned 32-bit: a mask or a multiply, not a
        signed 64-bit remainder)."""
        return kv_base + (uint32(tile) % uint32(STAGES)) * uint32(STAGE)

    @cuda.jit(device=True, inline=True)
    def next_tile(it, n_tiles, page, kv_base, copy_dst, one_page, page_tables, table_base, k_base, stride_bytes,
                  v_bytes, warp_key, lane_row, kv_len, page_shift, in_page):
        """Wait for tile ``it`` and publish it; start the copies of tile it + AHEAD into the stage that
        every warpgroup is done with. Returns the page id of the tile after that (loaded a tile ahead)."""
        wait_landed()
        fence_proxy_async()  # this thread's copies (and q) visible to the MMAs' reads
        cuda.syncthreads()
        ahead = int32(it + AHEAD)
        if ahead < n_tiles:
            fetch_tile(stage_at(kv_base, ahead), copy_dst, page, one_page, page_tables, table_base,
                       k_base, stride_bytes, v_bytes, int32(ahead * BK + warp_key), lane_row, kv_len,
                       page_shift, in_page)
            page = page_of(page_tables, table_base, int32(ahead * BK + BK + warp_key), kv_len, page_shift)
        cp_async_commit()
        return page

    @cuda.jit(device=True, inline=True)
    def refill(bars, tile, page, kv_base, copy_dst, one_page, page_tables, table_base, k_base, stride_bytes,
               v_bytes, key0, lane_row, kv_len, page_shift, in_page):
        """MBAR: copy ``tile`` (counted over the block's runs) into its stage once every warp is done
        with the tile before it there, and arrive on the stage's full barrier when the copies land."""
        stage = uint32(tile) % uint32(STAGES)
        wait_phase(bars + 8 * (uint32(STAGES) + stage), (uint32(tile) // uint32(STAGES) + uint32(1)) & uint32(1))
        fetch_tile(kv_base + stage * uint32(STAGE), copy_dst, page, one_page, page_tables, table_base, k_base,
                   stride_bytes, v_bytes, key0, lane_row, kv_len, page_shift, in_page)
        cp_async_arrive(bars + 8 * stage)

    @cuda.jit(device=True, inline=True)
    def produce(sh_table, sh_pos, bars, kv_base, page_tables, max_pages, kc, kvh, page_stride, n_kv, page_shift,
                warp, lane, done):
        """PRODUCER: the copying warpgroup's work for one item (its rows in ``sh_table`` / ``sh_pos``,
        its own copy). It meets the computing warpgroups only through the stages' barriers, running as
        many tiles ahead as there are stages, into the next item's tiles too. Returns ``done``
        advanced past the item's tiles."""
        copy_dst = cuda.local.array(CHUNKS, uint32)
        k_base, v_bytes, stride_bytes, in_page, one_page, warp_key, lane_row = copy_plan(
            copy_dst, kc, kvh, page_stride, n_kv, page_shift, warp, lane)
        seg = 0
        while seg < ROWS and sh_table[seg] >= 0:
            table, end, last, _, _, _, _ = row_run(sh_table, sh_pos, seg, ROWS, 0)
            kv_len = int32(last + 1)
            table_base = int32(table * max_pages)
            n_tiles = int32((kv_len + BK - 1) // BK)
            page = page_of(page_tables, table_base, warp_key, kv_len, page_shift)
            for it in range(n_tiles):
                refill(bars, done + it, page, kv_base, copy_dst, one_page, page_tables, table_base, k_base,
                       stride_bytes, v_bytes, int32(it * BK + warp_key), lane_row, kv_len, page_shift, in_page)
                page = page_of(page_tables, table_base, int32(it * BK + BK + warp_key), kv_len, page_shift)
            done += n_tiles
            seg = end
        return done

    @cuda.jit(device=True, inline=True)
    def score_tile(s, p, o, q_low, qa, kt, k0, warp_first, pos_a, pos_b, t, m_a, m_b, l_a, l_b, scale_log2):
        """A tile's (stage at shared ``kt``, first key ``k0``) S = q·Kᵀ and its online softmax: O
        rescaled, P packed for the P·V. Returns the new (m_a, m_b, l_a, l_b)."""
        issue_scores(s, q_low, qa, kt)
        wait_s(s)
        m_a, m_b, l_a, l_b, alpha_a, alpha_b, rescaled = softmax_scores(
            s, k0, warp_first, pos_a, pos_b, t, m_a, m_b, l_a, l_b, scale_log2)
        if rescaled:
            rescale(o, alpha_a, alpha_b)
        pack_p(s, p)
        return m_a, m_b, l_a, l_b

    @cuda.jit(device=True, inline=True)
    def compute_tile(s, p, o, q_low, qa, kt, k0, warp_first, pos_a, pos_b, t, m_a, m_b, l_a, l_b, scale_log2):
        """One tile unpipelined: ``score_tile``, then O += P·V and its wait."""
        m_a, m_b, l_a, l_b = score_tile(s, p, o, q_low, qa, kt, k0, warp_first, pos_a, pos_b, t, m_a, m_b, l_a, l_b,
                                        scale_log2)
        issue_values(o, p, kt)
        wait_o(o)
        return m_a, m_b, l_a, l_b

    @cuda.jit(device=True, inline=True)
    def consume_pipelined(bars, done, n_tiles, kv_base, q_low, qa, s, p, o, warp_first, pos_a, pos_b, t, m_a, m_b,
                          l_a, l_b, scale_log2, lane):
        """PIPE: a computing warpgroup's tiles of one run, the scores of tile it issued with the P·V of
        it - 1 and softmaxed while that runs; a stage is handed back once its P·V is done. As in
        PIPELINED, no MMA sits in a branch: every warpgroup computes every tile, masked or not."""
        kt = stage_at(kv_base, done)
        wait_full(bars, done)
        m_a, m_b, l_a, l_b = score_tile(s, p, o, q_low, qa, kt, int32(0), warp_first, pos_a, pos_b, t, m_a, m_b,
                                        l_a, l_b, scale_log2)
        for it in range(1, n_tiles):
            previous = kt
            kt = stage_at(kv_base, done + it)
            wait_full(bars, done + it)
            issue_scores(s, q_low, qa, kt)
            issue_values(o, p, previous)
            wait_s_behind_one(s)  # the scores; the P·V (the newest group) may still run
            m_a, m_b, l_a, l_b, alpha_a, alpha_b, rescaled = softmax_scores(
                s, int32(it * BK), warp_first, pos_a, pos_b, t, m_a, m_b, l_a, l_b, scale_log2)
            wait_o(o)  # P·V of tile it - 1: O, the P registers and its stage are free again
            release(bars, done + it - 1, lane)
            if rescaled:
                rescale(o, alpha_a, alpha_b)
            pack_p(s, p)
        issue_values(o, p, kt)
        wait_o(o)
        release(bars, done + n_tiles - 1, lane)
        return m_a, m_b, l_a, l_b

    @cuda.jit(device=True, inline=True)
    def wait_full(bars, tile):
        """MBAR: wait until ``tile``'s copies have landed in its stage, and make them visible to the MMAs."""
        wait_phase(bars + 8 * (uint32(tile) % uint32(STAGES)), (uint32(tile) // uint32(STAGES)) & uint32(1))
        fence_proxy_async()

    @cuda.jit(device=True, inline=True)
    def release(bars, tile, lane):
        """MBAR: this warp is done with ``tile``'s stage (its MMAs' reads ordered before the refill)."""
        fence_proxy_async()
        cuda.syncwarp()
        if lane == 0:
            mbarrier_arrive(bars + 8 * (uint32(STAGES) + uint32(tile) % uint32(STAGES)))

    @cuda.jit(device=True, inline=True)
    def wait_phase(address, parity):
        while mbarrier_try_wait(address, parity) == 0:
            pass

    @cuda.jit(device=True, inline=True)
    def issue_scores(s, q_low, qa, kt):
        """Start S = q·Kᵀ of the tile whose stage is at shared ``kt`` (one commit group); q from
        shared memory (``q_low``) or, with QREG, from the fragments ``qa``."""
        k_low = descriptor_low(kt, 16)
        wgmma_fence()
        for ks in range(KS):
            k_step = uint32(((ks >> 2) * KV_PANEL + (ks & 3) * 32) >> 4)
            if QREG:
                mma_s_rs(s, qa[4 * ks], qa[4 * ks + 1], qa[4 * ks + 2], qa[4 * ks + 3],
                         descriptor_of(k_low + k_step, 1024), int32(ks))
            else:
                q_step = uint32(((ks >> 2) * Q_PANEL + (ks & 3) * 32) >> 4)
                mma_s(s, descriptor_of(q_low + q_step, 1024), descriptor_of(k_low + k_step, 1024), int32(ks))
        wgmma_commit()

    @cuda.jit(device=True, inline=True)
    def load_q_fragments(qa, base, row, t):
        """QREG: the A fragments of q·Kᵀ's k-steps for this lane (rows ``row`` and ``row + 8`` of the
        block, dims 16 ks + 2t, + 1 and + 8, + 9), read from q's swizzled panels at ``base``."""
        for ks in range(KS):
            for half in range(2):
                col = ks * 16 + half * 8 + 2 * t
                for r8 in range(2):
                    r = row + 8 * r8
                    qa[4 * ks + 2 * half + r8] = lds_u32(base + q_place(r, col >> 3) + uint32(2 * (col & 7)))

    @cuda.jit(device=True, inline=True)
    def issue_values(o, p, kt):
        """Start O += P·V of the tile whose stage is at shared ``kt`` (one commit group)."""
        v_low = descriptor_low(kt + uint32(V_AT), KV_PANEL)
        wgmma_fence()
        for kk in range(KK):
            mma_o(o, p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3],
                  descriptor_of(v_low + uint32((kk * 16 * PANEL_ROW) >> 4), 1024))
        wgmma_commit()

    @cuda.jit(device=True, inline=True)
    def softmax_scores(s, k0, warp_first, pos_a, pos_b, t, m_a, m_b, l_a, l_b, scale_log2):
        """The online softmax of a tile's scores, in place: causal mask, the rows' new maxima, ``s``
        exponentiated, the sums updated. Returns (m_a, m_b, l_a, l_b, alpha_a, alpha_b, rescaled):
        O must be scaled by alpha when ``rescaled`` (warp-uniform) before this tile's P·V."""
        zero = float32(0.0)
        if k0 + BK - 1 > warp_first:
            last_a = int32(pos_a - k0 - 2 * t)  # column nb*8 + c of this lane is key k0 + nb*8 + 2t + c
            last_b = int32(pos_b - k0 - 2 * t)
            for nb in range(NB):
                for c in range(2):
                    if nb * 8 + c > last_a:
                        s[nb * 4 + c] = NEG_INF
                    if nb * 8 + c > last_b:
                        s[nb * 4 + 2 + c] = NEG_INF
        # Row maxima and sums in two interleaved chains a row (registers, not latency, are what this
        # kernel is short of: a tree over all NB blocks would hold 2 NB partials live beside O and S).
        mx_a, mx_b = row_max(s)
        for off in (1, 2):
            mx_a = max(mx_a, cuda.shfl_xor_sync(0xFFFFFFFF, mx_a, off))
            mx_b = max(mx_b, cuda.shfl_xor_sync(0xFFFFFFFF, mx_b, off))
        new_a = max(m_a, mx_a * scale_log2)
        new_b = max(m_b, mx_b * scale_log2)
        # A row with no visible key yet keeps max -inf: subtract 0 so its p are exp2(-inf) = 0.
        ref_a = new_a if new_a > NEG_INF else zero
        ref_b = new_b if new_b > NEG_INF else zero
        rescaled = cuda.any_sync(0xFFFFFFFF, new_a > m_a or new_b > m_b)
        alpha_a = float32(1.0)
        alpha_b = float32(1.0)
        if rescaled:
            alpha_a = exp2_approx(m_a - ref_a)
            alpha_b = exp2_approx(m_b - ref_b)
            l_a *= alpha_a
            l_b *= alpha_b
        for nb in range(NB):
            for c in range(4):
                s[nb * 4 + c] = exp2_approx(s[nb * 4 + c] * scale_log2 - (ref_a if c < 2 else ref_b))
        sum_a, sum_b = row_sum(s)
        return new_a, new_b, l_a + sum_a, l_b + sum_b, alpha_a, alpha_b, rescaled

    @cuda.jit(device=True, inline=True)
    def rescale(o, alpha_a, alpha_b):
        for db in range(DB):
            o[db * 4] *= alpha_a
            o[db * 4 + 1] *= alpha_a
            o[db * 4 + 2] *= alpha_b
            o[db * 4 + 3] *= alpha_b

    @cuda.jit(device=True, inline=True)
    def pack_p(s, p):
        """Probabilities of keys 16kk..16kk+15 (accumulator blocks 2kk, 2kk+1) -> A fragment kk of P·V."""
        for i in range(P_REGS):
            p[i] = pack_bf16x2(s[2 * i], s[2 * i + 1])

    @cuda.jit(device=True, inline=True)
    def row_max(s):
        """The lane's maxima of its two rows' scores (not yet across the quad)."""
        a0 = max(s[0], s[1])
        b0 = max(s[2], s[3])
        a1 = max(s[4], s[5])
        b1 = max(s[6], s[7])
        for nb in range(2, NB, 2):
            a0 = max(a0, max(s[nb * 4], s[nb * 4 + 1]))
            b0 = max(b0, max(s[nb * 4 + 2], s[nb * 4 + 3]))
            a1 = max(a1, max(s[nb * 4 + 4], s[nb * 4 + 5]))
            b1 = max(b1, max(s[nb * 4 + 6], s[nb * 4 + 7]))
        return max(a0, a1), max(b0, b1)

    @cuda.jit(device=True, inline=True)
    def row_sum(s):
        """The lane's sums of its two rows' probabilities (not yet across the quad)."""
        a0 = s[0] + s[1]
        b0 = s[2] + s[3]
        a1 = s[4] + s[5]
        b1 = s[6] + s[7]
        for nb in range(2, NB, 2):
            a0 += s[nb * 4] + s[nb * 4 + 1]
            b0 += s[nb * 4 + 2] + s[nb * 4 + 3]
            a1 += s[nb * 4 + 4] + s[nb * 4 + 5]
            b1 += s[nb * 4 + 6] + s[nb * 4 + 7]
        return a0 + a1, b0 + b1

    store_pair = store_pair_bf16 if BF16 else store_pair_f32
    q_pair = q_pair_bf16 if BF16 else q_pair_f32

    @cuda.jit(device=True, inline=True)
    def fetch_tile(stage, copy_dst, page, one_page, page_tables, table_base, k_base, stride_bytes, v_bytes,
                   key0, lane_row, kv_len, page_shift, in_page):
        left = int32(kv_len - key0 - lane_row)
        if one_page:
            first = int32(min(key0, kv_len - 1) & in_page & ~(WARP_ROWS - 1))
            k_src = k_base + uint64(page) * uint64(stride_bytes) + uint64((first + lane_row) * 2 * D)
            for c in range(CHUNKS):
                src = k_src + uint64(c * STEP_ROWS * 2 * D)
                copy_row(stage, copy_dst, c, src, src + uint64(v_bytes), left)
        else:
            for c in range(CHUNKS):
                kq = int32(min(int32(key0 + lane_row + c * STEP_ROWS), kv_len - 1))
                row_page = page_tables[table_base + (kq >> page_shift)]
                k_src = k_base + uint64(row_page) * uint64(stride_bytes) + uint64((kq & in_page) * 2 * D)
                copy_row(stage, copy_dst, c, k_src, k_src + uint64(v_bytes), left)

    @cuda.jit(device=True, inline=True)
    def copy_row(stage, copy_dst, c, k_src, v_src, left):
        size = uint32(16) if int32(c * STEP_ROWS) < left else uint32(0)
        dst = stage + copy_dst[c]
        cp_async16(dst, k_src, size)
        cp_async16(dst + uint32(V_AT), v_src, size)

    return prefill_attention


def shared_bytes(D, wgs, keys, stages):
    """Dynamic shared memory of a shape: q, the K/V stages, 1024 bytes of alignment slack."""
    return 2 * D * (64 * wgs + 2 * stages * keys) + 1024


def _entry(D, wgs, keys, stages, max_registers, handover, out="f32"):
    meta = {"rows": 64 * wgs, "threads": 128 * (wgs + (handover.rstrip("q") in ("p", "pp"))), "keys": keys, "stages": stages,
            "shared": shared_bytes(D, wgs, keys, stages), "out": out, "arch": "sm_90a"}
    if max_registers:
        meta["max_registers"] = max_registers
    if handover.rstrip("q") in ("p", "pp"):  # a copying warpgroup: blocks take item after item, one an SM
        meta["persistent"] = 1
    return (make_prefill_attention_wgmma(D, wgs, keys, stages, handover, out == "bf16"),
            SIGNATURE_BF16 if out == "bf16" else SIGNATURE, meta)


KERNELS = {}
for _d, _shape in SHAPES.items():
    KERNELS[f"prefill_attention_d{_d}_wgmma"] = _entry(_d, *_shape)
    KERNELS[f"prefill_attention_d{_d}_wgmma_bf16"] = _entry(_d, *_shape, out="bf16")
if os.environ.get("NINFER_PREFILL_VARIANTS") == "1":
    for _suffix, _shape in VARIANTS.items():
        KERNELS[f"prefill_attention_d128_{_suffix}"] = _entry(128, *_shape)
