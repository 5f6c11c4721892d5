"""Shared device helpers and type aliases for the Numba kernels.

Kernels take C-style pointers (``types.CPointer``) so that their PTX entries have plain
``.param .u64`` / ``.u32`` / ``.f32`` parameters that ``cuLaunchKernel`` fills from the manifest.
bf16 values travel as raw ``uint16`` bit patterns (or packed in ``uint32`` pairs); they widen to
fp32 by a 16-bit shift and narrow with round-to-nearest-even, exactly like ``ninfer.artifact.bf16``.
Every arithmetic constant is typed float32/uint64 on purpose: a bare Python float would promote
the expression to float64 (slow on the GPU and a different rounding than the reference).
"""

from __future__ import annotations

from llvmlite import ir
from numba import cuda, float32, int32, int64, uint16, uint32, uint64, types
from numba.cuda import libdevice
from numba.cuda.extending import intrinsic

F32P = types.CPointer(float32)
I32P = types.CPointer(int32)
U16P = types.CPointer(uint16)
U32P = types.CPointer(uint32)
U64P = types.CPointer(uint64)

# Manifest spelling of each parameter type the launcher knows how to pack.
TYPE_NAMES = {F32P: "ptr", I32P: "ptr", U16P: "ptr", U32P: "ptr", U64P: "ptr",
              int32: "i32", int64: "i64", uint64: "u64", float32: "f32"}

NEG_BIG = float32(-3.0e38)


@cuda.jit(device=True, inline=True)
def bf16_to_f32(bits):
    return libdevice.int_as_float(int32(uint32(bits) << uint32(16)))


@cuda.jit(device=True, inline=True)
def bf16_lo(word):
    """Low bf16 of a little-endian uint32 pair (the element at the lower address)."""
    return libdevice.int_as_float(int32(word << uint32(16)))


@cuda.jit(device=True, inline=True)
def bf16_hi(word):
    return libdevice.int_as_float(int32(word & uint32(0xFFFF0000)))


@cuda.jit(device=True, inline=True)
def f32_to_bf16(value):
    """Round to nearest even, as ninfer.artifact.bf16.from_float32 does."""
    bits = uint32(libdevice.float_as_int(value))
    rounding = ((bits >> uint32(16)) & uint32(1)) + uint32(0x7FFF)
    return uint16((bits + rounding) >> uint32(16))


@cuda.jit(device=True, inline=True)
def warp_sum(value):
    for offset in (16, 8, 4, 2, 1):
        value += cuda.shfl_xor_sync(0xFFFFFFFF, value, offset)
    return value


@cuda.jit(device=True, inline=True)
def warp_max(value):
    for offset in (16, 8, 4, 2, 1):
        value = max(value, cuda.shfl_xor_sync(0xFFFFFFFF, value, offset))
    return value


@cuda.jit(device=True)
def block_sum(value, scratch):
    """Sum over the block; ``scratch`` is a shared float32[32]. Every thread gets the total."""
    lane = cuda.threadIdx.x & 31
    warp = cuda.threadIdx.x >> 5
    value = warp_sum(value)
    if lane == 0:
        scratch[warp] = value
    cuda.syncthreads()
    nwarps = (cuda.blockDim.x + 31) >> 5
    total = float32(0.0)
    for i in range(nwarps):
        total += scratch[i]
    cuda.syncthreads()
    return total


def _warp_redux(op: str):
    """``redux.sync.<op>.s32`` over the full warp: one instruction instead of five shuffle steps
    (sm_80+; every lane of the warp must call it)."""
    @intrinsic
    def redux(typingctx, value):
        sig = int32(value)

        def codegen(context, builder, signature, args):
            val = context.cast(builder, args[0], signature.args[0], int32)
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
            asm = ir.InlineAsm(fnty, f"redux.sync.{op}.s32 $0, $1, 0xffffffff;", "=r,r", side_effect=True)
            return builder.call(asm, [val], attrs=("convergent",))  # never moved into divergent code

        return sig, codegen

    return redux


warp_max_i32 = _warp_redux("max")
warp_min_i32 = _warp_redux("min")


# -- 16-byte vector loads ---------------------------------------------------------------------------
# Numba splits struct loads into scalars; these intrinsics emit one aligned LLVM vector load, which
# NVVM turns into ld.v4.f32 / ld.v2.u64 (one instruction, 16 bytes per lane). The caller guarantees
# 16-byte alignment (element index a multiple of 4 for f32, 2 for u64, on a 16-byte-aligned base).

