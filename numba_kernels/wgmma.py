"""Hopper's warpgroup MMA (``wgmma``, sm_90a) from Numba, as inline PTX.

A warpgroup is four consecutive warps (128 threads, the first warp's index a multiple of 4). One
``wgmma.mma_async`` multiplies a 64 x 16 bf16 A by a 16 x N bf16 B into a 64 x N fp32 accumulator
spread over the warpgroup's registers, asynchronously: the instruction returns at once, the result is
there after ``wgmma.commit_group`` and ``wgmma.wait_group``. B (and A, or A from registers) is read
from shared memory through a 64-bit *matrix descriptor*:

    bits  0-13  start address >> 4 (shared window)      bits 32-45  stride byte offset >> 4 (SBO)
    bits 16-29  leading byte offset >> 4 (LBO)          bits 62-63  swizzle: 1 = 128-byte

Our operands use the 128-byte swizzle: a "panel" of rows of 64 bf16 (128 bytes), 16-byte chunk ``c``
of row ``r`` stored at chunk ``c ^ (r & 7)``, panels 1024-byte aligned (the hardware applies the XOR
to address bits 4-6 from bits 7-9, so alignment makes it the row's index). Then

- a K-major operand (rows along M or N, the 16 K values of a step contiguous in a row: q and K for
  q·Kᵀ) has SBO = 1024 (eight rows), LBO unused; k-step ``j`` of a panel starts ``32 j`` bytes in;
- an MN-major operand (rows along K, N contiguous: V for P·V, ``trans-b``) has SBO = 1024 (eight
  K rows) and LBO = the byte distance from one 64-wide N panel to the next; k-step ``j`` starts
  ``16 j`` rows (``2048 j`` bytes) in.

Accumulator ``i`` of a thread (lane ``l`` of warp ``w`` of the warpgroup) is row ``16 w + l // 4``
(+ 8 when ``i % 4 >= 2``), column ``8 (i // 4) + 2 (l % 4) + i % 2``: the mma.m16n8 layout repeated
along N. An A from registers is mma.m16n8k16's A fragment (numba_kernels/mma.py) of the warp's 16
rows, so the accumulators of columns 16j..16j+15 packed to bf16 are A's k-step j (P·V after q·Kᵀ).

Ordering: ``wgmma_fence`` before the first MMA of a batch whose accumulators or A registers other
instructions wrote; ``fence_proxy_async`` after shared-memory writes (st.shared, cp.async) that an
MMA will read, before the barrier that publishes them; ``wgmma_wait`` returns the accumulators
through the wait, so no instruction reads them before the MMAs are done. Every instruction here is
``.aligned``: the whole warpgroup executes it, outside divergent code.
"""

from __future__ import annotations

from llvmlite import ir
from numba import cuda, float32, int32, types, uint32, uint64
from numba.cuda.extending import intrinsic

from numba_kernels.common import F32P, U32P, asm_statement, shared_address, sts_u32x4
from numba_kernels.mma import pack_bf16x2

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
SWIZZLE_128B = 1 << 62


wgmma_fence = asm_statement("wgmma.fence.sync.aligned;")
wgmma_commit = asm_statement("wgmma.commit_group.sync.aligned;")
fence_proxy_async = asm_statement("fence.proxy.async.shared::cta;")


def make_setmaxnreg(action, count):
    """The calling warpgroup's registers a thread set to ``count`` (a multiple of 8 in 24..256):
    ``"dec"`` gives the rest back to the block's pool, ``"inc"`` waits until the pool has enough.
    For warp-specialized kernels (launched with a register cap): a copying warpgroup shrinks, the
    MMA warpgroups grow. All four warps execute it, then each role's code runs to its end."""
    assert action in ("inc", "dec") and count % 8 == 0 and 24 <= count <= 256
    return asm_statement(f"setmaxnreg.{action}.sync.aligned.u32 {count};")


def _array_values(context, builder, array_type, array, count):
    data = context.make_array(array_type)(context, builder, array).data
    pointers = [builder.gep(data, [ir.Constant(_I64, i)]) for i in range(count)]
    return pointers, [builder.load(p) for p in pointers]


