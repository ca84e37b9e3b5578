"""KV events: the page pool's log of the hashes it stores and evicts, read by cursor.

A reader that applies each reply in turn must hold exactly the hashes the pool holds,
however far behind it falls (then it gets a snapshot) and whichever epoch it asked with.
"""

from __future__ import annotations

import random

from cluster.engine.sched.page_pool import PagePool, hash_pages
from cluster.protocol import KVEvent, KVEventKind, KVEvents
from cluster.types import BlockHash, PageId
from tests.unit.test_page_pool import PS, cached_pages

STORED, REMOVED = KVEventKind.STORED, KVEventKind.REMOVED


def cache(pool: PagePool, tokens: list[int]) -> list[BlockHash]:
    """`tokens` computed into fresh pages, then freed: cached. Their hashes."""
    cached_pages(pool, tokens)
    return hash_pages(tokens, PS)


def apply(held: set[BlockHash], reply: KVEvents) -> None:
    if reply.snapshot:
        held.clear()
    for event in reply.events:
        if event.kind is STORED:
            held.update(event.hashes)
        else:
            held.difference_update(event.hashes)


def held_by(pool: PagePool) -> set[BlockHash]:
    return set(pool.kv_events("e", "e", -1).events[0].hashes)


def test_stored_hashes_are_numbered_in_order_from_zero() -> None:
    pool = PagePool(8, PS)
    a = cache(pool, list(range(12)))
    reply = pool.kv_events("e", "e", 0)
    assert reply == KVEvents("e", False, (KVEvent(STORED, tuple(a)),), 3)
    assert pool.kv_events("e", "e", 2).events == (KVEvent(STORED, (a[2],)),)
    assert pool.kv_events("e", "e", 3) == KVEvents("e", False, (), 3)
    # A reader of another epoch (or a new one, "") gets the snapshot, from any cursor.
    for reader in ("", "old"):
        snapshot = KVEvents("e", True, (KVEvent(STORED, tuple(a)),), 3)
        assert pool.kv_events("e", reader, 3) == snapshot


def test_eviction_logs_removed_least_recently_freed_first_in_runs() -> None:
    pool = PagePool(4, PS)
    a = cache(pool, list(range(8)))  # 2 pages
    b = cache(pool, [100 + t for t in range(8)])  # 2 more: the pool is all cached
    assert pool.allocate(3) is not None  # evicts a's two pages (freed first), then b's first
    # free() releases tail pages first, so each prefix's last page is the older free page
    assert pool.kv_events("e", "e", 4).events == (KVEvent(REMOVED, (a[1], a[0], b[1])),)
    assert pool.kv_events("e", "e", 0).events == (
        KVEvent(STORED, (*a, *b)),
        KVEvent(REMOVED, (a[1], a[0], b[1])),
    )
    assert held_by(pool) == {b[0]}


def test_a_hash_registered_twice_or_without_prefix_caching_is_no_event() -> None:
    pool = PagePool(8, PS)
    a = cache(pool, list(range(4)))
    pages = pool.allocate(1)
    assert pages is not None
    pool.register(pages[0], a[0])  # another page with the same tokens
    assert pool.kv_events("e", "e", 0).next_seq == 1
    off = PagePool(8, PS, prefix_caching=False)
    cache(off, list(range(8)))
    assert off.kv_events("e", "e", 0) == KVEvents("e", False, (), 0)


def test_a_reader_behind_the_buffer_gets_a_snapshot_of_what_is_held() -> None:
    pool = PagePool(4, PS, event_capacity=3)
    cache(pool, list(range(8)))
    cache(pool, [50 + t for t in range(16)])  # evicts the first two pages: 8 events
    held = held_by(pool)
    assert len(held) == 4
    for after in (-1, 0, 4):  # before the oldest kept event (5)
        reply = pool.kv_events("e", "e", after)
        assert reply.snapshot and reply.next_seq == 8
        assert [e.kind for e in reply.events] == [STORED]
        assert set(reply.events[0].hashes) == held
    assert not pool.kv_events("e", "e", 5).snapshot
    assert pool.kv_events("e", "e", 9).snapshot  # past the newest: another log (a restart)


def test_a_reader_applying_every_reply_holds_what_the_pool_holds() -> None:
    """Random traffic over shared prefixes, read at random moments, sometimes after
    falling past the buffer: after every reply the reader's set equals the pool's."""
    rng = random.Random(7)
    pool = PagePool(16, PS, event_capacity=10)
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(6)]
    held: set[BlockHash] = set()
    cursor, snapshots = -1, 0
    for _ in range(400):
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.choice((0, 4)))]
        hashes = hash_pages(tokens, PS)
        matched = pool.match_prefix(hashes)
        fresh = pool.allocate(len(hashes) - len(matched))
        pages: list[PageId] = matched + (fresh or [])
        for page, h in zip(pages, hashes, strict=False):
            pool.register(page, h)
        pool.free(pages)
        if rng.random() < 0.3:
            reply = pool.kv_events("e", "e", cursor)
            snapshots += reply.snapshot
            apply(held, reply)
            cursor = reply.next_seq
            assert held == held_by(pool)
    assert snapshots > 1  # the buffer did overflow, and the reader recovered each time