def _vector_load(element: ir.Type, count: int, result_type, align: int = 16):
    @intrinsic
    def load(typingctx, ptr, index):
        sig = types.UniTuple(result_type, count)(ptr, index)

        def codegen(context, builder, signature, args):
            base, idx = args
            addr = builder.gep(base, [idx])
            vec = builder.load(builder.bitcast(addr, ir.VectorType(element, count).as_pointer()), align=align)
            parts = [builder.extract_element(vec, ir.Constant(ir.IntType(32), j)) for j in range(count)]
            return context.make_tuple(builder, signature.return_type, parts)

        return sig, codegen

    return load


load_f32x4 = _vector_load(ir.FloatType(), 4, float32)
load_u64x2 = _vector_load(ir.IntType(64), 2, uint64)
load_u32x2 = _vector_load(ir.IntType(32), 2, uint32, align=8)  # 4 bf16; 8-byte aligned
load_u32x4 = _vector_load(ir.IntType(32), 4, uint32)  # 8 bf16; 16-byte aligned


@intrinsic
def load_i32_l2(typingctx, ptr, index):
    """``ptr[index]`` (int32) from L2 (``ld.global.cg``), whatever line of it this SM's L1 still holds:
    for a value an earlier kernel of the step wrote, read before this kernel's grid wait (PDL below)."""
    sig = int32(ptr, index)

    def codegen(context, builder, signature, args):
        base, idx = args
        addr = builder.ptrtoint(builder.gep(base, [idx]), ir.IntType(64))
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(64)])
        # side_effect: stays on its side of the wait (an asm statement with a memory clobber)
        return builder.call(ir.InlineAsm(fnty, "ld.global.cg.s32 $0, [$1];", "=r,l", side_effect=True), [addr])

    return sig, codegen


@intrinsic
def store_u32x4(typingctx, ptr, index, a, b, c, d):
    """One aligned 16-byte store (st.v4.u32) of four words at element ``index`` of ``ptr`` (any
    element type; the caller guarantees 16-byte alignment): 8 bf16 a lane, a warp's 512 bytes whole."""
    sig = types.void(ptr, index, uint32, uint32, uint32, uint32)

    def codegen(context, builder, signature, args):
        base, idx, *words = args
        vec = ir.Constant(ir.VectorType(ir.IntType(32), 4), ir.Undefined)
        for j, (word, ty) in enumerate(zip(words, signature.args[2:])):
            vec = builder.insert_element(vec, context.cast(builder, word, ty, uint32), ir.Constant(ir.IntType(32), j))
        addr = builder.bitcast(builder.gep(base, [idx]), ir.VectorType(ir.IntType(32), 4).as_pointer())
        builder.store(vec, addr, align=16)

    return sig, codegen


@intrinsic
def atomic_add_i32(typingctx, ptr, index, value):
    """``old = ptr[index]; ptr[index] += value`` as one relaxed device-scope atomic on a pointer
    parameter (``cuda.atomic`` takes arrays only); the caller orders it with ``cuda.threadfence``."""
    sig = int32(ptr, index, int32)

    def codegen(context, builder, signature, args):
        base, idx, val = args
        val = context.cast(builder, val, signature.args[2], int32)
        return builder.atomic_rmw("add", builder.gep(base, [idx]), val, "monotonic")

    return sig, codegen


@intrinsic
def ticket_acq_rel(typingctx, ptr, index):
    """``old = ptr[index]; ptr[index] += 1`` (int32) as one acquire-release device-scope atomic: taken by
    one thread after a block barrier, it publishes what the whole block wrote before the barrier and,
    for the block that takes the last ticket, makes what the other blocks published visible to the
    threads past the next barrier (the barrier carries the ordering both ways; no ``threadfence``)."""
    sig = int32(ptr, index)

    def codegen(context, builder, signature, args):
        base, idx = args
        addr = builder.ptrtoint(builder.gep(base, [idx]), ir.IntType(64))
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(64)])
        return builder.call(ir.InlineAsm(fnty, "atom.acq_rel.gpu.global.add.s32 $0, [$1], 1;", "=r,l",
                                         side_effect=True), [addr])

    return sig, codegen


@cuda.jit(device=True, inline=True)
def last_to_finish(counters, index, arrivals):
    """Whether this block is the last of ``arrivals`` blocks to finish, each taking a ticket from
    ``counters[index]`` once its global writes are out (a fence first); the last one resets the
    counter to zero for the next launch and, after another fence, may read what the others wrote.
    Every thread of the block calls it (it has block barriers). decode_attention's split merge takes
    its ticket the same way, written out (its trace marks sit between the steps)."""
    flag = cuda.shared.array(1, int32)
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        taken = atomic_add_i32(counters, index, 1)
        flag[0] = int32(taken == arrivals - 1)
        if taken == arrivals - 1:
            counters[index] = 0  # every block has had its ticket
    cuda.syncthreads()
    if flag[0] == 0:
        return False
    cuda.threadfence()
    return True


