"""Numba's CUDA simulator, completed for NInfer's kernels, so that they run on the CPU.

The simulator (numba-cuda, ``NUMBA_ENABLE_CUDASIM=1``) runs a kernel's Python function with every
thread of a block as a Python thread, but it has no warp shuffles, no ``syncwarp``, libdevice
functions that return None, and no way to run our ``@intrinsic`` functions (inline PTX). ``install()``
adds them, before any ``numba_kernels`` module is imported:

- warp collectives (shuffles, votes, ``syncwarp``, ``redux.sync``, ``mma.sync``, ``movmatrix``): each
  lane posts its operands under its count of collectives so far; the last lane of the warp to post
  computes every lane's result. A lane that never arrives (a collective in divergent code, which the
  hardware does not allow either) fails the kernel after ``COLLECTIVE_TIMEOUT_S``. The lanes (and a
  block's threads at a barrier) wait each on its own lock, which the last to arrive opens;
- ``numba_kernels.common``'s ``warp_sum`` / ``warp_max``: one collective instead of five shuffles;
- each intrinsic is replaced at its definition (``numba.cuda.extending.intrinsic`` is swapped for a
  decorator that looks the function up by its qualified name in ``_SIMULATED``), so the kernels that
  ``numba_kernels`` builds at import already call the Python versions; ones without a version
  (wgmma, mbarriers, ``ldmatrix``) raise when called;
- ``mma_bf16_16816`` multiplies the bf16 fragments exactly and adds in float64, rounding once to
  float32 (the tensor core's fp32 accumulation differs in the last bits: compare with tolerances,
  or bit for bit only between two simulated runs).

Blocks run one after another, so a grid's ticket (``last_to_finish``) sees every other block done
(and a kernel that spins on another block's progress would hang). ``SimGpu`` / ``SimKernels`` /
``patch_runtime`` put a device over NumPy memory under the runtime, so host code launches into the
simulator unchanged. Tests import this module only in subprocesses that set ``NUMBA_ENABLE_CUDASIM=1``
before numba.cuda is first imported (tests/sim_kernels.py); the pytest process never imports it.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

import numpy as np

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "import with NUMBA_ENABLE_CUDASIM=1"
assert "numba_kernels.common" not in sys.modules, "install() must run before numba_kernels is imported"

import numba.cuda.extending as _extending  # noqa: E402
from ninfer.artifact.bf16 import from_float32, to_float32  # noqa: E402
from numba.cuda import libdevice as _libdevice  # noqa: E402
from numba.cuda.simulator import kernelapi as _kernelapi  # noqa: E402

COLLECTIVE_TIMEOUT_S = 120.0
_LOCK = threading.Lock()
_ABSENT = object()  # a lane's operand not posted yet


# -- warp collectives -------------------------------------------------------------------------------

class _Warp:
    def __init__(self, lanes: int):
        self.lanes = lanes
        self.lock = threading.Lock()
        self.rounds: dict[int, dict] = {}


def _warp_of(thread) -> _Warp:
    """The calling thread's warp, looked up once a block (``Worker.assign`` clears ``sim_warp``)."""
    if thread.sim_warp is not None:
        return thread.sim_warp
    manager = thread._manager
    with _LOCK:
        warps = manager.__dict__.setdefault("sim_warps", {})
        warp = thread.thread_id >> 5
        if warp not in warps:
            threads = int(np.prod(manager._block_dim))
            warps[warp] = _Warp(min(32, threads - 32 * warp))
        thread.sim_warp = warps[warp]
        return thread.sim_warp


def _wait_at_gate(thread, what: str, missing=lambda: "") -> None:
    """Block the calling simulated thread until another opens its gate (``thread.gate``, a lock it
    holds). Each waiter has its own gate, opened once by whoever completes the barrier or collective,
    so a release wakes exactly the threads it frees: one condition shared by the block or warp woke
    them all to race for its lock, most of a collective's time. Gives up on an aborted block, or
    after ``COLLECTIVE_TIMEOUT_S`` (a thread that never arrives: divergent code)."""
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
    while not thread.gate.acquire(timeout=0.5):
        if thread.abort:
            raise RuntimeError(f"abort flag set while waiting on {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {missing() or 'the other threads'} never arrived (divergent code?)")


