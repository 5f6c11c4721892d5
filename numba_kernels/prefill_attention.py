"""Causal prefill attention on the tensor cores (flash style) over the paged bf16 KV pool.

``prefill_attention_d{D}`` (D = head_dim 64, 128 or 256), one launch per layer for all the rows of
a prefill step, written straight into ``out`` (no split partials, no combine):

    grid (n_heads, ceil(rows / meta["rows"])), block meta["threads"] (one warp per 16 rows)

    qkv          f32  [rows, (n_heads + 2 n_kv) * D]: q of head h at columns h*D (after RoPE; only
                      the q part is read)
    kc           bf16 pool of this layer, as uint32 words: element (page, kv_head, slot, d) of K at
                      page * page_stride + (kv_head * page_size + slot) * D + d, V n_kv*page_size*D
                      elements after K (the ``[page][layer][K|V][kv_head][slot][D]`` pool, layer
                      offset applied by the launcher); 16-byte aligned
    page_stride  i64  elements from one page to the next
    page_tables  i32  [*, max_pages]; row r reads the table ``row_table[r]``
    row_table    i32  [rows]
    positions    i32  [rows]: row r attends to keys 0..positions[r] of its sequence (absolute
                      positions, so a chunk over a reused prefix reads the prefix from the pages)
    out          f32  [rows, n_heads * D]; ``prefill_attention_d{D}_bf16``: bf16 (uint32 pairs), rounded
                      to nearest even as ``to_bf16`` rounds, for the o projection's cuBLASLt GEMM
    rows, n_heads, n_kv, page_shift (page_size = 2**page_shift), scale_log2 = softmax scale * log2(e)

Every K/V the rows attend to must already be in the pool (``rope_kv`` appends the chunk's own K/V
first). ``n_heads / n_kv`` is the GQA group (any integer); q head h reads kv head ``h // group``.
Rows of several sequences may share a launch: a block walks each run of equal ``row_table`` among
its rows separately, so the usual layout (each sequence's rows consecutive) costs one pass per
block, and a block straddling two sequences two.

Each block owns ``meta["rows"]`` query rows of one q head (``SHAPES``); warp w the rows
16w..16w+15 (the M of mma.m16n8k16). q is rounded to bf16 once into A fragments held in registers.
Tiles of ``meta["keys"]`` keys are copied page by page into dynamic shared memory
(``meta["shared"]`` bytes) with ``cp.async`` (no registers, no wait) into ``meta["stages"]``
stages, so the copies of the next tiles fly while one is computed (one barrier a tile; the page ids
of a tile are loaded a tile ahead, so no global load latency sits before its copies). K and V stay
row-major with 16-byte chunks XOR-swizzled by row, so K fragment reads (16 bytes,
q's dims permuted to match) and V's ``ldmatrix.trans`` (which hands out P·V's B fragments
transposed) hit distinct banks. S = q·Kᵀ accumulates in fp32; the online softmax (running max and
sum per row in fp32; the max is taken on raw scores and the scale folded into exp2's argument,
one FFMA and one ``ex2.approx`` a score) stays in fp32; P is rounded to bf16 straight
from the S accumulators into A fragments (their layouts coincide) and P·V accumulates in fp32
registers. Blocks are issued last tile first, every head of a tile before the next tile: under the
causal mask the last rows cost the most, so the costliest blocks go first and the launch ends on
the cheapest (longest-first scheduling; heads fastest also keeps a tile's keys hot in L2 for the
heads that share them).
Shared memory is addressed through 32-bit shared-window addresses (per-lane offsets computed once,
the rest immediates) and the loop's integers are 32-bit: the tile loop issues about half the
instructions it did with Numba's default 64-bit generic addressing.
Measured on the H200 (Qwen3-8B shape, 8192 tokens, tools/bench_prefill_attention.py): see
docs/benchmarks.md, "CUDA backend".
"""

from __future__ import annotations

import math
import os

from llvmlite import ir
from numba import cuda, float32, int32, int64, uint32, uint64
from numba.cuda.extending import intrinsic

from numba_kernels.common import (F32P, I32P, U32P, cp_async16, cp_async_commit, cp_async_wait,
                                  global_address, inline_asm, lds_u32x4, shared_address, shared_load_x4, warp_max)