# -- programmatic dependent launch (PDL) ------------------------------------------------------------
# A decode step is a chain of kernels, each reading what the one before wrote. Launched with the
# driver's programmatic-stream-serialization attribute, a kernel's blocks may be scheduled while its
# predecessor still runs, and wait on the chip instead of behind a launch. The rules every kernel
# marked ``grid_wait`` in the manifest keeps:
# - every thread calls ``grid_dependency_wait`` before it reads or writes anything a previous kernel
#   of the step may touch (activations, the new KV slots, counters); weights, keys of earlier steps
#   and the step's uploaded inputs (copied before its first kernel started) may be read before it;
# - the wait comes before any early return, so the grid cannot finish before its predecessor has, and
#   "my predecessor is done" implies "every kernel before it is done";
# - ``launch_dependents`` only lets the next kernel's blocks be scheduled once every block of this
#   one has issued it; it says nothing about memory. Without the launch attribute both are no-ops.
# - one exception: a kernel whose predecessor issues ``launch_dependents`` only after its own wait
#   starts after every kernel before that predecessor has finished, so it may read their outputs
#   before its wait, through ``load_i32_l2`` (an SM's L1 may keep an older line of them). The MoE's
#   ``e`` builds: gate/up triggers late, and down reads the routing's plan and loads its weights early.

def asm_statement(asm: str):
    """An intrinsic taking no arguments that emits ``asm`` (a PTX statement) where it is called."""
    @intrinsic
    def statement(typingctx):
        def codegen(context, builder, signature, args):
            # The memory clobber keeps the compiler from moving loads or stores across the statement.
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), asm, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()

        return types.void(), codegen

    return statement


grid_dependency_wait = asm_statement("griddepcontrol.wait;")
launch_dependents = asm_statement("griddepcontrol.launch_dependents;")


@intrinsic
def prefetch_l2(typingctx, ptr, index, nbytes):
    """Start pulling ``nbytes`` (a multiple of 16) from ``&ptr[index]`` (16-byte aligned) into L2; one
    thread issues it for the whole range (the SM's bulk-copy unit does the rest). Only a hint, and one
    of 1 MiB or more does nothing on an H100 (ninfer/backends/cuda/forward.py L2_PREFETCH_MAX)."""
    sig = types.void(ptr, index, nbytes)

    def codegen(context, builder, signature, args):
        base, idx, size = args
        addr = builder.ptrtoint(builder.gep(base, [idx]), ir.IntType(64))
        size = context.cast(builder, size, signature.args[2], uint32)
        fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(32)])
        builder.call(ir.InlineAsm(fnty, "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", side_effect=True), [addr, size])
        return context.get_dummy_value()

    return sig, codegen


@cuda.jit(device=True, inline=True)
def prefetch_share(ptr, first, nbytes, parts, part):
    """Ask L2 for share ``part`` of ``parts`` (16-byte multiples, in order) of the ``nbytes`` from byte
    ``first`` of ``ptr`` (a uint32 pointer; 16-byte aligned there): one request. The next kernel's
    weights, while this one leaves DRAM time unused."""
    share = ((nbytes + parts - 1) // parts + 15) & ~15
    at = part * share
    if at < nbytes:
        prefetch_l2(ptr, (first + at) >> 2, min(share, nbytes - at))


@cuda.jit(device=True, inline=True)
def prefetch_block_share(ptr, nbytes):
    """``prefetch_share`` of the first ``nbytes`` of ``ptr``, the grid's blocks in launch order each
    taking its share (called by one thread of each block)."""
    blocks = cuda.gridDim.x * cuda.gridDim.y * cuda.gridDim.z
    block = (cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x + cuda.blockIdx.x
    prefetch_share(ptr, 0, nbytes, blocks, block)


# -- asynchronous copies into shared memory ---------------------------------------------------------
# ``cp.async`` (sm_80+) moves global memory into shared memory without passing through registers, so a
# kernel can start a copy, go on (or wait for its predecessor: PDL above) and collect it later with
# ``copy_async_wait`` followed by a block barrier (each thread waits only for its own copies).

@intrinsic
def copy_async_16(typingctx, dst, dst_index, src, src_index):
    """Start copying 16 bytes from ``&src[src_index]`` (a pointer) to ``&dst[dst_index]`` (a shared
    array); both addresses 16-byte aligned."""
    sig = types.void(dst, dst_index, src, src_index)

    def codegen(context, builder, signature, args):
        array, di, base, si = args
        data = context.make_array(signature.args[0])(context, builder, array).data
        di = context.cast(builder, di, signature.args[1], types.int64)
        si = context.cast(builder, si, signature.args[3], types.int64)
        to_addr = builder.gep(data, [di])
        from_addr = builder.gep(base, [si])
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i64, i64])
        asm = ("{ .reg .u64 s64; .reg .u32 s32; cvta.to.shared.u64 s64, $0; cvt.u32.u64 s32, s64; "
               "cp.async.cg.shared.global [s32], [$1], 16; }")
        # No memory clobber: loads around an issue may be reordered freely (the page lookups of
        # several copies go out together); ``copy_async_wait`` (volatile, clobbering memory) orders
        # the copies before every later access of the destination.
        builder.call(ir.InlineAsm(fnty, asm, "l,l", side_effect=True),
                     [builder.ptrtoint(to_addr, i64), builder.ptrtoint(from_addr, i64)])
        return context.get_dummy_value()

    return sig, codegen


