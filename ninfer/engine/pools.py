"""Resource pools the scheduler reserves from: Main KV pages, Device StateImage slots, Host bytes.

These are indices and counters, never tensors: the runner owns the physical KV pool and the
Engine decides which page ids each sequence and each retained prefix uses.
"""

from __future__ import annotations

from typing import Iterable


class KVPool:
    """Page-granular, reference-counted ids ``0..num_pages-1`` of the runner's KV pool.

    A page is free when no sequence and no retained prefix holds a reference to it.
    """

    def __init__(self, num_pages: int) -> None:
        self.capacity = num_pages
        # Pop from the end: low page ids are handed out first, which keeps tests readable.
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        assert 0 <= n <= len(self._free), f"KV pool over-allocated: want {n}, free {len(self._free)}"
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for page in pages:
            assert self._refs[page] > 0, f"incref of free page {page}"
            self._refs[page] += 1

    def decref(self, pages: Iterable[int]) -> int:
        """Drop one reference from each page; return how many pages became free."""
        freed = 0
        for page in pages:
            assert self._refs[page] > 0, f"decref of free page {page}"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
                freed += 1
        return freed


class StateSlots:
    """Device StateImage slot accounting (max_concurrency + device_state_slots).

    Dense models keep no recurrent state, so a slot is held per resident request only to keep
    the accounting (and /metrics) true; the hybrid backend fills the slots with real state.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def acquire(self) -> None:
        assert self.used < self.capacity, "StateImage slots over-allocated"
        self.used += 1

    def release(self) -> None:
        assert self.used > 0, "StateImage slot released twice"
        self.used -= 1


class HostBudget:
    """The shared Host backing budget in bytes (pause snapshots; 0 disables Host backing)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.peak = 0

    def try_reserve(self, nbytes: int) -> bool:
        if self.used + nbytes > self.capacity:
            return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    def release(self, nbytes: int) -> None:
        assert 0 <= nbytes <= self.used, "Host budget released more than reserved"
        self.used -= nbytes