def collective(value, combine):
    """Post ``value`` for the calling thread's warp; ``combine(values)`` (one per lane, lane order) runs
    once, on the last lane to post, and returns each lane's result; returns this lane's."""
    thread = threading.current_thread()
    warp = _warp_of(thread)
    count = thread.sim_collectives
    thread.sim_collectives = count + 1
    lane = thread.thread_id & 31
    with warp.lock:
        round_ = warp.rounds.get(count)
        if round_ is None:
            round_ = warp.rounds[count] = {"values": [_ABSENT] * warp.lanes, "posted": 0, "waiting": []}
        round_["values"][lane] = value
        round_["posted"] += 1
        last = round_["posted"] == warp.lanes
        if last:
            del warp.rounds[count]
        else:
            round_["waiting"].append(thread.gate)
    if last:
        results = round_["results"] = combine(round_["values"])
        for gate in round_["waiting"]:
            gate.release()
        return results[lane]
    _wait_at_gate(thread, f"warp collective {count}",
                  lambda: f"lanes {[i for i, v in enumerate(round_['values']) if v is _ABSENT]}")
    return round_["results"][lane]


def _shuffle(source):
    """A shuffle whose lane ``l`` reads lane ``source(l, arg)`` (out of range: its own value)."""
    def shfl(self, mask, value, arg):
        def combine(posted):
            n = len(posted)
            out = []
            for lane, (_, a) in enumerate(posted):
                src = source(lane, a)
                out.append(posted[src][0] if 0 <= src < n else posted[lane][0])
            return out
        return collective((value, arg), combine)
    return shfl


def _syncwarp(self, mask=0xFFFFFFFF):
    collective(None, lambda posted: [None] * len(posted))


def _vote(reduce):
    def vote(self, mask, predicate):
        return collective(bool(predicate), lambda posted: [reduce(posted)] * len(posted))
    return vote


def _ballot(posted):
    return np.uint32(sum(1 << i for i, p in enumerate(posted) if p))


def _butterfly(reduce):
    """``numba_kernels.common``'s warp_sum / warp_max in one collective instead of five shuffles (each
    a round of the warp's threads waking one another: most of a reduction-heavy kernel's time here).
    The rounds are played on the posted values as the shuffles would play them, lane ``l`` combining
    its value with lane ``l ^ offset``'s (a lane past a partial warp's end: its own), so every lane gets
    the same bits; ``tests/sim_kernels.py``'s ``collectives`` case checks that."""
    def reduced(value):
        def combine(posted):
            n = len(posted)
            for offset in (16, 8, 4, 2, 1):
                posted = [reduce(v, posted[lane ^ offset] if lane ^ offset < n else v)
                          for lane, v in enumerate(posted)]
            return posted
        return collective(value, combine)
    return reduced


def _install_warp_reductions() -> None:
    import numba_kernels.common as common

    common.shuffled_warp_sum, common.shuffled_warp_max = common.warp_sum, common.warp_max
    common.warp_sum = _butterfly(lambda mine, other: mine + other)
    common.warp_max = _butterfly(max)


def _install_warp_functions() -> None:
    fake = _kernelapi.FakeCUDAModule
    fake.shfl_xor_sync = _shuffle(lambda lane, offset: lane ^ int(offset))
    fake.shfl_sync = _shuffle(lambda lane, src: int(src) & 31)
    fake.shfl_up_sync = _shuffle(lambda lane, delta: lane - int(delta))
    fake.shfl_down_sync = _shuffle(lambda lane, delta: lane + int(delta))
    fake.syncwarp = _syncwarp
    fake.any_sync = _vote(any)
    fake.all_sync = _vote(all)
    fake.ballot_sync = _vote(_ballot)

    _kernelapi.FakeCUDAShared.array = _shared_array
    _kernelapi.FakeCUDALocal.array = _local_array


def _numpy_dtype(dtype):
    from numba import types
    from numba.np import numpy_support

    return numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else np.dtype(dtype)


def _shared_array(self, shape, dtype, alignment=None):
    """The simulator's shared arrays, taking ``alignment`` (which it refuses; NumPy aligns anyway): one
    array a (file, line) of the call, shared by the launch's threads; shape 0 is the dynamic memory."""
    dtype = _numpy_dtype(dtype)
    if shape == 0:
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
    caller = sys._getframe(1)
    key = (caller.f_code.co_filename, caller.f_lineno)
    with _LOCK:
        if key not in self._allocations:
            self._allocations[key] = np.empty(shape, dtype)
        return self._allocations[key]


