"""PrefixCache on its own: page-granular matching, exact tail boundaries, locks, LRU, sessions."""

from __future__ import annotations

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
