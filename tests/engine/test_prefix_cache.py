"""PrefixCache on its own: page-granular matching, exact tail boundaries, locks, LRU, sessions."""

from __future__ import annotations

import pytest

from ninfer.engine.pools import KVPool
from ninfer.engine.prefix_cache import PrefixCache


def retained(cache: PrefixCache, pool: KVPool, tokens, length):
    pages = pool.alloc(-(-length // cache.page_size))
    cache.insert(tokens, pages, length)
    pool.decref(pages)  # the sequence that produced them is gone; the cache keeps them
    return pages


def test_match_walks_full_pages_then_the_best_partial_node():
    pool = KVPool(16)
    cache = PrefixCache(pool, page_size=4)
    a = list(range(1, 11))  # 10 tokens: two full pages and a 2-token tail
    pages = retained(cache, pool, a, 10)
    m = cache.match(a + [99], limit=11)
    assert m.length == 10 and m.pages == tuple(pages)
    m = cache.match(a[:6] + [50], limit=7)  # diverges inside the second page
    assert m.length == 6 and m.pages == tuple(pages[:2])
    assert cache.match([7, 7, 7], limit=3).length == 0
    assert cache.match(a, limit=5).length == 5  # the limit caps the match


def test_reclaim_is_lru_skips_locked_nodes_and_keeps_sessions_longest():
    pool = KVPool(8)
    cache = PrefixCache(pool, page_size=4)
    s = [1, 2, 3, 4]
    x = [5, 6, 7, 8]
    y = [9, 10, 11, 12]
    retained(cache, pool, s, 4)
    retained(cache, pool, x, 4)
    retained(cache, pool, y, 4)
    session_node = cache.insert(s, [cache.match(s, 4).pages[0]], 4)[-1]
    cache.set_session("chain", session_node)
    locked = cache.match(y, 4)
    cache.lock(locked.nodes)
    cache.match(x, 4)  # x is now the most recently used unlocked, unsessioned prefix
    assert pool.free_count == 5
    assert cache.reclaim(1) == 1  # x goes first: s is a session endpoint, y is locked
    assert cache.match(x, 4).length == 0 and cache.match(s, 4).length == 4
    assert cache.reclaim(5) == 1  # then the session endpoint; y stays while locked
    assert cache.match(y, 4).length == 4
    cache.unlock(locked.nodes)
    cache.clear()
    assert pool.free_count == pool.capacity and cache.nodes == 0


def test_checkpoint_match_is_the_deepest_fully_matched_checkpointed_node():
    from ninfer.engine.pools import StateSlots

    pool = KVPool(16)
    slots = StateSlots(6, lanes=2, first_checkpoint=2, checkpoints=True)
    cache = PrefixCache(pool, page_size=4, slots=slots)
    a = list(range(1, 14))  # 13 tokens
    for length in (6, 8, 13):  # a tail node at 6, a full node ending at 8, a tail at 13
        pages = pool.alloc(-(-length // 4))
        path = cache.insert(a, pages, length)
        pool.decref(pages)
        cache.set_checkpoint(path[-1], cache.checkpoint_slot())
    assert cache.match(a, limit=12).length == 12  # KV-only reuse: any prefix
    m = cache.match_checkpoint(a + [0], limit=14)
    assert (m.length, m.state) == (13, 4)
    m = cache.match_checkpoint(a, limit=12)  # 13 is out of reach; 8 is the deepest below
    assert (m.length, m.state, len(m.nodes)) == (8, 3, 2)
    m = cache.match_checkpoint(a[:7] + [0], limit=8)  # diverges at 7: the tail at 6
    assert (m.length, m.state, len(m.nodes)) == (6, 2, 2) and m.pages[1] == m.nodes[1].page
    assert cache.match_checkpoint([9, 9, 9, 9, 9], limit=5).length == 0
    assert slots.occupied == 3
    # Reclaiming the nodes frees their checkpoint slots.
    cache.clear()
    assert slots.occupied == 0 and cache.nodes == 0 and pool.free_count == 16


def test_evicted_checkpoints_spill_to_the_host_budget_lru():
    import numpy as np

    from ninfer.engine.pools import HostBudget, StateSlots

    pool = KVPool(16)
    slots = StateSlots(2, lanes=1, first_checkpoint=1, checkpoints=True)  # one checkpoint slot
    host = HostBudget(2 * 8)  # room for two spilled images of 8 bytes
    cache = PrefixCache(pool, page_size=4, slots=slots, host=host, state_bytes=8)
    device = {}  # slot -> image the "runner" holds
    reads = []

    def read_state(slot):
        reads.append(slot)
        return device[slot].copy()

    prompts = [[k] * 4 for k in range(1, 5)]
    for k, p in enumerate(prompts):
        node = retained_node(cache, pool, p)
        slot = cache.checkpoint_slot(read_state)
        device[slot] = np.full(2, k, np.float32)
        cache.set_checkpoint(node, slot)
    # Slot 1 went 1 -> 2 -> 3 -> 4; 1 then 2 were spilled, then 2 and 3 (1 was the LRU image).
    assert reads == [1, 1, 1] and cache.spills == 3 and cache.spilled == 2 and host.used == 16
    assert cache.match_checkpoint(prompts[0] + [0], 5).length == 0  # dropped: the least recent
    m = cache.match_checkpoint(prompts[1] + [0], 5)
    assert m.state is None and m.length == 4 and m.image.tolist() == [1, 1]
    assert cache.match_checkpoint(prompts[3] + [0], 5).state == 1  # on the device
    # A pause snapshot outranks spilled images: the least recently used goes first.
    cache.free_host(8)
    assert cache.spilled == 1 and host.used == 8
    assert cache.match_checkpoint(prompts[1] + [0], 5).image is not None  # matched last: kept
    # A spilled image gets a device slot back: its Host copy is released.
    node = cache.match_checkpoint(prompts[1] + [0], 5).nodes[-1]
    cache.set_checkpoint(node, cache.checkpoint_slot(read_state))
    assert node.host is None and host.used == 8  # prompts[3]'s image was spilled in its place
    cache.clear()
    assert host.used == 0 and cache.spilled == 0 and slots.occupied == 0 and pool.free_count == 16


def test_a_zero_host_budget_drops_evicted_checkpoints():
    from ninfer.engine.pools import HostBudget, StateSlots

    pool = KVPool(8)
    slots = StateSlots(2, lanes=1, first_checkpoint=1, checkpoints=True)
    cache = PrefixCache(pool, page_size=4, slots=slots, host=HostBudget(0), state_bytes=8)
    for p in ([1] * 4, [2] * 4):
        node = retained_node(cache, pool, p)
        cache.set_checkpoint(node, cache.checkpoint_slot(lambda slot: pytest.fail("no Host room to spill")))
    assert cache.spilled == 0 and cache.match_checkpoint([1] * 4 + [0], 5).length == 0


def retained_node(cache: PrefixCache, pool: KVPool, tokens):
    pages = pool.alloc(-(-len(tokens) // cache.page_size))
    node = cache.insert(tokens, pages, len(tokens))[-1]
    pool.decref(pages)
    return node


def test_a_spill_never_drops_a_more_recently_used_image():
    import numpy as np

    from ninfer.engine.pools import HostBudget, StateSlots

    pool = KVPool(8)
    slots = StateSlots(2, lanes=1, first_checkpoint=1, checkpoints=True)
    host = HostBudget(16)
    cache = PrefixCache(pool, page_size=4, slots=slots, host=host, state_bytes=8)
    read = lambda slot: np.zeros(2, np.float32)  # noqa: E731
    for p in ([1] * 4, [2] * 4):
        cache.set_checkpoint(retained_node(cache, pool, p), cache.checkpoint_slot(read))
    assert cache.spilled == 1 and host.used == 8
    assert cache.match_checkpoint([1] * 4 + [0], 5).image is not None  # [1] is now more recent than [2]
    assert host.try_reserve(8)  # a pause snapshot takes the rest
    cache.set_checkpoint(retained_node(cache, pool, [3] * 4), cache.checkpoint_slot(read))
    # [2] lost its slot but only the more recent [1] could make room: [2] is dropped, [1] kept.
    assert cache.spilled == 1 and cache.match_checkpoint([1] * 4 + [0], 5).image is not None
    assert cache.match_checkpoint([2] * 4 + [0], 5).length == 0
    host.release(8)
    cache.clear()
    assert host.used == 0 and cache.spilled == 0


def test_reclaim_counts_only_pages_nobody_else_holds():
    pool = KVPool(8)
    cache = PrefixCache(pool, page_size=4)
    tokens = [1, 2, 3, 4, 5, 6]
    pages = pool.alloc(2)  # a resident's pages; it produced three nodes and locks none of them
    cache.insert(tokens, pages, 5)  # a full node and a 1-token tail on pages[1]
    cache.insert(tokens, pages, 6)  # a 2-token tail on the same page
    assert (cache.nodes, pool.free_count) == (3, 6)
    # The resident holds both pages, so evicting every node would free none: all-or-none keeps them.
    assert cache.reclaim(1, all_or_none=True) == 0 and cache.nodes == 3
    pool.decref(pages)  # the resident is gone
    # Both tails share pages[1]: one page takes both of them, and the full node stays.
    assert cache.reclaim(1, all_or_none=True) == 1
    assert (cache.nodes, pool.free_count) == (1, 7)
    assert cache.match(tokens, 6).length == 4
    assert cache.reclaim(3, all_or_none=True) == 0 and cache.nodes == 1  # one page is all there is
    assert cache.reclaim(3) == 1 and (cache.nodes, pool.free_count) == (0, 8)  # without it: what it can