copy_async_wait = asm_statement("cp.async.wait_all;")


@intrinsic
def global_timer(typingctx):
    """The chip's nanosecond clock (``%globaltimer``, comparable across SMs): for traced kernel variants."""
    sig = uint64()

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [])
        return builder.call(ir.InlineAsm(fnty, "mov.u64 $0, %globaltimer;", "=l", side_effect=True), [])

    return sig, codegen


# -- shared-memory addresses, loads, stores and copies -----------------------------------------------
# Kernels that manage their own shared memory (the tensor-core attention and GEMV kernels) address it
# by 32-bit shared-window byte addresses, and copy global memory into it with ``cp.async`` in commit
# groups (``cp_async_wait[n]``: every group but the newest n has landed).

def inline_asm(fnty, text, constraints, args, builder, side_effect=True):
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)


I32 = ir.IntType(32)
I64 = ir.IntType(64)


@intrinsic
def shared_address(typingctx, array):
    """The 32-bit shared-window byte address of a shared array's first element: shared loads and
    copies then address it with 32-bit adds and immediate offsets instead of 64-bit generic math."""
    sig = uint32(array)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        generic = builder.ptrtoint(data, I64)
        return inline_asm(ir.FunctionType(I32, [I64]),
                          "{ .reg .u64 a; cvta.to.shared.u64 a, $1; cvt.u32.u64 $0, a; }", "=r,l", [generic], builder,
                          side_effect=False)

    return sig, codegen


@intrinsic
def global_address(typingctx, pointer):
    """A global pointer as an integer, for byte arithmetic that stays in registers."""
    sig = uint64(pointer)

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], I64)

    return sig, codegen


def shared_load_x4(text: str):
    """An intrinsic running ``text`` (PTX writing four 32-bit registers $0..$3 from shared byte address
    $4) and returning the four words."""
    @intrinsic
    def load(typingctx, address):
        sig = types.UniTuple(uint32, 4)(uint32)

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.LiteralStructType([I32] * 4), [I32])
            call = inline_asm(fnty, text, "=r,=r,=r,=r,r", args, builder)
            words = [builder.extract_value(call, i) for i in range(4)]
            return context.make_tuple(builder, signature.return_type, words)

        return sig, codegen

    return load


# Four words at shared byte ``address`` (16-byte aligned) in one ld.shared.v4.
lds_u32x4 = shared_load_x4("ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];")


@intrinsic
def lds_u32(typingctx, address):
    """The word at shared byte ``address`` (4-byte aligned)."""
    sig = uint32(uint32)

    def codegen(context, builder, signature, args):
        return inline_asm(ir.FunctionType(I32, [I32]), "ld.shared.u32 $0, [$1];", "=r,r", args, builder)

    return sig, codegen


@intrinsic
def sts_u32(typingctx, address, word):
    """One word to shared byte ``address`` (4-byte aligned)."""
    sig = types.void(uint32, uint32)

    def codegen(context, builder, signature, args):
        inline_asm(ir.FunctionType(ir.VoidType(), [I32] * 2), "st.shared.u32 [$0], $1;", "r,r,~{memory}", args, builder)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def sts_u32x4(typingctx, address, w0, w1, w2, w3):
    """Four words to shared byte ``address`` (16-byte aligned) in one st.shared.v4."""
    sig = types.void(uint32, uint32, uint32, uint32, uint32)

    def codegen(context, builder, signature, args):
        inline_asm(ir.FunctionType(ir.VoidType(), [I32] * 5), "st.shared.v4.u32 [$0], {$1, $2, $3, $4};",
                   "r,r,r,r,r,~{memory}", args, builder)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cp_async16(typingctx, address, source, size):
    """Asynchronous copy of 16 bytes from global byte address ``source`` to shared byte ``address``
    (cp.async.cg: bypasses L1); ``size`` 0 writes zeros instead."""
    sig = types.void(uint32, uint64, uint32)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.VoidType(), [I32, I64, I32])
        inline_asm(fnty, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}", args, builder)
        return context.get_dummy_value()

    return sig, codegen


cp_async_commit = asm_statement("cp.async.commit_group;")
# cp_async_wait[n]: every committed group but the newest n has landed
cp_async_wait = tuple(asm_statement(f"cp.async.wait_group {n};") for n in range(8))