def _local_array(self, shape, dtype, alignment=None):
    return np.empty(shape, _numpy_dtype(dtype))


# -- bit patterns ------------------------------------------------------------------------------------

def int_as_float(value):
    return np.array([int(value) & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


def float_as_int(value):
    return np.array([value], np.float32).view(np.int32)[0]


def _bf16_pair(word) -> tuple[float, float]:
    word = int(word) & 0xFFFFFFFF
    return tuple(float(v) for v in to_float32(np.array([word & 0xFFFF, word >> 16], np.uint16)))


# -- tensor cores ------------------------------------------------------------------------------------

def _mma_combine(posted):
    """D = A @ B + C of ``mma.m16n8k16.row.col.f32.bf16.bf16.f32`` from the lanes' fragments (the
    layout in numba_kernels/mma.py); products exact, the sum in float64, rounded once to float32."""
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    c = np.zeros((16, 8))
    for lane, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) in enumerate(posted):
        g, t = lane >> 2, lane & 3
        a[g, 2 * t: 2 * t + 2] = _bf16_pair(a0)
        a[g + 8, 2 * t: 2 * t + 2] = _bf16_pair(a1)
        a[g, 2 * t + 8: 2 * t + 10] = _bf16_pair(a2)
        a[g + 8, 2 * t + 8: 2 * t + 10] = _bf16_pair(a3)
        b[2 * t: 2 * t + 2, g] = _bf16_pair(b0)
        b[2 * t + 8: 2 * t + 10, g] = _bf16_pair(b1)
        c[g, 2 * t: 2 * t + 2] = (c0, c1)
        c[g + 8, 2 * t: 2 * t + 2] = (c2, c3)
    d = (a @ b + c).astype(np.float32)
    return [(d[lane >> 2, 2 * (lane & 3)], d[lane >> 2, 2 * (lane & 3) + 1],
             d[(lane >> 2) + 8, 2 * (lane & 3)], d[(lane >> 2) + 8, 2 * (lane & 3) + 1]) for lane in range(32)]


def mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return collective((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_combine)


def pack_bf16x2(lo, hi):
    """``cvt.rn.bf16x2.f32``: round to nearest even, as the artifact converter does (NaN stays NaN)."""
    bits = from_float32(np.array([lo, hi], np.float32))
    return np.uint32(int(bits[0]) | int(bits[1]) << 16)


def _movmatrix_combine(posted):
    """The 8x8 b16 matrix transposed: lane (g, t) holds row g, columns 2t (low half) and 2t + 1."""
    m = np.zeros((8, 8), np.int64)
    for lane, word in enumerate(posted):
        g, t = lane >> 2, lane & 3
        m[g, 2 * t], m[g, 2 * t + 1] = int(word) & 0xFFFF, (int(word) >> 16) & 0xFFFF
    m = m.T
    return [np.uint32(m[lane >> 2, 2 * (lane & 3)] | (m[lane >> 2, 2 * (lane & 3) + 1] << 16)) for lane in range(32)]


def movmatrix_trans(word):
    return collective(word, _movmatrix_combine)


# -- the intrinsics, by qualified name ---------------------------------------------------------------

def _array(ptr) -> np.ndarray:
    """The NumPy array behind a kernel argument: a Pointer's view, a shared array, or a kernel's array."""
    if isinstance(ptr, Pointer):
        return ptr.a
    return ptr if isinstance(ptr, np.ndarray) else np.asarray(ptr._item._ary)


def _elements(ptr, index, dtype, count: int) -> np.ndarray:
    """``count`` elements of ``dtype`` from the pointer's element ``index`` on: the bytes there, as a
    vector load reinterprets them (a bf16 pointer read as uint32 words, say)."""
    array = _array(ptr)
    start = int(index) * array.itemsize
    return array.reshape(-1).view(np.uint8)[start: start + count * np.dtype(dtype).itemsize].view(dtype)


# -- shared-memory byte addresses and asynchronous copies ----------------------------------------------
# ``shared_address`` gives each shared array a 32-bit base of its own (1 MiB apart); the shared loads,
# stores and ``cp.async`` find the array again from an address. Copies complete at once, so the
# commit / wait statements have nothing to do.

_SHARED: list[np.ndarray] = []  # byte views; address (i + 1) << 20 is the first byte of _SHARED[i]
_DEVICE: list = []  # the SimDevice that global addresses point into


def _shared_address(array) -> np.uint32:
    raw = _array(array).reshape(-1).view(np.uint8)
    with _LOCK:
        for i, known in enumerate(_SHARED):
            if known.ctypes.data == raw.ctypes.data:
                return np.uint32((i + 1) << 20)
        _SHARED.append(raw)
        return np.uint32(len(_SHARED) << 20)


def _shared_bytes(address, nbytes: int) -> np.ndarray:
    address = int(address)
    raw = _SHARED[(address >> 20) - 1]
    offset = address & 0xFFFFF
    if offset + nbytes > raw.size:
        raise IndexError(f"shared address 0x{address:x} + {nbytes} past its array ({raw.size} bytes)")
    return raw[offset: offset + nbytes]


def _copy_async_16(dst, dst_index, src, src_index):
    _elements(dst, dst_index, np.uint8, 16)[:] = _elements(src, src_index, np.uint8, 16)


def _cp_async16(address, source, size):
    data = _DEVICE[-1].memory[int(source) - SimDevice.BASE:][:16] if int(size) else np.zeros(16, np.uint8)
    _shared_bytes(address, 16)[:] = data


def _prefetch_l2(ptr, index, nbytes):
    if isinstance(ptr, Pointer):  # launched through SimKernels: a device address to check
        _DEVICE[-1].prefetch(ptr.addr + int(index) * ptr.a.itemsize, int(nbytes))


def _sts(address, *words):
    _shared_bytes(address, 4 * len(words)).view(np.uint32)[:] = words


def _vector_load(env):
    from numba.np import numpy_support

    count, dtype = env["count"], numpy_support.as_dtype(env["result_type"])
    return lambda ptr, index: tuple(_elements(ptr, index, dtype, count))


def _redux(env):
    reduce = {"max": max, "min": min}[env["op"]]
    return lambda value: collective(int(value), lambda posted: [np.int32(reduce(posted))] * len(posted))


def _statement(env):
    asm = env["asm"]
    if asm.startswith(("griddepcontrol.", "cp.async.commit_group", "cp.async.wait")):
        return lambda: None  # launches run in order and copies complete at once here
    return _missing(f"asm_statement({asm!r})")


def _store_u32x4(ptr, index, a, b, c, d):
    _elements(ptr, index, np.uint32, 4)[:] = (a, b, c, d)


def _atomic_add_i32(ptr, index, value):
    with _LOCK:
        old = np.int32(ptr[index])
        ptr[index] = np.int32(old + value)
    return old


def _exp2_approx(x):
    return np.float32(np.exp2(np.float32(x)))


def _shared_load_x4(env):
    if not env["text"].startswith("ld.shared.v4.u32"):
        return _missing(env["text"].split()[0])  # ldmatrix: not simulated
    return lambda address: tuple(_shared_bytes(address, 16).view(np.uint32))


def _missing(name):
    def missing(*args):
        raise NotImplementedError(f"{name} has no simulator version (tests/kernel_sim.py)")
    return missing


_SIMULATED = {
    "_vector_load.<locals>.load": _vector_load,
    "_warp_redux.<locals>.redux": _redux,
    "asm_statement.<locals>.statement": _statement,
    "store_u32x4": lambda env: _store_u32x4,
    "atomic_add_i32": lambda env: _atomic_add_i32,
    "ticket_acq_rel": lambda env: (lambda ptr, index: _atomic_add_i32(ptr, index, 1)),
    "prefetch_l2": lambda env: _prefetch_l2,
    "load_i32_l2": lambda env: (lambda ptr, index: _elements(ptr, index, np.int32, 1)[0]),
    "global_timer": lambda env: (lambda: np.uint64(time.monotonic_ns())),
    "copy_async_16": lambda env: _copy_async_16,
    "shared_address": lambda env: _shared_address,
    "global_address": lambda env: (lambda ptr: np.uint64(ptr.addr)),
    "shared_load_x4.<locals>.load": _shared_load_x4,
    "lds_u32": lambda env: (lambda address: _shared_bytes(address, 4).view(np.uint32)[0]),
    "sts_u32": lambda env: _sts,
    "sts_u32x4": lambda env: _sts,
    "cp_async16": lambda env: _cp_async16,
    "load_weights_u64x2": lambda env: (lambda ptr, index: tuple(_elements(ptr, index, np.uint64, 2))),
    "mma_bf16_16816": lambda env: mma_bf16_16816,
    "pack_bf16x2": lambda env: pack_bf16x2,
    "movmatrix_trans": lambda env: movmatrix_trans,
    "exp2_approx": lambda env: _exp2_approx,
}


def _simulated_intrinsic(fn):
    """Stands in for ``numba.cuda.extending.intrinsic``: the Python version of ``fn``'s instruction,
    built from its closure (a factory's parameters, such as a vector load's element count)."""
    closure = dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))
    make = _SIMULATED.get(fn.__qualname__)
    return make(closure) if make else _missing(fn.__qualname__)