def make_wait(n, behind=0):
    """An intrinsic ``wait(acc)``: ``wgmma.wait_group behind`` (every commit group but the newest
    ``behind`` done) with the ``n`` accumulators of ``acc`` (a local float32 array) passed through it,
    so no read of them can move before the wait."""

    @intrinsic
    def wait(typingctx, acc):
        def codegen(context, builder, signature, args):
            pointers, values = _array_values(context, builder, signature.args[0], args[0], n)
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * n), [_F32] * n)
            constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["~{memory}"])
            wait_asm = ir.InlineAsm(fnty, f"wgmma.wait_group.sync.aligned {behind};", constraints, side_effect=True)
            call = builder.call(wait_asm, values)
            for i, p in enumerate(pointers):
                builder.store(builder.extract_value(call, i), p)
            return context.get_dummy_value()

        return types.void(acc), codegen

    return wait


def _mma(builder, n, asm_operands, operand_types, operand_constraints, acc_pointers, acc_values, operands):
    """Emit one wgmma whose accumulators are ``$0..$n-1`` (tied to the inputs after them)."""
    fnty = ir.FunctionType(ir.LiteralStructType([_F32] * n), [_F32] * n + operand_types)
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + operand_constraints + ["~{memory}"])
    regs = ", ".join(f"${i}" for i in range(n))
    call = builder.call(ir.InlineAsm(fnty, asm_operands.replace("ACC", "{" + regs + "}"), constraints,
                                     side_effect=True), acc_values + operands)
    for i, p in enumerate(acc_pointers):
        builder.store(builder.extract_value(call, i), p)


def make_mma_ss(n):
    """An intrinsic ``mma(acc, desc_a, desc_b, accumulate)``: acc (n/2 floats a thread of a 64 x n
    fp32 tile) = A·B (+ acc if ``accumulate`` != 0), A and B K-major bf16 in shared memory."""
    regs = n // 2

    @intrinsic
    def mma(typingctx, acc, desc_a, desc_b, accumulate):
        sig = types.void(acc, uint64, uint64, int32)

        def codegen(context, builder, signature, args):
            pointers, values = _array_values(context, builder, signature.args[0], args[0], regs)
            da, db, acc_flag = (context.cast(builder, v, t, s) for v, t, s in zip(args[1:], signature.args[1:],
                                                                                sig.args[1:]))
            asm = (f"{{ .reg .pred p; setp.ne.b32 p, ${2 * regs + 2}, 0; "
                   f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 ACC, ${2 * regs}, ${2 * regs + 1}, "
                   "p, 1, 1, 0, 0; }")
            _mma(builder, regs, asm, [_I64, _I64, _I32], ["l", "l", "r"], pointers, values, [da, db, acc_flag])
            return context.get_dummy_value()

        return sig, codegen

    return mma


