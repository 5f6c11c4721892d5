"""Exact-prefix reuse: a trie over token ids whose nodes own KV page ids.

Each node below the root stands for one KV page: a full node holds ``page_size`` tokens, a tail
node (always a leaf) holds fewer — an exact boundary that ends inside a page. A node owns one
reference on its page in :class:`~ninfer.engine.pools.KVPool`; sequences that use or produced a
node lock it, so reclamation (LRU over unlocked leaves) never drops a prefix that frees nothing.

KV at position ``i`` depends only on tokens ``0..i``, so any prefix of a retained path is valid
dense-attention context: a match may end inside a node, and the caller then copies that page
(copy-on-write) before writing past the match.

A recurrent (hybrid) model can resume only where its StateImage was kept: a node may own a
checkpoint (a StateImage slot summarising exactly the tokens up to the node's end), and a
recurrent match returns the deepest fully matched node that has one. Checkpoint slots are
reclaimed least recently used first, and freed with their node.

A checkpoint that loses its slot is *spilled* when the shared Host budget allows: its image moves
to host memory (the node keeps its KV pages on the device, reclaimable as before), a match may
land on it (the caller writes the image into the lane), and spilled images are dropped least
recently used first when the Host budget is needed (a newer spill or a pause snapshot), and with
their node.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Sequence

import attrs
import numpy as np

from ninfer.engine.pools import HostBudget, KVPool, StateSlots


class Node:
    __slots__ = ("tokens", "page", "parent", "children", "locks", "last_use", "sessions", "state", "host")

    def __init__(self, tokens: tuple[int, ...], page: int, parent: "Node | None") -> None:
        self.tokens = tokens
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.locks = 0
        self.last_use = 0
        self.sessions = 0  # session keys whose latest endpoint is this node
        self.state: int | None = None  # StateImage checkpoint slot at this node's end
        self.host: np.ndarray | None = None  # a spilled checkpoint's image (Host memory)


@attrs.frozen
class Match:
    length: int  # reused tokens
    pages: tuple[int, ...]  # pages covering positions 0..length-1
    nodes: tuple[Node, ...]  # to lock while the sequence uses them
    state: int | None = None  # checkpoint slot to copy into the lane (recurrent matches)
    image: np.ndarray | None = None  # or a spilled checkpoint's image to write into the lane


EMPTY_MATCH = Match(0, (), ())


class PrefixCache:
    def __init__(self, pool: KVPool, page_size: int, max_sessions: int = 1024,
                 slots: StateSlots | None = None, host: HostBudget | None = None,
                 state_bytes: int = 0) -> None:
        self.pool = pool
        self.slots = slots  # checkpoint slots (recurrent models); None: KV-only reuse
        self.host = host  # where spilled checkpoints live; None: a checkpoint losing its slot is dropped
        self.state_bytes = state_bytes  # Host bytes of one spilled image
        self._spilled: dict[int, Node] = {}  # id(node) -> node whose image is on the Host
        self._checkpoints: dict[int, Node] = {}  # slot -> node
        self._spare: set[int] = set()  # checkpoints at plain chunk boundaries: given up first
        self.page_size = page_size
        self.root = Node((), -1, None)
        self._clock = itertools.count(1)
        self._sessions: dict[str, Node] = {}
        self._max_sessions = max_sessions
        self.nodes = 0
        self.evictions = 0
        self.checkpoint_evictions = 0
        self.spills = 0

    # -- lookup ---------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int) -> Match:
        """Longest retained prefix of ``tokens[:limit]``."""
        ps = self.page_size
        node, pos, path = self.root, 0, []
        while limit - pos >= ps:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            path.append(child)
            node, pos = child, pos + ps
        best, best_len = None, 0
        rest = tokens[pos : min(limit, pos + ps)]
        for child in node.children.values():
            n = _common(child.tokens, rest)
            if n > best_len:
                best, best_len = child, n
        if best is not None:
            path.append(best)
            pos += best_len
        now = next(self._clock)
        for n in path:
            n.last_use = now
        return Match(pos, tuple(n.page for n in path), tuple(path))

    def match_checkpoint(self, tokens: Sequence[int], limit: int) -> Match:
        """Longest prefix of ``tokens[:limit]`` that ends at a node holding a checkpoint: full
        nodes along the path, or a tail node (an exact boundary inside a page) hanging off it."""
        ps = self.page_size
        node, pos, path = self.root, 0, []
        best: tuple[int, int, Node] | None = None  # (length, path nodes before it, node)
        while True:
            for child in node.children.values():
                n = len(child.tokens)
                if (n < ps and _checkpointed(child) and pos + n <= limit
                        and tuple(tokens[pos : pos + n]) == child.tokens):
                    if best is None or pos + n > best[0]:
                        best = (pos + n, len(path), child)
            if limit - pos < ps:
                break
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            path.append(child)
            node, pos = child, pos + ps
            if _checkpointed(child):
                best = (pos, len(path) - 1, child)
        if best is None:
            return EMPTY_MATCH
        length, depth, end = best
        nodes = tuple(path[:depth]) + (end,)
        now = next(self._clock)
        for n in nodes:
            n.last_use = now
        image = end.host if end.state is None else None
        return Match(length, tuple(n.page for n in nodes), nodes, end.state, image)

    # -- checkpoints ----------------------------------------------------------------------

    def checkpoint_slot(self, read_state: Callable[[int], np.ndarray] | None = None) -> int | None:
        """A StateImage slot for a new checkpoint: a free one, else the least recently used
        checkpoint's (chunk-boundary ones first, then unlocked nodes); None without slots.
        The evicted checkpoint is spilled through ``read_state(slot)`` when the Host budget has
        room for it (after dropping spilled images used less recently than it), else dropped."""
        if self.slots is None:
            return None
        slot = self.slots.alloc_checkpoint()
        if slot is None and self._checkpoints:
            victim = min(self._checkpoints.values(), key=lambda n: (n.state not in self._spare, *_priority(n)))
            slot = victim.state
            victim.state = None
            del self._checkpoints[slot]
            self._spare.discard(slot)
            self.checkpoint_evictions += 1  # the slot passes to the new checkpoint, still occupied
            if read_state is not None:
                self._spill(victim, slot, read_state)
        return slot

    def _spill(self, node: Node, slot: int, read_state: Callable[[int], np.ndarray]) -> None:
        nbytes = self.state_bytes
        if self.host is None or nbytes > self.host.capacity:
            return
        older = sorted((n for n in self._spilled.values() if _priority(n) < _priority(node)), key=_priority)
        if self.host.used - len(older) * nbytes + nbytes > self.host.capacity:
            return  # snapshots or more recent images hold the room: drop nothing for it
        while self.host.used + nbytes > self.host.capacity:
            self._drop_host(older.pop(0))
        if self.host.try_reserve(nbytes):
            node.host = read_state(slot)
            self._spilled[id(node)] = node
            self.spills += 1

    @property
    def spilled(self) -> int:
        return len(self._spilled)

    def free_host(self, nbytes: int) -> None:
        """Drop spilled images, least recently used first, until ``nbytes`` more fit the Host
        budget (a pause snapshot outranks a spilled checkpoint) or none is left."""
        if self.host is None:
            return
        for node in sorted(self._spilled.values(), key=_priority):
            if self.host.used + nbytes <= self.host.capacity:
                return
            self._drop_host(node)

    def _drop_host(self, node: Node) -> None:
        if node.host is not None:
            node.host = None
            del self._spilled[id(node)]
            self.host.release(self.state_bytes)

    def set_checkpoint(self, node: Node, slot: int, spare: bool = False) -> None:
        """``node`` now owns the checkpoint in ``slot``; ``spare``: taken at a plain chunk
        boundary (not one the request named), so it is the first to give its slot up."""
        assert node.state is None and slot not in self._checkpoints
        self._drop_host(node)  # back on the device: its Host copy is redundant
        node.state = slot
        self._checkpoints[slot] = node
        if spare:
            self._spare.add(slot)

    def keep_checkpoint(self, node: Node) -> None:
        """A request named ``node``'s boundary: its checkpoint is no longer a spare one."""
        self._spare.discard(node.state)

    def _drop_checkpoint(self, node: Node) -> None:
        self._drop_host(node)
        if node.state is not None:
            self._spare.discard(node.state)
            del self._checkpoints[node.state]
            self.slots.free_checkpoint(node.state)
            node.state = None

    # -- capture --------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: Sequence[int], length: int) -> list[Node]:
        """Retain ``tokens[:length]`` whose KV lives in ``pages``; return the path (to lock)."""
        ps = self.page_size
        node, path, now = self.root, [], next(self._clock)
        full, rem = divmod(length, ps)
        for i in range(full):
            node = self._child(node, tuple(tokens[i * ps : (i + 1) * ps]), pages[i])
            node.last_use = now
            path.append(node)
        if rem:
            node = self._child(node, tuple(tokens[full * ps : length]), pages[full])
            node.last_use = now
            path.append(node)
        return path

    def _child(self, node: Node, key: tuple[int, ...], page: int) -> Node:
        child = node.children.get(key)
        if child is None:
            child = Node(key, page, node)
            node.children[key] = child
            self.pool.incref([page])
            self.nodes += 1
        return child

    def set_session(self, key: str, node: Node) -> None:
        """Make ``node`` the latest endpoint of session ``key`` (reclaimed after other prefixes)."""
        old = self._sessions.pop(key, None)
        if old is not None:
            old.sessions -= 1
        elif len(self._sessions) >= self._max_sessions:
            oldest = next(iter(self._sessions))
            self._sessions.pop(oldest).sessions -= 1
        self._sessions[key] = node
        node.sessions += 1

    @staticmethod
    def lock(nodes: Sequence[Node]) -> None:
        for n in nodes:
            n.locks += 1

    @staticmethod
    def unlock(nodes: Sequence[Node]) -> None:
        for n in nodes:
            assert n.locks > 0, "prefix node unlocked twice"
            n.locks -= 1

    # -- reclamation ----------------------------------------------------------------------

    def reclaim(self, pages_needed: int, force: bool = False, all_or_none: bool = False) -> int:
        """Evict unlocked leaves, least recently used first (session endpoints last), until
        ``pages_needed`` pages became free or nothing is evictable; return pages freed.

        ``all_or_none``: evict nothing unless ``pages_needed`` pages can be freed (an admission that
        cannot fit anyway keeps the cache; a node whose page a resident or another node shares frees
        nothing). ``force`` (the last resort of a lone resident) evicts locked leaves too, unlocked
        ones first: locks only keep in-use prefixes retained, page references keep them correct, so
        a sequence that still locks an evicted node merely stops pinning it."""
        if pages_needed <= 0:
            return 0
        victims, freed = self._eviction_plan(pages_needed, force)
        if all_or_none and freed < pages_needed:
            return 0
        for node in victims:
            self._evict(node)
        return freed

    def _eviction_plan(self, pages_needed: int, force: bool) -> tuple[list[Node], int]:
        """The nodes ``reclaim`` evicts, in order (leaves before their parents), and the pages that
        frees, counted from the pool's references without changing anything yet."""
        heap = [(_priority(n), id(n), n) for n in self._leaves() if force or n.locks == 0]
        heapq.heapify(heap)
        children_left: dict[int, int] = {}  # id(node) -> children not yet planned for eviction
        refs_left: dict[int, int] = {}  # page -> references left once the planned nodes are gone
        victims, freed = [], 0
        while heap and freed < pages_needed:
            _, _, node = heapq.heappop(heap)
            victims.append(node)
            refs = refs_left.get(node.page, self.pool.refcount(node.page)) - 1
            refs_left[node.page] = refs
            freed += refs == 0
            parent = node.parent
            if parent is not self.root:
                left = children_left.get(id(parent), len(parent.children)) - 1
                children_left[id(parent)] = left
                if left == 0 and (force or parent.locks == 0):
                    heapq.heappush(heap, (_priority(parent), id(parent), parent))
        return victims, freed

    def clear(self) -> None:
        self.reclaim(self.pool.capacity + 1)

    def _evict(self, node: Node) -> int:
        assert not node.children
        del node.parent.children[node.tokens]
        if node.sessions:
            for key in [k for k, v in self._sessions.items() if v is node]:
                del self._sessions[key]
        self._drop_checkpoint(node)
        self.nodes -= 1
        self.evictions += 1
        return self.pool.decref([node.page])

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                yield n


def _priority(node: Node) -> tuple[int, int, int]:
    return (1 if node.locks else 0, 1 if node.sessions else 0, node.last_use)


def _checkpointed(node: Node) -> bool:
    return node.state is not None or node.host is not None


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