from numba_kernels.mma import mma_bf16_16816, pack_bf16x2

NEG_INF = float32(-math.inf)  # masked scores; exp2(-inf) = 0

# head_dim -> (query rows per block, keys per tile, tiles in flight). A block is one warp per 16
# rows (the M of mma.m16n8k16), all sharing each K/V tile; the tiles live in dynamic shared memory,
# ``stages`` of them, so the copies of the next stages - 1 tiles fly while one is computed. On the
# H200 (tools/bench_prefill_attention.py, 8192 tokens, in the row-tiles-fastest grid of the time):
# D = 128 226 TFLOP/s with 64 keys a tile (185 with 32, 183 with 3 stages, 200 with 128-row blocks,
# 205-216 with 32 rows a warp and q in shared memory; held to 168 registers, three blocks an SM, 233
# in one chunk but 178 in chunks of 1024); D = 256 198 with 32 keys (178 with 16). Heads fastest
# then gave 239 (D = 128) and 212 (D = 256).
SHAPES = {64: (64, 64, 2), 128: (64, 64, 2), 256: (128, 32, 2)}
# Shapes to time against SHAPES with tools/bench_prefill_attention.py --variants (name suffix
# r{rows}k{keys}s{stages}[m{max registers}]); built only with NINFER_PREFILL_VARIANTS=1. These are the
# runners-up of the row-tiles-fastest grid, not yet re-timed with heads fastest.
VARIANTS = {128: ((64, 32, 2, 0), (128, 64, 2, 0), (64, 64, 3, 0)), 256: ((64, 32, 2, 0), (128, 32, 3, 0))}


# ldmatrix.x4.trans at shared byte ``address``: four 8x8 bf16 matrices whose rows (16 bytes each, lane l
# giving row l % 8 of matrix l // 8) come back transposed, one uint32 of each per lane: the B fragments
# of a row-major [key][dim] V for P·V.
ldmatrix_x4_trans = shared_load_x4("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];")


