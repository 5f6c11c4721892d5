"""Tensor cores from Numba: the warp-wide bf16 MMA and bf16 packing, as inline PTX.

Numba has no tensor-core API, so these intrinsics emit the PTX instructions directly (an LLVM inline
``asm`` call that NVVM passes through). One ``mma_bf16_16816`` is one
``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``: a 16x16 bf16 A times a 16x8 bf16 B added to
a 16x8 fp32 C, spread over the 32 lanes of a warp. With ``g = lane >> 2`` and ``t = lane & 3``, and
the lower index in the low 16 bits of each packed pair (PTX ISA, "Matrix fragments for mma.m16n8k16"):

    A (16 x 16, M x K):  a0 = A[g][2t:2t+2]    a1 = A[g+8][2t:2t+2]
                         a2 = A[g][2t+8:2t+10] a3 = A[g+8][2t+8:2t+10]
    B (16 x 8,  K x N):  b0 = B[2t:2t+2][g]    b1 = B[2t+8:2t+10][g]   (two consecutive K of column g)
    C, D (16 x 8, f32):  c0 = C[g][2t]  c1 = C[g][2t+1]  c2 = C[g+8][2t]  c3 = C[g+8][2t+1]

Every lane of the warp must execute the MMA (it is ``.aligned``): keep it out of divergent code.

bf16 operands lose fp32 precision. ``split_bf16x2`` writes a float32 as a rounded bf16 ``big`` plus
the bf16 of its rounding remainder ``small``: multiplying the same bf16 weights by both and adding
(two MMAs into one accumulator) keeps about 16 significant bits of the activation instead of 8, which
is what fp32-activation parity with the reference backend needs when the weights are bf16 anyway.

``mma_check`` is a one-warp kernel that exercises all of the above; the GPU tests compare it with
NumPy, so a wrong fragment layout shows up here rather than inside a GEMM or an attention kernel.
"""

from __future__ import annotations

from llvmlite import ir
from numba import cuda, float32, int32, types, uint32
from numba.cuda import libdevice
from numba.cuda.extending import intrinsic

from numba_kernels.common import F32P, U32P

_F32 = ir.FloatType()
_I32 = ir.IntType(32)


@intrinsic
def mma_bf16_16816(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """(d0, d1, d2, d3) = A @ B + C for one warp; a*/b* are uint32 bf16 pairs, c*/d* float32."""
    sig = types.UniTuple(float32, 4)(*([uint32] * 6 + [float32] * 4))

    def codegen(context, builder, signature, args):
        args = [context.cast(builder, v, t, s) for v, t, s in zip(args, signature.args, sig.args)]
        fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
        asm = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
        call = builder.call(ir.InlineAsm(fnty, asm, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"), args)
        parts = [builder.extract_value(call, i) for i in range(4)]
        return context.make_tuple(builder, signature.return_type, parts)

    return sig, codegen


@intrinsic
def pack_bf16x2(typingctx, lo, hi):
    """Two float32 rounded to nearest-even bf16 in one uint32, ``lo`` in the low half."""
    sig = uint32(float32, float32)

    def codegen(context, builder, signature, args):
        lo_v, hi_v = (context.cast(builder, v, t, float32) for v, t in zip(args, signature.args))
        fnty = ir.FunctionType(_I32, [_F32, _F32])
        # cvt.rn.bf16x2.f32 d, a, b puts a in the upper half and b in the lower one.
        return builder.call(ir.InlineAsm(fnty, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f"), [hi_v, lo_v])

    return sig, codegen


@intrinsic
def movmatrix_trans(typingctx, word):
    """The warp's 8x8 b16 matrix transposed (``movmatrix.sync.aligned.m8n8.trans.b16``): each lane holds
    row ``g`` = lane >> 2, columns 2t and 2t + 1 (t = lane & 3, column 2t in the low half), in and out;
    an MMA's fp32 C rows, packed to bf16 pairs, come out as the B fragment of the transposed matrix."""
    sig = uint32(uint32)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I32, [_I32])
        return builder.call(ir.InlineAsm(fnty, "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r"), args)

    return sig, codegen


@cuda.jit(device=True, inline=True)
def split_bf16x2(lo, hi):
    """(big, small): bf16 pairs whose sum represents (lo, hi) to about 2^-17 relative."""
    big = pack_bf16x2(lo, hi)
    lo_big = libdevice.int_as_float(int32(big << uint32(16)))
    hi_big = libdevice.int_as_float(int32(big & uint32(0xFFFF0000)))
    return big, pack_bf16x2(lo - lo_big, hi - hi_big)


def mma_check(out, a, b, split):
    """One warp: out (16 x 8 f32) = A @ B.

    ``a`` holds A (16 x 16 bf16, row-major) as 128 packed uint32 pairs; ``b`` holds B (16 x 8 f32)
    stored column by column (``b[n * 16 + k]``). With ``split`` = 0 B is rounded to bf16; otherwise it
    goes through ``split_bf16x2`` and two MMAs. Launch: grid (1,), block (32,).
    """
    lane = cuda.threadIdx.x
    g = lane >> 2
    t = lane & 3
    a0 = a[g * 8 + t]
    a1 = a[(g + 8) * 8 + t]
    a2 = a[g * 8 + t + 4]
    a3 = a[(g + 8) * 8 + t + 4]
    col = g * 16
    big0, small0 = split_bf16x2(b[col + 2 * t], b[col + 2 * t + 1])
    big1, small1 = split_bf16x2(b[col + 2 * t + 8], b[col + 2 * t + 9])
    zero = float32(0.0)
    d0, d1, d2, d3 = mma_bf16_16816(a0, a1, a2, a3, big0, big1, zero, zero, zero, zero)
    if split != 0:  # uniform across the warp: every lane takes the same branch
        d0, d1, d2, d3 = mma_bf16_16816(a0, a1, a2, a3, small0, small1, d0, d1, d2, d3)
    out[g * 8 + 2 * t] = d0
    out[g * 8 + 2 * t + 1] = d1
    out[(g + 8) * 8 + 2 * t] = d2
    out[(g + 8) * 8 + 2 * t + 1] = d3


KERNELS = {
    "mma_check": (mma_check, (F32P, U32P, F32P, int32)),
}