class _Block:
    """One block's barrier over its live threads (a thread that has returned no longer counts, as on
    the device) and its end (``finished``), which the simulator's manager found by polling every thread."""

    def __init__(self, threads: int):
        self.lock = threading.Lock()
        self.live = threads
        self.waiting: list = []  # the gates of the threads at the barrier
        self.finished = threading.Event()
        self.failure = None
        self.workers: list = []

    def arrive(self, gate=None) -> None:
        """A thread reaches the barrier (with its ``gate``) or returns (none): the barrier opens when
        every live thread is at it."""
        with self.lock:
            if gate is None:
                self.live -= 1
            else:
                self.waiting.append(gate)
            opened = self.waiting if self.waiting and len(self.waiting) == self.live else []
            if opened:
                self.waiting = []
            if not self.live:
                self.finished.set()
        for waiting in opened:
            waiting.release()

    def fail(self, failure) -> None:
        with self.lock:
            self.failure = self.failure or failure
            for worker in self.workers:
                worker.abort = True


@functools.cache
def _worker_class():
    """Simulated threads kept for block after block (the simulator starts a Python thread for every
    thread of every block, about 75 us each: most of a short kernel's time); a subclass of the
    simulator's ``BlockThread`` with an event-driven barrier instead of its manager's polling."""
    from numba.cuda.simulator.kernel import BlockThread
    from numba.cuda.simulator.kernelapi import Dim3

    class Worker(BlockThread):
        def __init__(self, manager):
            super().__init__(lambda: None, manager, (0, 0, 0), (0, 0, 0), False)
            self.go = threading.Event()
            self.gate = threading.Lock()  # locked, but from another thread's opening it to this one passing it
            self.gate.acquire()
            self.block = None
            self.job = None

        def assign(self, manager, block: _Block, grid_point, thread_point, job) -> None:
            self._manager = manager
            self.block = block
            self.blockIdx = Dim3(*grid_point)
            self.threadIdx = Dim3(*thread_point)
            x, y, _ = manager._block_dim
            self.thread_id = thread_point[0] + x * (thread_point[1] + y * thread_point[2])
            self.exception = None
            self.abort = False
            self.sim_collectives = 0
            self.sim_warp = None
            self.gate.acquire(blocking=False)  # closed again if an aborted block left it open
            self.job = job
            self.go.set()

        def syncthreads(self):
            self.block.arrive(self.gate)
            _wait_at_gate(self, "syncthreads")

        def run(self):
            while True:
                self.go.wait()
                self.go.clear()
                block = self.block
                try:
                    self.job()
                except Exception as e:  # as BlockThread.run reports it
                    block.fail((type(e)(f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}: {e}"),
                                sys.exc_info()[2]))
                finally:
                    block.arrive()

    return Worker