@intrinsic
def exp2_approx(typingctx, x):
    """2**x in one MUFU.EX2 (ex2.approx.ftz: ~2 ulp, denormal results flushed to 0; exp2(-inf) = 0)."""
    sig = float32(float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        return inline_asm(ir.FunctionType(f32, [f32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f", args, builder,
                          side_effect=False)

    return sig, codegen


@cuda.jit(device=True, inline=True)
def q_pair_f32(qkv, index):
    """q elements ``index`` and ``index + 1`` (even) of fp32 ``qkv`` as the bf16 pair an MMA reads."""
    return pack_bf16x2(qkv[index], qkv[index + 1])


@cuda.jit(device=True, inline=True)
def q_pair_bf16(qkv, index):
    """The same from bf16 ``qkv`` (uint32 words: a pair a word)."""
    return qkv[index >> 1]


@cuda.jit(device=True, inline=True)
def row_run(sh_table, sh_pos, seg, rows, la):
    """The run of a block's rows that starts at ``seg`` (rows of one sequence: one ``row_table``
    entry): (its table, its end, its largest position, this lane's two rows' positions ``la`` and
    ``la + 8`` (-1 outside the run), the largest and smallest of those over the warp).

    The warp looks at 32 rows a step (lane l at row b + l) and a ballot finds the first row that is
    not the run's: four steps for 128 rows, where a row at a time was a chain of 128 dependent
    shared loads that every block waited for before its first tile."""
    table = sh_table[seg]
    lane = int32(cuda.laneid)
    end = int32(rows)
    last = int32(-1)
    b = int32(seg)
    while b < end:  # warp-uniform
        r = b + lane
        inside = r < rows and sh_table[r] == table
        outside = cuda.ballot_sync(0xFFFFFFFF, not inside)
        if outside != 0:
            end = b + int32(cuda.clz(cuda.brev(outside)))  # the lowest lane outside the run
        if r < end:
            last = max(last, sh_pos[r])
        b += 32
    last = warp_max(last)
    pos_a = sh_pos[la] if seg <= la < end else int32(-1)
    pos_b = sh_pos[la + 8] if seg <= la + 8 < end else int32(-1)
    warp_last = max(pos_a, pos_b)
    warp_first = min(pos_a, pos_b)
    for off in (1, 2, 4, 8, 16):
        warp_last = max(warp_last, cuda.shfl_xor_sync(0xFFFFFFFF, warp_last, off))
        warp_first = min(warp_first, cuda.shfl_xor_sync(0xFFFFFFFF, warp_first, off))
    return table, end, last, pos_a, pos_b, warp_last, warp_first


@cuda.jit(device=True, inline=True)
def page_of(page_tables, table_base, key, kv_len, page_shift):
    """The page holding ``key`` (clamped to the last key: a valid page whatever the tile)."""
    return page_tables[table_base + (int32(min(key, kv_len - 1)) >> page_shift)]


@cuda.jit(device=True, inline=True)
def inverse_row_sums(l_a, l_b):
    """1 / the softmax sums of a lane's two rows, each summed over its quad first (0 for a row that
    saw no key)."""
    for off in (1, 2):
        l_a += cuda.shfl_xor_sync(0xFFFFFFFF, l_a, off)
        l_b += cuda.shfl_xor_sync(0xFFFFFFFF, l_b, off)
    zero = float32(0.0)
    return (float32(1.0) / l_a if l_a > zero else zero), (float32(1.0) / l_b if l_b > zero else zero)


@cuda.jit(device=True, inline=True)
def store_pair_f32(out, index, lo, hi):
    out[index] = lo
    out[index + 1] = hi


@cuda.jit(device=True, inline=True)
def store_pair_bf16(out, index, lo, hi):
    """Elements ``index`` (even) and ``index + 1`` rounded to bf16 (nearest even, as ``to_bf16``) in one word."""
    out[index >> 1] = pack_bf16x2(lo, hi)


def make_prefill_attention(D, ROWS, BK, STAGES, BF16=False):
    THREADS = 2 * ROWS  # one warp per 16 rows
    KS = D // 16  # k-steps of q·Kᵀ
    NB = BK // 8  # 8-key column blocks of S
    KK = BK // 16  # k-steps of P·V
    DB = D // 8  # 8-dim column blocks of the output
    DG = D // 8  # 16-byte chunks (8 bf16) per key row
    ROW_BYTES = 2 * D  # one staged K or V row
    TILE_BYTES = BK * ROW_BYTES  # one staged K (or V) tile; a stage is K then V
    CHUNKS = BK * DG // THREADS  # 16-byte copies per thread per tile, of K and of V each
    # Warp w copies the tile's key rows w*WARP_ROWS .. + WARP_ROWS - 1 (one page when pages hold at
    # least WARP_ROWS keys), STEP_ROWS rows a copy instruction (lane: row lane // DG, chunk lane % DG,
    # so each instruction reads whole 16-byte-chunked rows: full sectors).
    WARP_ROWS = BK // (THREADS // 32)
    STEP_ROWS = 32 // DG
    SWIZZLES = min(8 // STEP_ROWS, CHUNKS)  # distinct (row & 7) among a lane's copies
    assert CHUNKS * THREADS == BK * DG and 8 <= DG <= 32 and CHUNKS * STEP_ROWS == WARP_ROWS
    assert WARP_ROWS & (WARP_ROWS - 1) == 0 and (WARP_ROWS % 8 == 0 or CHUNKS <= SWIZZLES)
    assert 2 <= STAGES <= len(cp_async_wait) + 1 and NB <= 16
    wait_oldest = cp_async_wait[STAGES - 2]  # the oldest tile in flight has landed
    wait_all = cp_async_wait[0]

    def prefill_attention(qkv, kc, page_stride, page_tables, max_pages, row_table, positions, out, rows,
                          n_heads, n_kv, page_shift, scale_log2):
        sh_kv = cuda.shared.array(0, uint32, alignment=16)  # STAGES x (K, V) tiles: dynamic, meta["shared"]
        sh_table = cuda.shared.array(ROWS, int32)
        sh_pos = cuda.shared.array(ROWS, int32)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        tile = cuda.gridDim.y - 1 - cuda.blockIdx.y
        head = cuda.blockIdx.x
        kvh = head // (n_heads // n_kv)
        r0 = tile * ROWS
        if tid < ROWS:
            r = r0 + tid
            sh_table[tid] = row_table[r] if r < rows else -1
            sh_pos[tid] = positions[r] if r < rows else -1
        cuda.syncthreads()

        width = (n_heads + 2 * n_kv) * D
        la = warp * 16 + g  # this lane's two rows in the tile: la and la + 8
        ra = r0 + la
        rb = ra + 8
        qf = cuda.local.array((KS, 4), uint32)
        zero = float32(0.0)
        # The dot product over d does not care in which order its terms come, so the K step of an
        # MMA need not be 16 consecutive dims: k-steps 2j and 2j+1 of lane t take the dims
        # 32j + 8t .. 32j + 8t + 7 (words 16j + 4t .. + 3), in q here and in K's fragments below,
        # which makes every K fragment read one 16-byte shared load.
        for ks in range(KS):
            col = head * D + (ks >> 1) * 32 + 8 * t + 4 * (ks & 1)
            qa = int64(ra) * width + col
            qb = int64(rb) * width + col
            if ra < rows:
                qf[ks, 0] = q_pair(qkv, qa)
                qf[ks, 2] = q_pair(qkv, qa + 2)
            else:
                qf[ks, 0] = uint32(0)
                qf[ks, 2] = uint32(0)
            if rb < rows:
                qf[ks, 1] = q_pair(qkv, qb)
                qf[ks, 3] = q_pair(qkv, qb + 2)
            else:
                qf[ks, 1] = uint32(0)
                qf[ks, 3] = uint32(0)

        o = cuda.local.array((DB, 4), float32)
        for db in range(DB):
            for c in range(4):
                o[db, c] = zero
        s = cuda.local.array((NB, 4), float32)
        red_a = cuda.local.array(NB, float32)  # per-tile reductions of a row, by halving
        red_b = cuda.local.array(NB, float32)
        m_a = NEG_INF  # running maxima, in log2 units (scores x scale_log2)
        m_b = NEG_INF
        l_a = zero
        l_b = zero

        # Shared byte offsets, fixed per lane. Chunk c of staged key row j sits at chunk c ^ (j & 7)
        # (16-byte chunks XOR-swizzled by row: the 8 rows of one ldmatrix or of one quarter-warp
        # fragment read hit 8 different banks). K fragment reads: row nb*8 + g, chunk
        # (4j + t) ^ g = 8 (j >> 1) + ((4 (j & 1) + t) ^ g), so two lane offsets and immediates.
        sbase = shared_address(sh_kv)
        k_lane0 = uint32(g * ROW_BYTES + 16 * (t ^ g))
        k_lane1 = uint32(g * ROW_BYTES + 16 * ((4 + t) ^ g))
        # V through ldmatrix: lane l gives row l & 7 of matrix l >> 3, i.e. key +8 for odd matrices and
        # chunk +1 for the upper two; chunk 2dp + vc ^ (key & 7) = 8 (dp >> 2) + ((2 (dp & 3) + vc) ^ (l & 7)).
        v_key = ((lane >> 3) & 1) * 8 + (lane & 7)
        v_chunk = lane >> 4
        v_lane = cuda.local.array(4, uint32)
        for q4 in range(4):
            v_lane[q4] = uint32(v_key * ROW_BYTES + 16 * ((2 * q4 + v_chunk) ^ (lane & 7)))
        # Copies: rows j0 + c * STEP_ROWS of the tile, chunk lane % DG; the swizzled destination of
        # copy c repeats every SWIZZLES copies, 8 rows further.
        j0 = int32(warp * WARP_ROWS + lane // DG)
        chunk = lane % DG
        copy_dst = cuda.local.array(SWIZZLES, uint32)
        for c in range(SWIZZLES):
            row = j0 + c * STEP_ROWS
            copy_dst[c] = uint32(row * ROW_BYTES + 16 * (chunk ^ (row & 7)))
        kc_base = global_address(kc)
        k_bytes = uint64(((kvh << page_shift) * D + chunk * 8) * 2)  # K of this kv head and chunk in a page
        v_bytes = uint64((n_kv << page_shift) * D * 2)  # V after K
        stride_bytes = uint64(page_stride * 2)
        in_page = int32((1 << page_shift) - 1)
        one_page = (1 << page_shift) >= WARP_ROWS  # a warp's rows of a tile share one page
        warp_key = int32(warp * WARP_ROWS)
        lane_row = int32(lane // DG)

        seg = 0
        while seg < ROWS and sh_table[seg] >= 0:
            # One run of rows of the same sequence: keys 0..(largest position in the run).
            table, end, last, pos_a, pos_b, warp_last, warp_first = row_run(sh_table, sh_pos, seg, ROWS, la)
            kv_len = int32(last + 1)
            table_base = int64(table) * max_pages
            n_tiles = int32((kv_len + BK - 1) // BK)
            for st in range(STAGES - 1):  # the first STAGES - 1 tiles start flying
                if st < n_tiles:
                    page = page_of(page_tables, table_base, int32(st * BK + warp_key), kv_len, page_shift)
                    fetch_tile(sbase + uint32(st * 2 * TILE_BYTES), copy_dst, page, one_page, page_tables, table_base,
                               kc_base, stride_bytes, k_bytes, v_bytes, int32(st * BK + warp_key), lane_row, kv_len,
                               page_shift, in_page)
                cp_async_commit()  # empty groups too: every iteration then waits on the same count
            page = page_of(page_tables, table_base, int32((STAGES - 1) * BK + warp_key), kv_len, page_shift)
            it = int32(0)
            while it < n_tiles:
                k0 = int32(it * BK)
                wait_oldest()
                # Tile it is in shared memory for every warp, and every warp is done with tile it - 1,
                # whose stage the copies of tile it + STAGES - 1 now take over.
                cuda.syncthreads()
                ahead = int32(it + STAGES - 1)
                if ahead < n_tiles:
                    fetch_tile(sbase + uint32((ahead % STAGES) * 2 * TILE_BYTES), copy_dst, page, one_page,
                               page_tables, table_base, kc_base, stride_bytes, k_bytes, v_bytes,
                               int32(ahead * BK + warp_key), lane_row, kv_len, page_shift, in_page)
                    # The next tile's page id loads while this one is computed.
                    page = page_of(page_tables, table_base, int32(ahead * BK + BK + warp_key), kv_len, page_shift)
                cp_async_commit()
                if k0 <= warp_last:  # else every row of this warp is before the tile (warp-uniform)
                    kt = sbase + uint32((it % STAGES) * 2 * TILE_BYTES)
                    ka0 = kt + k_lane0
                    ka1 = kt + k_lane1
                    for nb in range(NB):
                        for c in range(4):
                            s[nb, c] = zero
                    for j in range(KS // 2):
                        for nb in range(NB):
                            k_addr = (ka0 if j % 2 == 0 else ka1) + uint32(128 * (j >> 1) + nb * 8 * ROW_BYTES)
                            k0w, k1w, k2w, k3w = lds_u32x4(k_addr)
                            ks = 2 * j
                            s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3] = mma_bf16_16816(
                                qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3], k0w, k1w,
                                s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3])
                            s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3] = mma_bf16_16816(
                                qf[ks + 1, 0], qf[ks + 1, 1], qf[ks + 1, 2], qf[ks + 1, 3], k2w, k3w,
                                s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3])

                    # Causal mask (only where the tile reaches past a row's position) and the tile's
                    # max per row in raw scores; the 4 lanes of a row (same g) hold its 8*NB scores.
                    if k0 + BK - 1 > warp_first:
                        last_a = int32(pos_a - k0 - 2 * t)  # column nb*8 + c of this lane is key k0 + nb*8 + 2t + c
                        last_b = int32(pos_b - k0 - 2 * t)
                        for nb in range(NB):
                            for c in range(2):
                                if nb * 8 + c > last_a:
                                    s[nb, c] = NEG_INF
                                if nb * 8 + c > last_b:
                                    s[nb, 2 + c] = NEG_INF
                    # Maxima and sums over a tile by halving (depth log2 NB, not a chain of NB).
                    for nb in range(NB):
                        red_a[nb] = max(s[nb, 0], s[nb, 1])
                        red_b[nb] = max(s[nb, 2], s[nb, 3])
                    halve_max(red_a)
                    halve_max(red_b)
                    mx_a = red_a[0]
                    mx_b = red_b[0]
                    for off in (1, 2):
                        mx_a = max(mx_a, cuda.shfl_xor_sync(0xFFFFFFFF, mx_a, off))
                        mx_b = max(mx_b, cuda.shfl_xor_sync(0xFFFFFFFF, mx_b, off))
                    new_a = max(m_a, mx_a * scale_log2)
                    new_b = max(m_b, mx_b * scale_log2)
                    # A row with no visible key yet keeps max -inf: subtract 0 so its p are exp2(-inf) = 0.
                    ref_a = new_a if new_a > NEG_INF else zero
                    ref_b = new_b if new_b > NEG_INF else zero
                    # Rescale only when some row of the warp found a larger max (alpha is exactly 1
                    # otherwise): along a long row the max settles and the DB*4 multiplies go away.
                    if cuda.any_sync(0xFFFFFFFF, new_a > m_a or new_b > m_b):
                        alpha_a = exp2_approx(m_a - ref_a)
                        alpha_b = exp2_approx(m_b - ref_b)
                        l_a *= alpha_a
                        l_b *= alpha_b
                        for db in range(DB):
                            o[db, 0] *= alpha_a
                            o[db, 1] *= alpha_a
                            o[db, 2] *= alpha_b
                            o[db, 3] *= alpha_b
                    m_a = new_a
                    m_b = new_b
                    for nb in range(NB):
                        for c in range(4):
                            s[nb, c] = exp2_approx(s[nb, c] * scale_log2 - (ref_a if c < 2 else ref_b))
                        red_a[nb] = s[nb, 0] + s[nb, 1]
                        red_b[nb] = s[nb, 2] + s[nb, 3]
                    halve_sum(red_a)
                    halve_sum(red_b)
                    l_a += red_a[0]
                    l_b += red_b[0]

                    # P·V: the S accumulators of key blocks 2kk and 2kk+1 are P's A fragment for
                    # k-step kk; V's B fragments come transposed out of ldmatrix, two 8-dim blocks a call.
                    vt = kt + uint32(TILE_BYTES)
                    for kk in range(KK):
                        p0 = pack_bf16x2(s[2 * kk, 0], s[2 * kk, 1])
                        p1 = pack_bf16x2(s[2 * kk, 2], s[2 * kk, 3])
                        p2 = pack_bf16x2(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                        p3 = pack_bf16x2(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
                        for dp in range(DB // 2):
                            v_addr = vt + v_lane[dp & 3] + uint32(128 * (dp >> 2) + kk * 16 * ROW_BYTES)
                            b0, b1, b2, b3 = ldmatrix_x4_trans(v_addr)
                            o[2 * dp, 0], o[2 * dp, 1], o[2 * dp, 2], o[2 * dp, 3] = mma_bf16_16816(
                                p0, p1, p2, p3, b0, b1, o[2 * dp, 0], o[2 * dp, 1], o[2 * dp, 2], o[2 * dp, 3])
                            o[2 * dp + 1, 0], o[2 * dp + 1, 1], o[2 * dp + 1, 2], o[2 * dp + 1, 3] = mma_bf16_16816(
                                p0, p1, p2, p3, b2, b3,
                                o[2 * dp + 1, 0], o[2 * dp + 1, 1], o[2 * dp + 1, 2], o[2 * dp + 1, 3])
                it += 1
            wait_all()
            cuda.syncthreads()  # the next run's first copies go into stages warps may still be reading
            seg = end

        inv_a, inv_b = inverse_row_sums(l_a, l_b)
        out_w = n_heads * D
        for db in range(DB):
            col = head * D + db * 8 + 2 * t
            if ra < rows:
                store_pair(out, int64(ra) * out_w + col, o[db, 0] * inv_a, o[db, 1] * inv_a)
            if rb < rows:
                store_pair(out, int64(rb) * out_w + col, o[db, 2] * inv_b, o[db, 3] * inv_b)

    @cuda.jit(device=True, inline=True)
    def halve_max(v):
        """v[0] = max(v[:NB]) in log2(NB) dependent steps (NB <= 16; constant bounds: unrolled)."""
        for i in range(NB // 2):
            v[i] = max(v[i], v[i + NB // 2])
        for i in range(NB // 4):
            v[i] = max(v[i], v[i + NB // 4])
        for i in range(NB // 8):
            v[i] = max(v[i], v[i + NB // 8])
        for i in range(NB // 16):
            v[i] = max(v[i], v[i + NB // 16])

    @cuda.jit(device=True, inline=True)
    def halve_sum(v):
        """v[0] = sum(v[:NB]) pairwise, as ``halve_max``."""
        for i in range(NB // 2):
            v[i] += v[i + NB // 2]
        for i in range(NB // 4):
            v[i] += v[i + NB // 4]
        for i in range(NB // 8):
            v[i] += v[i + NB // 8]
        for i in range(NB // 16):
            v[i] += v[i + NB // 16]

    store_pair = store_pair_bf16 if BF16 else store_pair_f32
    q_pair = q_pair_bf16 if BF16 else q_pair_f32

    @cuda.jit(device=True, inline=True)
    def fetch_tile(stage, copy_dst, page, one_page, page_tables, table_base, kc_base, stride_bytes, k_bytes, v_bytes,
                   key0, lane_row, kv_len, page_shift, in_page):
        """Start the copies (uncommitted) of this warp's K and V rows, keys ``key0`` .. + WARP_ROWS - 1,
        into the stage at shared ``stage``; keys past ``kv_len`` become zeros (no read past the used
        pages, no garbage that a zero weight would turn into NaN). ``one_page``: every row is in
        ``page``, at slots from the warp block's (aligned) first, so one address and immediates; else
        (pages smaller than WARP_ROWS keys) each row looks its page up."""
        left = int32(kv_len - key0 - lane_row)  # copy c reads a key iff c * STEP_ROWS < left
        if one_page:
            first = int32(min(key0, kv_len - 1) & in_page & ~(WARP_ROWS - 1))
            k_src = kc_base + uint64(page) * stride_bytes + uint64((first + lane_row) * ROW_BYTES) + k_bytes
            v_src = k_src + v_bytes
            for c in range(CHUNKS):
                step = uint64(c * STEP_ROWS * ROW_BYTES)
                copy_row(stage, copy_dst, c, k_src + step, v_src + step, left)
        else:
            for c in range(CHUNKS):
                kq = int32(min(int32(key0 + lane_row + c * STEP_ROWS), kv_len - 1))
                row_page = page_tables[table_base + (kq >> page_shift)]
                k_src = kc_base + uint64(row_page) * stride_bytes + uint64((kq & in_page) * ROW_BYTES) + k_bytes
                copy_row(stage, copy_dst, c, k_src, k_src + v_bytes, left)

    @cuda.jit(device=True, inline=True)
    def copy_row(stage, copy_dst, c, k_src, v_src, left):
        """Copy c of this lane: 16 bytes of K and of V (zeros for keys past the end)."""
        size = uint32(16) if int32(c * STEP_ROWS) < left else uint32(0)
        dst = stage + copy_dst[c % SWIZZLES] + uint32((c // SWIZZLES) * 8 * ROW_BYTES)
        cp_async16(dst, k_src, size)
        cp_async16(dst + uint32(TILE_BYTES), v_src, size)

    return prefill_attention


SIGNATURE = (F32P, U32P, int64, I32P, int32, I32P, I32P, F32P, int32, int32, int32, int32, float32)
# The cuBLASLt prefill's (suffix _bf16): qkv as its GEMM wrote it and the output as its next GEMM
# reads it, both bf16 pairs.
SIGNATURE_BF16 = (U32P,) + SIGNATURE[1:7] + (U32P,) + SIGNATURE[8:]


def _entry(D, rows, keys, stages, max_registers=0, out="f32"):
    meta = {"rows": rows, "threads": 2 * rows, "keys": keys, "stages": stages, "shared": stages * 2 * keys * D * 2,
            "out": out}
    if max_registers:
        meta["max_registers"] = max_registers
    return (make_prefill_attention(D, rows, keys, stages, out == "bf16"), SIGNATURE_BF16 if out == "bf16" else SIGNATURE,
            meta)


KERNELS = {f"prefill_attention_d{d}{suffix}": _entry(d, *shape, out=out) for d, shape in SHAPES.items()
           for suffix, out in (("", "f32"), ("_bf16", "bf16"))}
if os.environ.get("NINFER_PREFILL_VARIANTS") == "1":
    KERNELS.update({f"prefill_attention_d{d}_r{r}k{k}s{st}" + (f"m{m}" if m else ""): _entry(d, r, k, st, m)
                    for d, shapes in VARIANTS.items() for r, k, st, m in shapes})
