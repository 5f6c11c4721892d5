"""Causal prefill attention on the tensor cores (flash style) over the paged bf16 KV pool.

``prefill_attention_d{D}`` (D = head_dim 64, 128 or 256), one launch per layer for all the rows of
a prefill step, written straight into ``out`` (no split partials, no combine):

    grid (ceil(rows / 64), n_heads), block 128 (4 warps)

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
    out          f32  [rows, n_heads * D]
    rows, n_heads, n_kv, page_shift (page_size = 2**page_shift), scale_log2 = softmax scale * log2(e)

Every K/V the rows attend to must already be in the pool (``rope_kv`` appends the chunk's own K/V
first). ``n_heads / n_kv`` is the GQA group (any integer); q head h reads kv head ``h // group``.
Rows of several sequences may share a launch: a block walks each run of equal ``row_table`` among
its 64 rows separately, so the usual layout (each sequence's rows consecutive) costs one pass per
block, and a block straddling two sequences two.

Each block owns 64 query rows of one q head; warp w the rows 16w..16w+15 (the M of mma.m16n8k16).
q is rounded to bf16 once into A fragments held in registers. Per tile of ``BK`` keys the block
stages K row-major and V transposed (``[d][key]``, so a B fragment of P·V is two consecutive keys
in one 32-bit word) in shared memory, rows padded by 4 words so the fragment reads of the 8 lanes
groups hit distinct banks. S = q·Kᵀ accumulates in fp32; the online softmax (running max and sum
per row, exp2 with the log2(e) folded into the scale) stays in fp32; P is rounded to bf16 straight
from the S accumulators into A fragments (their layouts coincide) and P·V accumulates in fp32
registers. Blocks are issued last tile first: under the causal mask the last rows cost the most.
"""

from __future__ import annotations

from llvmlite import ir
from numba import cuda, float32, int32, int64, types, uint32
from numba.cuda import libdevice
from numba.cuda.extending import intrinsic

from numba_kernels.common import F32P, I32P, NEG_BIG, U32P, load_u32x4
from numba_kernels.mma import mma_bf16_16816, pack_bf16x2

ROWS = 128  # query rows per block: 8 warps of 16 (the M of mma.m16n8k16) share each K/V tile
# head_dim -> keys per shared tile: D = 256 keeps 32 keys so its fragments and accumulators
# (q: 64 registers, output: 128) still fit the register file.
KEY_TILES = {64: 64, 128: 64, 256: 32}


@intrinsic
def shared_u32x4(typingctx, array, index):
    """Words ``index .. index + 3`` (``index`` a multiple of 4) of a shared uint32 array in one
    16-byte access (ld.shared.v4): a quarter of the load instructions of four scalar reads."""
    sig = types.UniTuple(uint32, 4)(array, index)

    def codegen(context, builder, signature, args):
        base = context.make_array(signature.args[0])(context, builder, args[0]).data
        idx = context.cast(builder, args[1], signature.args[1], types.intp)
        vec = builder.load(builder.bitcast(builder.gep(base, [idx]), ir.VectorType(ir.IntType(32), 4).as_pointer()),
                           align=16)
        parts = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i)) for i in range(4)]
        return context.make_tuple(builder, signature.return_type, parts)

    return sig, codegen


@intrinsic
def store_shared_u32x4(typingctx, array, index, w0, w1, w2, w3):
    """The store twin of ``shared_u32x4`` (st.shared.v4)."""
    sig = types.void(array, index, uint32, uint32, uint32, uint32)

    def codegen(context, builder, signature, args):
        base = context.make_array(signature.args[0])(context, builder, args[0]).data
        idx = context.cast(builder, args[1], signature.args[1], types.intp)
        vec = ir.Constant(ir.VectorType(ir.IntType(32), 4), None)
        for i in range(4):
            word = context.cast(builder, args[2 + i], signature.args[2 + i], uint32)
            vec = builder.insert_element(vec, word, ir.Constant(ir.IntType(32), i))
        builder.store(vec, builder.bitcast(builder.gep(base, [idx]), ir.VectorType(ir.IntType(32), 4).as_pointer()),
                      align=16)
        return context.get_dummy_value()

    return sig, codegen


@cuda.jit(device=True, inline=True)
def v_column(pair):
    """Column of key pair ``pair`` in a staged Vᵀ row: the two words a lane's B fragment reads
    for k-step kk (pairs 8kk + t and 8kk + 4 + t) and for kk + 1 sit in four consecutive words."""
    return 16 * (pair >> 4) + 4 * (pair & 3) + 2 * ((pair >> 3) & 1) + ((pair >> 2) & 1)