_WORKERS: list = []  # the pooled threads, started as blocks need them


def _run_block(self, grid_point, *args):
    """The simulator's ``BlockManager.run`` over pooled threads (``_worker_class``); returns when every
    thread has, raising the first thread's exception (the others are aborted, as the simulator does)."""
    points = list(np.ndindex(*self._block_dim))
    with _LOCK:
        while len(_WORKERS) < len(points):
            worker = _worker_class()(self)
            worker.start()
            _WORKERS.append(worker)
        workers = _WORKERS[:len(points)]
    block = _Block(len(points))
    block.workers = workers
    job = lambda: self._f(*args)  # noqa: E731
    for worker, point in zip(workers, points):
        worker.assign(self, block, grid_point, point, job)
    block.finished.wait()
    if block.failure:
        raise block.failure[0].with_traceback(block.failure[1])


def install() -> None:
    from numba.cuda.simulator.kernel import BlockManager

    BlockManager.run = _run_block
    _install_warp_functions()
    _extending.intrinsic = _simulated_intrinsic
    _libdevice.int_as_float = int_as_float
    _libdevice.float_as_int = float_as_int
    _install_warp_reductions()  # imports numba_kernels.common: after the intrinsics are swapped


# -- a device over NumPy memory -----------------------------------------------------------------------