def make_mma_rs(n, trans_b, flagged=False):
    """An intrinsic ``mma(acc, a0, a1, a2, a3, desc_b)``: acc (64 x n fp32) += A·B, A a 64 x 16 bf16
    from registers (mma.m16n8k16 A fragments of each warp's 16 rows), B in shared memory, MN-major
    (``trans_b``) or K-major. ``flagged``: a last argument ``accumulate`` as ``make_mma_ss``'s
    (0: acc = A·B)."""
    regs = n // 2

    def codegen(context, builder, signature, args):
        pointers, values = _array_values(context, builder, signature.args[0], args[0], regs)
        operands = list(args[1:])  # the declared types already
        a = 2 * regs
        asm = (f"{{ .reg .pred p; setp.ne.b32 p, ${a + 5}, 0; "
               f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 ACC, "
               f"{{${a}, ${a + 1}, ${a + 2}, ${a + 3}}}, ${a + 4}, p, 1, 1, {int(trans_b)}; }}")
        _mma(builder, regs, asm, [_I32] * 4 + [_I64, _I32], ["r"] * 4 + ["l", "r"], pointers, values,
             operands if flagged else operands + [ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    if flagged:
        @intrinsic
        def mma(typingctx, acc, a0, a1, a2, a3, desc_b, accumulate):
            return types.void(acc, uint32, uint32, uint32, uint32, uint64, int32), codegen
    else:
        @intrinsic
        def mma(typingctx, acc, a0, a1, a2, a3, desc_b):
            return types.void(acc, uint32, uint32, uint32, uint32, uint64), codegen

    return mma


@cuda.jit(device=True, inline=True)
def descriptor_low(address, leading_bytes):
    """The low word of a descriptor (start address, LBO): adding ``bytes >> 4`` to it moves the start
    with 32-bit arithmetic (a kernel short of registers builds the 64-bit value only at the MMA)."""
    return uint32(((address & 0x3FFFF) >> 4) | ((leading_bytes >> 4) << 16))


@intrinsic
def pack_u64(typingctx, low, high):
    """The 64-bit word ``{low, high}`` of two 32-bit words, as one ``mov.b64``: ptxas then keeps a
    descriptor's halves apart (numba types a sum of uint32 as 64-bit, and a 64-bit descriptor sum
    took a carried add and an OR of the constant high word ahead of every wgmma)."""
    sig = uint64(uint32, uint32)

    def codegen(context, builder, signature, args):
        return builder.call(ir.InlineAsm(ir.FunctionType(_I64, [_I32, _I32]), "mov.b64 $0, {$1, $2};", "=l,r,r"),
                            args)

    return sig, codegen


@cuda.jit(device=True, inline=True)
def descriptor_of(low, stride_bytes):
    """The 128-byte-swizzle descriptor of low word ``low`` (``descriptor_low``) and SBO ``stride_bytes``."""
    return pack_u64(uint32(low), uint32((stride_bytes >> 4) | (SWIZZLE_128B >> 32)))


@cuda.jit(device=True, inline=True)
def descriptor(address, leading_bytes, stride_bytes):
    """The 128-byte-swizzle matrix descriptor of the operand at shared byte ``address``; adding
    ``bytes >> 4`` to it moves its start (within the 14-bit field: shared addresses stay below 256 KiB)."""
    return descriptor_of(descriptor_low(address, leading_bytes), stride_bytes)


mma_64x64 = make_mma_ss(64)
mma_64x128_rs_t = make_mma_rs(128, trans_b=True)
wait_32 = make_wait(32)
wait_64 = make_wait(64)
CHECK_SHARED = 3 * 64 * 256 + 1024  # q, K, V (64 rows of 128 bf16 each, two panels), 1024-byte alignment slack


def wgmma_check(s_out, o_out, q, k, v):
    """One warpgroup: s_out (64 x 64 f32) = q·kᵀ with both in shared memory, then o_out (64 x 128) =
    bf16(s)·v with s from registers and v MN-major, each through the layouts and descriptors
    the prefill kernel uses. q, k, v: 64 x 128 bf16, row-major, as uint32 pairs. Launch: grid (1,),
    block (128,), CHECK_SHARED bytes of dynamic shared memory."""
    sh = cuda.shared.array(0, uint32, alignment=16)
    tid = cuda.threadIdx.x
    warp = tid >> 5
    g = (tid & 31) >> 2
    t = tid & 3
    base = (shared_address(sh) + uint32(1023)) & uint32(0xFFFFFC00)
    for i in range(tid, 3 * 64 * 16, 128):  # (matrix, row, 16-byte chunk)
        m = i // 1024
        r = (i // 16) % 64
        c = i % 16
        src = q if m == 0 else (k if m == 1 else v)
        at = r * 64 + c * 4
        sts_u32x4(base + uint32(m * 16384 + (c >> 3) * 8192 + r * 128 + 16 * ((c & 7) ^ (r & 7))),
                  src[at], src[at + 1], src[at + 2], src[at + 3])
    fence_proxy_async()
    cuda.syncthreads()
    s = cuda.local.array(32, float32)
    for i in range(32):
        s[i] = float32(0.0)
    wgmma_fence()
    for ks in range(8):
        off = uint32((ks >> 2) * 8192 + (ks & 3) * 32)
        mma_64x64(s, descriptor(base + off, 16, 1024), descriptor(base + uint32(16384) + off, 16, 1024), int32(ks))
    wgmma_commit()
    wait_32(s)
    for i in range(32):
        row = 16 * warp + g + 8 * ((i >> 1) & 1)
        s_out[row * 64 + 8 * (i >> 2) + 2 * t + (i & 1)] = s[i]
    o = cuda.local.array(64, float32)
    for i in range(64):
        o[i] = float32(0.0)
    wgmma_fence()
    for kk in range(4):
        mma_64x128_rs_t(o, pack_bf16x2(s[8 * kk], s[8 * kk + 1]), pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]),
                        pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]), pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]),
                        descriptor(base + uint32(32768 + kk * 2048), 8192, 1024))
    wgmma_commit()
    wait_64(o)
    for i in range(64):
        row = 16 * warp + g + 8 * ((i >> 1) & 1)
        o_out[row * 128 + 8 * (i >> 2) + 2 * t + (i & 1)] = o[i]


KERNELS = {"wgmma_check": (wgmma_check, (F32P, F32P, U32P, U32P, U32P),
                           {"threads": 128, "shared": CHECK_SHARED, "arch": "sm_90a"})}
