"""Causal prefill attention on the tensor cores (flash style) over the paged bf16 KV pool.

``prefill_attention_d{D}`` (D = head_dim 64, 128 or 256), one launch per layer for all the rows of
a prefill step, written straight into ``out`` (no split partials, no combine):

    grid (ceil(rows / meta["rows"]), n_heads), block meta["threads"] (one warp per 16 rows)

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
its rows separately, so the usual layout (each sequence's rows consecutive) costs one pass per
block, and a block straddling two sequences two.

Each block owns ``meta["rows"]`` query rows of one q head (``SHAPES``); warp w the rows
16w..16w+15 (the M of mma.m16n8k16). q is rounded to bf16 once into A fragments held in registers.
Tiles of ``meta["keys"]`` keys are copied page by page into shared memory with ``cp.async`` (no
registers, no wait) into two stages, so the copies of the next tile fly while this one is computed;
K and V stay row-major with 16-byte chunks XOR-swizzled by row, so K fragment reads (16 bytes,
q's dims permuted to match) and V's ``ldmatrix.trans`` (which hands out P·V's B fragments
transposed) hit distinct banks. S = q·Kᵀ accumulates in fp32; the online softmax (running max and
sum per row, exp2 with log2(e) folded into the scale) stays in fp32; P is rounded to bf16 straight
from the S accumulators into A fragments (their layouts coincide) and P·V accumulates in fp32
registers. Blocks are issued last tile first: under the causal mask the last rows cost the most.
Measured on the H200 (Qwen3-8B shape, 8192 tokens, tools/bench_prefill_attention.py): see
docs/benchmarks.md, "CUDA backend".
"""

from __future__ import annotations

from llvmlite import ir
from numba import cuda, float32, int32, int64, types, uint32
from numba.cuda import libdevice
from numba.cuda.extending import intrinsic

from numba_kernels.common import F32P, I32P, NEG_BIG, U32P
from numba_kernels.mma import mma_bf16_16816, pack_bf16x2

STAGES = 2  # K/V tiles in shared memory: one computed while the next one's copies fly
# head_dim -> (query rows per block, keys per tile). A block is one warp per 16 rows (the M of
# mma.m16n8k16), all sharing each K/V tile; 2 stages of K and V fit the 48 KiB of static shared
# memory. 64-row blocks run two to an SM (164 vs 130 TFLOP/s for 128-row blocks at D = 128 on the
# H200, tools/bench_prefill_attention.py); D = 256 needs the 128-row shape to keep its 192
# accumulator and q registers from spilling.
SHAPES = {64: (64, 64), 128: (64, 32), 256: (128, 16)}


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


def _shared_address_asm(body):
    """PTX that converts operand ``$A`` (a generic pointer into shared memory) to a shared address."""
    return "{ .reg .u64 sa; cvta.to.shared.u64 sa, $A; " + body + " }"


@intrinsic
def cp_async16(typingctx, array, index, src, src_index, src_bytes):
    """Asynchronous copy of 16 bytes from global ``src[src_index]`` (words, 16-byte aligned) to
    shared ``array[index]`` (cp.async.cg: bypasses L1); ``src_bytes`` 0 writes zeros instead."""
    sig = types.void(array, index, src, src_index, uint32)

    def codegen(context, builder, signature, args):
        base = context.make_array(signature.args[0])(context, builder, args[0]).data
        dst = builder.gep(base, [context.cast(builder, args[1], signature.args[1], types.intp)])
        from_ = builder.gep(args[2], [context.cast(builder, args[3], signature.args[3], types.intp)])
        size = context.cast(builder, args[4], signature.args[4], uint32)
        ptr = ir.IntType(32).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [ptr, ptr, ir.IntType(32)])
        asm = _shared_address_asm("cp.async.cg.shared.global [sa], [$1], 16, $2;").replace("$A", "$0")
        builder.call(ir.InlineAsm(fnty, asm, "l,l,r,~{memory}", side_effect=True), [dst, from_, size])
        return context.get_dummy_value()

    return sig, codegen


def _asm_statement(text):
    @intrinsic
    def statement(typingctx):
        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()

        return types.void(), codegen

    return statement


