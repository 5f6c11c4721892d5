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
    """Device StateImage slots (max_concurrency + device_state_slots).

    Every resident request holds one (for a hybrid model, its lane's live recurrent state: runner
    slot = lane). The ``device_state_slots`` extra ones hold retained checkpoints; their runner
    slot ids start at ``first_checkpoint`` (the runner's lane count) and only a recurrent model
    hands them out. A dense model keeps no state: its slots are accounting (and /metrics) only.
    """

    def __init__(self, capacity: int, lanes: int | None = None, first_checkpoint: int = 0,
                 checkpoints: bool = False) -> None:
        self.capacity = capacity
        self.used = 0  # resident requests
        extra = capacity - (capacity if lanes is None else lanes)
        self._free = list(range(first_checkpoint + extra - 1, first_checkpoint - 1, -1)) if checkpoints else []
        self.checkpoints = 0  # extra slots holding a checkpoint

    @property
    def has_free_checkpoint(self) -> bool:
        return bool(self._free)

    @property
    def occupied(self) -> int:
        return self.used + self.checkpoints

    def acquire(self) -> None:
        assert self.used + self.checkpoints < self.capacity, "StateImage slots over-allocated"
        self.used += 1

    def release(self) -> None:
        assert self.used > 0, "StateImage slot released twice"
        self.used -= 1

    def alloc_checkpoint(self) -> int | None:
        """A free extra slot's runner id, or None when all hold checkpoints."""
        if not self._free:
            return None
        self.checkpoints += 1
        return self._free.pop()

    def free_checkpoint(self, slot: int) -> None:
        assert slot not in self._free, f"checkpoint slot {slot} freed twice"
        self.checkpoints -= 1
        self._free.append(slot)


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