class Pointer:
    """A kernel's pointer argument: a typed view of the simulated memory from its address on. Not an
    ndarray, so the simulator passes it through instead of copying it in and back out (views of one
    memory copied separately would overwrite each other's writes)."""

    __slots__ = ("a", "addr")

    def __init__(self, view: np.ndarray, addr: int):
        self.a = view
        self.addr = addr

    def __getitem__(self, index):
        if index < 0:
            raise IndexError(f"pointer index {index} < 0")
        return self.a[index]

    def __setitem__(self, index, value):
        if index < 0:
            raise IndexError(f"pointer index {index} < 0")
        self.a[index] = value


class SimDevice:
    """Device memory as one NumPy byte array; addresses start at 2^32, as tests/fake_cuda.py's do."""

    BASE = 1 << 32
    sm_count = 132

    def __init__(self, nbytes: int = 64 << 20):
        self.memory = np.zeros(nbytes, np.uint8)
        self.used = 0
        self.allocations: list[tuple[int, int]] = []  # (first address, end), for the L2 prefetches' checks
        self.prefetched = 0  # bytes kernels asked L2 for
        _DEVICE.append(self)

    def prefetch(self, addr: int, nbytes: int) -> None:
        """``cp.async.bulk.prefetch.L2`` (a hint: nothing moves here), checked as the device would not:
        16-byte aligned, a multiple of 16, inside one allocation, and no larger than a request the
        device carries out (forward.L2_PREFETCH_MAX: it drops a larger one without a word)."""
        from ninfer.backends.cuda.forward import L2_PREFETCH_MAX

        if addr % 16 or nbytes % 16 or nbytes <= 0:
            raise ValueError(f"L2 prefetch of {nbytes} bytes at 0x{addr:x}: not 16-byte aligned")
        if nbytes > L2_PREFETCH_MAX:
            raise ValueError(f"L2 prefetch of {nbytes} bytes in one request: the device would do nothing")
        if not any(first <= addr and addr + nbytes <= end for first, end in self.allocations):
            raise ValueError(f"L2 prefetch of {nbytes} bytes at 0x{addr:x}: outside every allocation")
        with _LOCK:
            self.prefetched += nbytes

    def alloc(self, nbytes: int, label: str = ""):
        from ninfer.backends.cuda import runtime as rt

        offset = -(-self.used // 256) * 256
        if offset + nbytes > self.memory.size:
            raise MemoryError(f"simulated device: {label} needs {nbytes} bytes, {self.memory.size - offset} free")
        self.used = offset + max(nbytes, 1)
        self.allocations.append((self.BASE + offset, self.BASE + offset + nbytes))
        return rt.DevicePtr(self.BASE + offset, nbytes, label)

    def free(self, ptr) -> None:
        pass

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)

    def bytes(self, ptr) -> np.ndarray:
        offset = ptr.addr - self.BASE
        return self.memory[offset: offset + ptr.nbytes]

    def view(self, addr: int, dtype) -> np.ndarray:
        offset = addr - self.BASE
        itemsize = np.dtype(dtype).itemsize
        end = offset + (self.memory.size - offset) // itemsize * itemsize
        return self.memory[offset:end].view(dtype)


def _argument(device: SimDevice, kind, value):
    from numba import types
    from numba.np import numpy_support

    if isinstance(kind, types.CPointer):
        return Pointer(device.view(value.addr, numpy_support.as_dtype(kind.dtype)), value.addr)
    return numpy_support.as_dtype(kind).type(value)


