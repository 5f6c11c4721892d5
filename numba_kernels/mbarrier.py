"""Shared-memory barriers (``mbarrier``, sm_80+) from Numba, as inline PTX.

An mbarrier is a 64-bit object in shared memory (8-byte aligned) that completes a *phase* once the
number of arrivals given at ``init`` has been counted, then starts the next phase with the same
count. Unlike ``bar.sync`` it blocks nobody who does not ask: a thread arrives and goes on, and a
thread that needs the phase done waits for it by its parity (phase ``k`` of a barrier has parity
``k & 1``; a wait for the parity of the phase before the first, 1, returns at once). That lets the
warpgroups of a block each move through a pipeline of shared-memory stages at their own pace, a
"full" barrier a stage saying its copies have landed and an "empty" one that every reader is done.

``cp_async_arrive`` arrives on a barrier when the calling thread's earlier ``cp.async`` copies have
landed, without a pending arrival of its own (``.noinc``): the barrier's count must include it.
Every address is a 32-bit shared-window byte address (``shared_address``).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types, uint32
from numba.cuda.extending import intrinsic

_I32 = ir.IntType(32)


def _statement(builder, text, args):
    fnty = ir.FunctionType(ir.VoidType(), [_I32] * len(args))
    constraints = ",".join(["r"] * len(args) + ["~{memory}"])
    builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), list(args))


@intrinsic
def mbarrier_init(typingctx, address, count):
    """Set up the barrier at ``address`` for ``count`` arrivals a phase (one thread, before a block
    barrier publishes it)."""
    sig = types.void(uint32, uint32)

    def codegen(context, builder, signature, args):
        _statement(builder, "mbarrier.init.shared::cta.b64 [$0], $1;", args)
        return context.get_dummy_value()

    return sig, codegen


def _on_barrier(text):
    """An intrinsic ``f(address)`` emitting ``text`` with the barrier's shared address as ``$0``."""
    @intrinsic
    def statement(typingctx, address):
        def codegen(context, builder, signature, args):
            _statement(builder, text, args)
            return context.get_dummy_value()

        return types.void(uint32), codegen

    return statement


# One arrival (release: the caller's earlier shared-memory accesses happen before the phase completes).
mbarrier_arrive = _on_barrier("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [$0]; }")
# One arrival once this thread's ``cp.async`` copies issued so far have landed.
cp_async_arrive = _on_barrier("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];")


@intrinsic
def mbarrier_try_wait(typingctx, address, parity):
    """1 once the phase of parity ``parity`` (0 or 1) of the barrier has completed, else 0 after a
    bounded wait in the hardware; loop on it (acquire: what the arrivals published is then seen)."""
    sig = uint32(uint32, uint32)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(_I32, [_I32, _I32])
        text = ("{ .reg .pred done; mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; "
                "selp.u32 $0, 1, 0, done; }")
        return builder.call(ir.InlineAsm(fnty, text, "=r,r,r,~{memory}", side_effect=True), list(args))

    return sig, codegen