def make_prefill_attention(D, BK, prefetch, ROWS=ROWS):
    THREADS = 2 * ROWS  # one warp per 16 rows
    KS = D // 16  # k-steps of q·Kᵀ
    NB = BK // 8  # 8-key column blocks of S
    KK = BK // 16  # k-steps of P·V
    DB = D // 8  # 8-dim column blocks of the output
    DG = D // 8  # 16-byte groups (8 bf16) per key row
    KW = D // 2  # words per staged K row
    VW = BK // 2  # words per staged Vᵀ row
    # A 16-byte fragment read is served 8 lanes at a time: rows g and g+1, chunks 4j + t. Rows of
    # 32 words or more start on the same bank, so odd rows swap their 16-byte chunks c <-> c ^ 4.
    V_SWIZZLE = 4 if VW >= 32 else 0
    PAIRS = BK // 2
    K_WORDS = BK * KW
    V_WORDS = D * VW
    K_ITEMS = BK * DG // THREADS  # 16-byte K loads per thread per tile
    V_ITEMS = PAIRS * DG // THREADS  # (key pair, 8 dims) V items per thread per tile
    assert K_ITEMS * THREADS == BK * DG and V_ITEMS * THREADS == PAIRS * DG

    def prefill_attention(qkv, kc, page_stride, page_tables, max_pages, row_table, positions, out, rows,
                          n_heads, n_kv, page_shift, scale_log2):
        sh_k = cuda.shared.array(K_WORDS, uint32)
        sh_v = cuda.shared.array(V_WORDS, uint32)
        sh_table = cuda.shared.array(ROWS, int32)
        sh_pos = cuda.shared.array(ROWS, int32)
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        tile = cuda.gridDim.x - 1 - cuda.blockIdx.x
        head = cuda.blockIdx.y
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
                qf[ks, 0] = pack_bf16x2(qkv[qa], qkv[qa + 1])
                qf[ks, 2] = pack_bf16x2(qkv[qa + 2], qkv[qa + 3])
            else:
                qf[ks, 0] = uint32(0)
                qf[ks, 2] = uint32(0)
            if rb < rows:
                qf[ks, 1] = pack_bf16x2(qkv[qb], qkv[qb + 1])
                qf[ks, 3] = pack_bf16x2(qkv[qb + 2], qkv[qb + 3])
            else:
                qf[ks, 1] = uint32(0)
                qf[ks, 3] = uint32(0)

        o = cuda.local.array((DB, 4), float32)
        for db in range(DB):
            for c in range(4):
                o[db, c] = zero
        s = cuda.local.array((NB, 4), float32)
        kreg = cuda.local.array((K_ITEMS, 4), uint32)  # the next tile, loaded while this one computes
        vreg = cuda.local.array((V_ITEMS, 8), uint32)
        m_a = NEG_BIG
        m_b = NEG_BIG
        l_a = zero
        l_b = zero
        k_off = int64(kvh) << page_shift
        k_off *= D
        v_off = k_off + (int64(n_kv) << page_shift) * D

        seg = 0
        while seg < ROWS and sh_table[seg] >= 0:
            # One run of rows of the same sequence: keys 0..(largest position in the run).
            table = sh_table[seg]
            end = seg
            last = int32(-1)
            while end < ROWS and sh_table[end] == table:
                last = max(last, sh_pos[end])
                end += 1
            pos_a = sh_pos[la] if seg <= la < end else int32(-1)
            pos_b = sh_pos[la + 8] if seg <= la + 8 < end else int32(-1)
            warp_last = max(pos_a, pos_b)
            warp_first = min(pos_a, pos_b)
            for off in (1, 2, 4, 8, 16):
                warp_last = max(warp_last, cuda.shfl_xor_sync(0xFFFFFFFF, warp_last, off))
                warp_first = min(warp_first, cuda.shfl_xor_sync(0xFFFFFFFF, warp_first, off))
            kv_len = last + 1
            table_base = table * max_pages
            if prefetch:
                fetch_tile(kc, page_stride, page_tables, table_base, 0, kv_len, page_shift, k_off, v_off, tid, kreg, vreg)
            for k0 in range(0, kv_len, BK):
                if not prefetch:
                    fetch_tile(kc, page_stride, page_tables, table_base, k0, kv_len, page_shift, k_off, v_off, tid,
                               kreg, vreg)
                cuda.syncthreads()  # every warp is done reading the previous tile
                stage_tile(sh_k, sh_v, tid, kreg, vreg)
                cuda.syncthreads()
                if prefetch and k0 + BK < kv_len:
                    fetch_tile(kc, page_stride, page_tables, table_base, k0 + BK, kv_len, page_shift, k_off, v_off,
                               tid, kreg, vreg)
                if k0 > warp_last:
                    continue  # every row of this warp is before the tile (warp-uniform)

                for nb in range(NB):
                    for c in range(4):
                        s[nb, c] = zero
                for j in range(KS // 2):
                    for nb in range(NB):
                        k0w, k1w, k2w, k3w = shared_u32x4(sh_k, (nb * 8 + g) * KW + 4 * ((4 * j + t) ^ ((g & 1) << 2)))
                        ks = 2 * j
                        s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3] = mma_bf16_16816(
                            qf[ks, 0], qf[ks, 1], qf[ks, 2], qf[ks, 3], k0w, k1w,
                            s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3])
                        s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3] = mma_bf16_16816(
                            qf[ks + 1, 0], qf[ks + 1, 1], qf[ks + 1, 2], qf[ks + 1, 3], k2w, k3w,
                            s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3])

                # Scale, causal mask (only where the tile reaches past a row's position) and
                # running max; the 4 lanes of a row (same g) hold its 8*NB scores.
                masked = k0 + BK - 1 > warp_first
                mx_a = m_a
                mx_b = m_b
                for nb in range(NB):
                    for c in range(2):
                        va = s[nb, c] * scale_log2
                        vb = s[nb, 2 + c] * scale_log2
                        if masked:
                            key = k0 + nb * 8 + 2 * t + c
                            if key > pos_a:
                                va = NEG_BIG
                            if key > pos_b:
                                vb = NEG_BIG
                        s[nb, c] = va
                        s[nb, 2 + c] = vb
                        mx_a = max(mx_a, va)
                        mx_b = max(mx_b, vb)
                for off in (1, 2):
                    mx_a = max(mx_a, cuda.shfl_xor_sync(0xFFFFFFFF, mx_a, off))
                    mx_b = max(mx_b, cuda.shfl_xor_sync(0xFFFFFFFF, mx_b, off))
                # A row with no visible key yet keeps max NEG_BIG: subtract 0 so its p are exp2(-big) = 0.
                ref_a = mx_a if mx_a > NEG_BIG else zero
                ref_b = mx_b if mx_b > NEG_BIG else zero
                alpha_a = libdevice.exp2f(m_a - ref_a)
                alpha_b = libdevice.exp2f(m_b - ref_b)
                m_a = mx_a
                m_b = mx_b
                l_a *= alpha_a
                l_b *= alpha_b
                for db in range(DB):
                    o[db, 0] *= alpha_a
                    o[db, 1] *= alpha_a
                    o[db, 2] *= alpha_b
                    o[db, 3] *= alpha_b
                for nb in range(NB):
                    for c in range(2):
                        pa = libdevice.exp2f(s[nb, c] - ref_a)
                        pb = libdevice.exp2f(s[nb, 2 + c] - ref_b)
                        s[nb, c] = pa
                        s[nb, 2 + c] = pb
                        l_a += pa
                        l_b += pb

                # P·V: the S accumulators of key blocks 2kk and 2kk+1 are P's A fragment for k-step kk.
                for j in range(KK // 2):
                    kk = 2 * j
                    p0 = pack_bf16x2(s[2 * kk, 0], s[2 * kk, 1])
                    p1 = pack_bf16x2(s[2 * kk, 2], s[2 * kk, 3])
                    p2 = pack_bf16x2(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                    p3 = pack_bf16x2(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
                    p4 = pack_bf16x2(s[2 * kk + 2, 0], s[2 * kk + 2, 1])
                    p5 = pack_bf16x2(s[2 * kk + 2, 2], s[2 * kk + 2, 3])
                    p6 = pack_bf16x2(s[2 * kk + 3, 0], s[2 * kk + 3, 1])
                    p7 = pack_bf16x2(s[2 * kk + 3, 2], s[2 * kk + 3, 3])
                    for db in range(DB):
                        v0w, v1w, v2w, v3w = shared_u32x4(sh_v, (db * 8 + g) * VW + 4 * ((4 * j + t) ^ ((g & 1) * V_SWIZZLE)))
                        o[db, 0], o[db, 1], o[db, 2], o[db, 3] = mma_bf16_16816(
                            p0, p1, p2, p3, v0w, v1w, o[db, 0], o[db, 1], o[db, 2], o[db, 3])
                        o[db, 0], o[db, 1], o[db, 2], o[db, 3] = mma_bf16_16816(
                            p4, p5, p6, p7, v2w, v3w, o[db, 0], o[db, 1], o[db, 2], o[db, 3])
            seg = end

        for off in (1, 2):
            l_a += cuda.shfl_xor_sync(0xFFFFFFFF, l_a, off)
            l_b += cuda.shfl_xor_sync(0xFFFFFFFF, l_b, off)
        inv_a = float32(1.0) / l_a if l_a > zero else zero
        inv_b = float32(1.0) / l_b if l_b > zero else zero
        out_w = n_heads * D
        for db in range(DB):
            col = head * D + db * 8 + 2 * t
            if ra < rows:
                oa = int64(ra) * out_w + col
                out[oa] = o[db, 0] * inv_a
                out[oa + 1] = o[db, 1] * inv_a
            if rb < rows:
                ob = int64(rb) * out_w + col
                out[ob] = o[db, 2] * inv_b
                out[ob + 1] = o[db, 3] * inv_b

    @cuda.jit(device=True, inline=True)
    def fetch_key(kc, page_stride, page_tables, table_base, key, kv_len, page_shift, head_off, grp):
        """Dims 8*grp .. 8*grp + 7 of one key's K or V as 4 words; zeros past ``kv_len`` (no read
        past the page table's used part, and no garbage times a zero weight = NaN)."""
        kq = min(key, kv_len - 1)  # branch-free, so the loads of a tile all issue back to back
        page = int64(page_tables[table_base + (kq >> page_shift)])
        elem = page * page_stride + head_off + int64(kq & ((1 << page_shift) - 1)) * D + grp * 8
        w0, w1, w2, w3 = load_u32x4(kc, elem >> 1)
        if key >= kv_len:
            w0 = w1 = w2 = w3 = uint32(0)
        return w0, w1, w2, w3

    @cuda.jit(device=True, inline=True)
    def fetch_tile(kc, page_stride, page_tables, table_base, k0, kv_len, page_shift, k_off, v_off, tid, kreg, vreg):
        """Issue every global load of the tile of keys k0 .. k0 + BK into registers."""
        for it in range(K_ITEMS):
            i = tid + it * THREADS
            j = i // DG
            kreg[it, 0], kreg[it, 1], kreg[it, 2], kreg[it, 3] = fetch_key(
                kc, page_stride, page_tables, table_base, k0 + j, kv_len, page_shift, k_off, i - j * DG)
        for it in range(V_ITEMS):
            i = tid + it * THREADS
            grp = i // PAIRS
            key = k0 + 2 * (i - grp * PAIRS)
            vreg[it, 0], vreg[it, 1], vreg[it, 2], vreg[it, 3] = fetch_key(
                kc, page_stride, page_tables, table_base, key, kv_len, page_shift, v_off, grp)
            vreg[it, 4], vreg[it, 5], vreg[it, 6], vreg[it, 7] = fetch_key(
                kc, page_stride, page_tables, table_base, key + 1, kv_len, page_shift, v_off, grp)

    @cuda.jit(device=True, inline=True)
    def stage_tile(sh_k, sh_v, tid, kreg, vreg):
        """Registers to shared memory: K row-major (16-byte chunks swizzled on odd rows), V transposed."""
        for it in range(K_ITEMS):
            i = tid + it * THREADS
            j = i // DG
            grp = i - j * DG
            store_shared_u32x4(sh_k, j * KW + 4 * (grp ^ ((j & 1) << 2)), kreg[it, 0], kreg[it, 1], kreg[it, 2],
                               kreg[it, 3])
        for it in range(V_ITEMS):
            i = tid + it * THREADS
            grp = i // PAIRS
            col = v_column(i - grp * PAIRS)
            # Row d of Vᵀ gets (key, key + 1) at dim d as one word; rows 8*grp + e, odd e swizzled.
            even = grp * 8 * VW + col
            odd = grp * 8 * VW + (col ^ (V_SWIZZLE * 4)) + VW
            for w in range(4):
                a = vreg[it, w]
                b = vreg[it, 4 + w]
                sh_v[even + 2 * w * VW] = (a & uint32(0xFFFF)) | (b << uint32(16))
                sh_v[odd + 2 * w * VW] = (a >> uint32(16)) | (b & uint32(0xFFFF0000))

    return prefill_attention


SIGNATURE = (F32P, U32P, int64, I32P, int32, I32P, I32P, F32P, int32, int32, int32, int32, float32)

KERNELS = {f"prefill_attention_d{d}": (make_prefill_attention(d, bk, False), SIGNATURE,
                                       {"rows": ROWS, "threads": 2 * ROWS, "keys": bk})
           for d, bk in KEY_TILES.items()}
# Experiment variants for tools/bench_prefill_attention.py (--variants): rows per block, keys per tile, prefetch.
for _rows, _bk, _pf in ((64, 64, False), (128, 32, False), (128, 32, True), (64, 32, False), (64, 32, True)):
    KERNELS[f"prefill_attention_d128_r{_rows}k{_bk}{'p' if _pf else ''}"] = (
        make_prefill_attention(128, _bk, _pf, _rows), SIGNATURE, {"rows": _rows, "threads": 2 * _rows, "keys": _bk})