class SimKernels:
    """``rt.Kernels`` over the simulator: ``kernels[name].launch(grid, block, args, stream)`` checks the
    arguments against ptx/manifest.json and runs the kernel's Python function in the simulator."""

    from ninfer.backends.cuda.runtime import Kernels as _Kernels

    overlapped = _Kernels.overlapped  # launches run one after another here: overlapping changes nothing
    del _Kernels

    def __init__(self, device: SimDevice):
        import json

        from ninfer.backends.cuda import runtime as rt
        from numba_kernels.build import kernel_table

        self.device = device
        self.overlap = rt.Overlap()
        self.entries = json.loads((rt.PTX_DIR / "manifest.json").read_text())["kernels"]
        self.table = kernel_table()
        self._kernels = {}
        self.launches = []  # kernel names, in launch order
        self.seconds = {}  # simulated seconds by kernel name

    def __getitem__(self, name: str):
        if name not in self._kernels:
            self._kernels[name] = _sim_kernel(self, name)
        return self._kernels[name]


def _sim_kernel(kernels: SimKernels, name: str):
    from numba import cuda

    from ninfer.backends.cuda import runtime as rt

    class SimKernel(rt.Kernel):
        def launch(self, grid, block, args, stream, shared=None):
            shared = self.meta.get("shared", 0) if shared is None else shared
            self.pack(args)  # the manifest's argument count and types
            values = [_argument(kernels.device, kind, value) for kind, value in zip(signature, args)]
            kernels.launches.append(name)
            _SHARED.clear()  # each launch has shared memory of its own
            start = time.perf_counter()
            jitted[tuple(grid), tuple(block), 0, shared](*values)
            kernels.seconds[name] = kernels.seconds.get(name, 0.0) + time.perf_counter() - start

    function, signature = kernels.table[name][:2]
    jitted = cuda.jit(function)
    return SimKernel(name, None, kernels.entries[name]["params"], kernels.entries[name].get("meta"),
                     kernels.overlap)


def patch_runtime(device: SimDevice) -> None:
    """Point the runtime's copies, memsets and waits at ``device`` (host code such as StepBuffers.init
    calls them directly): this process then has no real device."""
    from ninfer.backends.cuda import runtime as rt

    def copy_h2d(dst, src, stream=None):
        raw = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        device.bytes(dst)[: raw.size] = raw

    def copy_d2h(dst, src, stream=None):
        raw = dst.reshape(-1).view(np.uint8)
        raw[:] = device.bytes(src)[: raw.size]

    def memset32(dst, value, count, stream=None):
        device.bytes(dst)[: 4 * count].view(np.uint32)[:] = value & 0xFFFFFFFF

    rt.copy_h2d, rt.copy_d2h, rt.memset32 = copy_h2d, copy_d2h, memset32
    rt.synchronize = lambda stream=None: None


class SimGpu:
    """tests/cuda/cuda_helpers.Gpu's calls over the simulated device (``stream`` is unused)."""

    def __init__(self, nbytes: int = 64 << 20):
        self.device = SimDevice(nbytes)
        self.kernels = SimKernels(self.device)
        self.stream = None

    def put(self, array: np.ndarray, label: str = "test"):
        array = np.ascontiguousarray(array)
        ptr = self.device.alloc(array.nbytes, label)
        self.device.bytes(ptr)[:] = array.view(np.uint8).ravel()
        return ptr

    def empty(self, nbytes: int, poison: int = 0x7FC00001):
        """Filled with a NaN pattern so unwritten outputs show up."""
        ptr = self.device.alloc(nbytes, "out")
        self.memset32(ptr, poison)
        return ptr

    def memset32(self, ptr, value: int) -> None:
        self.device.bytes(ptr)[: ptr.nbytes // 4 * 4].view(np.uint32)[:] = value & 0xFFFFFFFF

    def get(self, ptr, dtype, shape) -> np.ndarray:
        count = int(np.prod(shape))
        return self.device.view(ptr.addr, dtype)[:count].reshape(shape).copy()

    def launch(self, name, grid, block, args):
        self.kernels[name].launch(grid, block, args, self.stream)