cp_async_commit = _asm_statement("cp.async.commit_group;")
cp_async_wait_all = _asm_statement("cp.async.wait_group 0;")
cp_async_wait_but_one = _asm_statement("cp.async.wait_group 1;")  # the newest group may still fly


@intrinsic
def ldmatrix_x4_trans(typingctx, array, index):
    """ldmatrix.x4.trans: four 8x8 bf16 matrices whose rows (16 bytes each, lane l giving row l % 8
    of matrix l // 8 at ``array[index]``) come back transposed, one uint32 of each per lane: the
    B fragments of a row-major [key][dim] V for P·V."""
    sig = types.UniTuple(uint32, 4)(array, index)

    def codegen(context, builder, signature, args):
        base = context.make_array(signature.args[0])(context, builder, args[0]).data
        addr = builder.gep(base, [context.cast(builder, args[1], signature.args[1], types.intp)])
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32.as_pointer()])
        asm = _shared_address_asm("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [sa];")
        call = builder.call(ir.InlineAsm(fnty, asm.replace("$A", "$4"), "=r,=r,=r,=r,l,~{memory}", side_effect=True),
                            [addr])
        return context.make_tuple(builder, signature.return_type, [builder.extract_value(call, i) for i in range(4)])

    return sig, codegen


def make_prefill_attention(D, ROWS, BK):
    THREADS = 2 * ROWS  # one warp per 16 rows
    KS = D // 16  # k-steps of q·Kᵀ
    NB = BK // 8  # 8-key column blocks of S
    KK = BK // 16  # k-steps of P·V
    DB = D // 8  # 8-dim column blocks of the output
    DG = D // 8  # 16-byte chunks (8 bf16) per key row
    W = D // 2  # words per staged K or V row
    TILE = BK * W  # words of one staged K (or V) tile
    STAGED = STAGES * TILE
    CHUNKS = BK * DG // THREADS  # 16-byte copies per thread per tile, of K and of V each
    assert CHUNKS * THREADS == BK * DG and DG >= 8

    def prefill_attention(qkv, kc, page_stride, page_tables, max_pages, row_table, positions, out, rows,
                          n_heads, n_kv, page_shift, scale_log2):
        sh_k = cuda.shared.array(STAGED, uint32)
        sh_v = cuda.shared.array(STAGED, uint32)
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
        m_a = NEG_BIG
        m_b = NEG_BIG
        l_a = zero
        l_b = zero
        k_off = (int64(kvh) << page_shift) * D
        v_off = k_off + (int64(n_kv) << page_shift) * D
        # ldmatrix row of this lane: row (lane & 7) of matrix (lane >> 3) = keys +8 for odd
        # matrices, dims +8 (the next chunk) for the upper two.
        v_key = ((lane >> 3) & 1) * 8 + (lane & 7)
        v_chunk = lane >> 4

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
            n_tiles = (kv_len + BK - 1) // BK
            fetch_tile(sh_k, sh_v, 0, kc, page_stride, page_tables, table_base, 0, kv_len, page_shift, k_off,
                       v_off, tid)
            for it in range(n_tiles):
                # Double buffering: the copies of tile it + 1 fly while tile it is computed.
                k0 = it * BK
                if it + 1 < n_tiles:
                    fetch_tile(sh_k, sh_v, (it + 1) & 1, kc, page_stride, page_tables, table_base, k0 + BK, kv_len,
                               page_shift, k_off, v_off, tid)
                    cp_async_wait_but_one()
                else:
                    cp_async_wait_all()
                cuda.syncthreads()  # tile it is in shared memory for every warp
                if k0 <= warp_last:  # else every row of this warp is before the tile (warp-uniform)
                    kt = (it & 1) * TILE
                    for nb in range(NB):
                        for c in range(4):
                            s[nb, c] = zero
                    for j in range(KS // 2):
                        for nb in range(NB):
                            k0w, k1w, k2w, k3w = shared_u32x4(sh_k, kt + (nb * 8 + g) * W + 4 * ((4 * j + t) ^ (g & 7)))
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
                    # Rescale only when some row of the warp found a larger max (alpha is exactly 1
                    # otherwise): along a long row the max settles and the DB*4 multiplies go away.
                    if cuda.any_sync(0xFFFFFFFF, mx_a > m_a or mx_b > m_b):
                        l_a *= alpha_a
                        l_b *= alpha_b
                        for db in range(DB):
                            o[db, 0] *= alpha_a
                            o[db, 1] *= alpha_a
                            o[db, 2] *= alpha_b
                            o[db, 3] *= alpha_b
                    m_a = mx_a
                    m_b = mx_b
                    for nb in range(NB):
                        for c in range(2):
                            pa = libdevice.exp2f(s[nb, c] - ref_a)
                            pb = libdevice.exp2f(s[nb, 2 + c] - ref_b)
                            s[nb, c] = pa
                            s[nb, 2 + c] = pb
                            l_a += pa
                            l_b += pb

                    # P·V: the S accumulators of key blocks 2kk and 2kk+1 are P's A fragment for
                    # k-step kk; V's B fragments come transposed out of ldmatrix, two 8-dim blocks a call.
                    for kk in range(KK):
                        p0 = pack_bf16x2(s[2 * kk, 0], s[2 * kk, 1])
                        p1 = pack_bf16x2(s[2 * kk, 2], s[2 * kk, 3])
                        p2 = pack_bf16x2(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                        p3 = pack_bf16x2(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
                        key = kk * 16 + v_key
                        for dp in range(DB // 2):
                            b0, b1, b2, b3 = ldmatrix_x4_trans(
                                sh_v, kt + key * W + 4 * ((2 * dp + v_chunk) ^ (key & 7)))
                            o[2 * dp, 0], o[2 * dp, 1], o[2 * dp, 2], o[2 * dp, 3] = mma_bf16_16816(
                                p0, p1, p2, p3, b0, b1, o[2 * dp, 0], o[2 * dp, 1], o[2 * dp, 2], o[2 * dp, 3])
                            o[2 * dp + 1, 0], o[2 * dp + 1, 1], o[2 * dp + 1, 2], o[2 * dp + 1, 3] = mma_bf16_16816(
                                p0, p1, p2, p3, b2, b3,
                                o[2 * dp + 1, 0], o[2 * dp + 1, 1], o[2 * dp + 1, 2], o[2 * dp + 1, 3])
                cuda.syncthreads()  # every warp is done with this stage before the next copy into it
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
    def fetch_tile(sh_k, sh_v, stage, kc, page_stride, page_tables, table_base, k0, kv_len, page_shift, k_off, v_off,
                   tid):
        """Start the copies of keys k0 .. k0 + BK (K and V, row-major, one 16-byte chunk per copy) into
        ``stage``; keys past ``kv_len`` become zeros (no read past the used pages, no garbage that a
        zero weight would turn into NaN). Chunk c of key row j sits at chunk c ^ (j & 7): the 8 rows
        of one ldmatrix or of one quarter-warp fragment read hit 8 different banks."""
        for it in range(CHUNKS):
            i = tid + it * THREADS
            j = i // DG
            chunk = i - j * DG
            key = k0 + j
            kq = min(key, kv_len - 1)
            page = int64(page_tables[table_base + (kq >> page_shift)])
            elem = page * page_stride + int64(kq & ((1 << page_shift) - 1)) * D + chunk * 8
            size = uint32(16) if key < kv_len else uint32(0)
            dst = stage * TILE + j * W + 4 * (chunk ^ (j & 7))
            cp_async16(sh_k, dst, kc, (elem + k_off) >> 1, size)
            cp_async16(sh_v, dst, kc, (elem + v_off) >> 1, size)
        cp_async_commit()

    return prefill_attention


SIGNATURE = (F32P, U32P, int64, I32P, int32, I32P, I32P, F32P, int32, int32, int32, int32, float32)

KERNELS = {f"prefill_attention_d{d}": (make_prefill_attention(d, rows, bk), SIGNATURE,
                                       {"rows": rows, "threads": 2 * rows, "keys": bk})
           for d, (rows, bk) in SHAPES.items()}
