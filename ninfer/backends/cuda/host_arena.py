"""``HostArena``: the Host backing of the CUDA backend, one pinned allocation carved into arrays.

The spec's Host backing (``--host-context-mib``) is a pinned budget shared by pause snapshots and
spilled StateImages. The Engine accounts its bytes (``engine.pools.HostBudget``) and keeps whatever
``read_pages`` / ``read_state`` return; on the CUDA backend those arrays come from here, so the
device copies into and out of them are direct DMA (no staging copy) and the budget is page-locked
once, at startup, instead of page by page.

Allocation is first fit over a free list sorted by offset, in 256-byte units, and a freed block is
merged with its free neighbours. A block goes back when the last array over it is garbage
collected: the arrays ``array`` returns (and every view of them: a slice, a transpose, a ``.view``)
lead through ``.base`` to one ``_Block`` owner object, and ``weakref.finalize`` on that owner frees
the block. (Not a finalizer on the returned array itself: NumPy collapses a view's ``.base`` to the
first array that owns memory, so ``arr[1:]`` would not keep ``arr`` alive.) A copy (``.copy()``,
``np.array(arr)``) is ordinary memory and holds nothing.

When the arena has no room (fragmentation, or the Engine's in-flight destinations briefly
exceeding the budget) ``array`` returns a pageable ``np.empty`` instead and counts it in
``fallbacks``: the caller copies through its staging buffer then; nothing fails.

Thread-safety: the runner allocates on the Engine worker, while a finalizer runs on whichever
thread drops the last reference (or on the allocating thread itself, if a garbage collection
starts inside ``array``). So a finalizer never waits for the lock: it queues the block and frees
the queue only if the lock is free at once; ``array`` (and the figures) drain the queue first.

Arrays of the arena are valid until the device closes (``Device.close`` frees pinned memory).
"""

from __future__ import annotations

import bisect
import collections
import threading
import weakref
from typing import Any

import numpy as np

ALIGN = 256  # bytes: every block starts on this boundary (DMA-friendly, and any dtype's alignment)


class _Block:
    """The owner of one arena block: NumPy's ``.base`` chain of every array over the block ends
    here, and its finalizer returns the block. ``slab`` keeps the arena's memory object alive."""

    __slots__ = ("__array_interface__", "slab", "__weakref__")

    def __init__(self, slab: np.ndarray, addr: int, shape: tuple[int, ...], dtype: np.dtype):
        self.slab = slab
        self.__array_interface__ = {"shape": shape, "typestr": dtype.str, "data": (addr, False), "version": 3}


class HostArena:
    """``nbytes`` of pinned host memory from ``device.pinned``, handed out by ``array``."""

    def __init__(self, device: Any, nbytes: int):
        if nbytes < 0:
            raise ValueError(f"host arena size must be non-negative, got {nbytes}")
        self._slab = device.pinned(nbytes)
        self.addr = int(self._slab.ctypes.data)
        self.nbytes = int(nbytes)
        first = -self.addr % ALIGN  # real pinned memory is page-aligned; a test's may not be
        usable = max(0, nbytes - first) // ALIGN * ALIGN
        self.capacity = usable
        self._free: list[tuple[int, int]] = [(first, usable)] if usable else []  # (offset, size), sorted
        self._lock = threading.Lock()
        self._returned: collections.deque[tuple[int, int]] = collections.deque()  # freed, not yet merged
        self._used = 0
        self.peak = 0
        self.blocks = 0
        self.fallbacks = 0  # arrays that did not fit and came back pageable
        self.fallback_bytes = 0

    # -- allocation -------------------------------------------------------------------------------

    def array(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array in the arena, or a pageable one when none fits."""
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            self._drain()
            offset = self._take(size)
            if offset is None:
                self.fallbacks += 1
                self.fallback_bytes += nbytes
            else:
                self._used += size
                self.peak = max(self.peak, self._used)
                self.blocks += 1
        if offset is None:
            return np.empty(shape, dtype)
        owner = _Block(self._slab, self.addr + offset, shape, dtype)
        weakref.finalize(owner, self._release, offset, size)
        return np.asarray(owner)

    def contains(self, array: np.ndarray) -> bool:
        """Whether ``array``'s memory lies inside the arena (so device copies may use it directly).
        True for a C-contiguous array whose bytes fall in the slab; any other layout is False."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.nbytes == 0:
            return False
        start = int(array.__array_interface__["data"][0])
        return self.addr <= start and start + array.nbytes <= self.addr + self.nbytes

    # -- figures ----------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes in live blocks (each rounded up to ``ALIGN``)."""
        with self._lock:
            self._drain()
            return self._used

    @property
    def free_blocks(self) -> list[tuple[int, int]]:
        """The free list, ``(offset, size)`` by offset: one entry when nothing is allocated."""
        with self._lock:
            self._drain()
            return list(self._free)

    # -- the free list (callers hold the lock) ----------------------------------------------------

    def _take(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                return offset
        return None

    def _put(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free, (offset, size))
        if i < len(self._free):  # NOTE: asserts guard the invariant: blocks never overlap
            assert offset + size <= self._free[i][0], f"arena block {offset}+{size} freed twice or overlaps"
        if i:
            assert self._free[i - 1][0] + self._free[i - 1][1] <= offset, f"arena block {offset} freed twice"
        if i < len(self._free) and offset + size == self._free[i][0]:  # merge with the next free range
            size += self._free.pop(i)[1]
        if i and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous one
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            del self._free[i]
        self._free.insert(i, (offset, size))

    def _drain(self) -> None:
        while self._returned:
            offset, size = self._returned.popleft()
            self._put(offset, size)
            self._used -= size
            self.blocks -= 1

    def _release(self, offset: int, size: int) -> None:
        """A block's finalizer: any thread, possibly inside ``array`` on this very thread."""
        self._returned.append((offset, size))
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def __repr__(self) -> str:
        return (f"HostArena({self.nbytes} bytes at 0x{self.addr:x}, {self.blocks} blocks, "
                f"{self.fallbacks} fallbacks)")
