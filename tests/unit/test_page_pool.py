"""PagePool: reference-counted pages, the hash chain, and the LRU prefix cache."""

from __future__ import annotations

import pytest

from cluster.engine.sched.page_pool import PagePool, hash_pages
from cluster.types import PageId

PS = 4  # tokens per page in these tests


def cached_pages(pool: PagePool, tokens: list[int]) -> list[PageId]:
    """Allocate pages for `tokens`, register each full page, and free them: a cached prefix."""
    hashes = hash_pages(tokens, PS)
    pages = pool.allocate(len(hashes))
    assert pages is not None
    for page, h in zip(pages, hashes, strict=True):
        pool.register(page, h)
    pool.free(pages)
    return pages


# --- allocation and reference counts ------------------------------------------------------


def test_allocate_hands_out_distinct_pages_and_free_returns_them() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    pages = pool.allocate(3)
    assert pages == [0, 1, 2]
    assert pool.num_free == 1
    pool.free(pages)
    assert pool.num_free == 4


def test_allocate_returns_none_when_too_few_are_free_and_changes_nothing() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) is None
    assert pool.num_free == 2
    assert pool.allocate(2) == [2, 3]
    assert pool.num_free == 0


def test_freeing_a_page_twice_asserts() -> None:
    pool = PagePool(num_pages=2, page_size=PS)
    pages = pool.allocate(1)
    assert pages is not None
    pool.free(pages)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(pages)


def test_only_a_referenced_page_can_be_registered() -> None:
    pool = PagePool(num_pages=2, page_size=PS)
    with pytest.raises(AssertionError):
        pool.register(PageId(0), hash_pages([1, 2, 3, 4], PS)[0])


# --- the hash chain -----------------------------------------------------------------------


def test_same_tokens_give_the_same_hashes() -> None:
    tokens = list(range(12))
    assert hash_pages(tokens, PS) == hash_pages(list(tokens), PS)
    assert len(set(hash_pages(tokens, PS))) == 3


def test_a_different_earlier_page_changes_every_later_hash() -> None:
    a = hash_pages(list(range(12)), PS)
    b = hash_pages([99, *range(1, 12)], PS)  # only token 0 differs
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_a_later_page_does_not_change_earlier_hashes() -> None:
    a = hash_pages(list(range(12)), PS)
    b = hash_pages([*range(11), 99], PS)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_a_partial_trailing_page_is_not_hashed() -> None:
    assert len(hash_pages(list(range(11)), PS)) == 2
    assert hash_pages(list(range(11)), PS) == hash_pages(list(range(8)), PS)
    assert hash_pages([1, 2, 3], PS) == []


def test_the_chain_continues_from_a_parent() -> None:
    tokens = list(range(12))
    whole = hash_pages(tokens, PS)
    assert hash_pages(tokens[4:], PS, parent=whole[0]) == whole[1:]


# --- the prefix cache ---------------------------------------------------------------------


def test_a_freed_full_page_is_reused_by_the_same_prefix() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    tokens = list(range(8))
    pages = cached_pages(pool, tokens)
    assert pool.num_free == 4  # cached pages are free until matched
    assert pool.num_cached == 2

    assert pool.match_prefix(hash_pages(tokens, PS)) == pages
    assert pool.num_free == 2


def test_match_stops_at_the_first_page_not_cached() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    pages = cached_pages(pool, list(range(8)))
    other_second_page = hash_pages([0, 1, 2, 3, 9, 9, 9, 9], PS)
    assert pool.match_prefix(other_second_page) == pages[:1]
    assert pool.match_prefix(hash_pages([9, *range(1, 8)], PS)) == []


def test_shared_pages_stay_referenced_until_every_holder_frees_them() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    tokens = list(range(8))
    hashes = hash_pages(tokens, PS)
    first = pool.allocate(2)
    assert first is not None
    for page, h in zip(first, hashes, strict=True):
        pool.register(page, h)

    second = pool.match_prefix(hashes)
    assert second == first
    pool.free(first)
    assert pool.num_free == 2  # still held by the second holder
    assert sorted(pool.allocate(2) or []) == [2, 3]  # the shared pages are not handed out
    pool.free(second)
    assert pool.num_free == 2
    assert pool.match_prefix(hashes) == first


def test_an_unhashed_free_page_is_handed_out_before_any_cached_page() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    pages = pool.allocate(4)
    assert pages == [0, 1, 2, 3]
    hashes = hash_pages(list(range(8)), PS)
    pool.register(pages[0], hashes[0])
    pool.register(pages[1], hashes[1])
    pool.free(pages)

    assert sorted(pool.allocate(2) or []) == [2, 3]
    assert pool.num_cached == 2
    assert pool.match_prefix(hashes) == [0, 1]


def test_the_least_recently_freed_cached_page_is_evicted_first() -> None:
    pool = PagePool(num_pages=2, page_size=PS)
    a = cached_pages(pool, [1] * PS)
    b = cached_pages(pool, [2] * PS)

    assert pool.allocate(1) == a
    assert pool.match_prefix(hash_pages([1] * PS, PS)) == []
    assert pool.match_prefix(hash_pages([2] * PS, PS)) == b


def test_matching_and_freeing_again_makes_a_page_recent() -> None:
    pool = PagePool(num_pages=2, page_size=PS)
    a = cached_pages(pool, [1] * PS)
    b = cached_pages(pool, [2] * PS)
    pool.free(pool.match_prefix(hash_pages([1] * PS, PS)))  # a is now the most recent

    assert pool.allocate(1) == b
    assert pool.match_prefix(hash_pages([1] * PS, PS)) == a


def test_a_prefix_outlives_its_suffix() -> None:
    pool = PagePool(num_pages=3, page_size=PS)
    tokens = list(range(12))
    pages = cached_pages(pool, tokens)  # freed together: tail first

    assert pool.allocate(1) == pages[2:]
    assert pool.match_prefix(hash_pages(tokens, PS)) == pages[:2]


def test_evicting_a_cached_page_forgets_its_hash() -> None:
    pool = PagePool(num_pages=1, page_size=PS)
    cached_pages(pool, list(range(PS)))
    pages = pool.allocate(1)
    assert pool.num_cached == 0
    assert pages is not None
    pool.free(pages)
    assert pool.match_prefix(hash_pages(list(range(PS)), PS)) == []


def test_a_second_page_with_the_same_tokens_is_not_cached_twice() -> None:
    pool = PagePool(num_pages=3, page_size=PS)
    h = hash_pages([7] * PS, PS)[0]
    pages = pool.allocate(2)
    assert pages is not None
    pool.register(pages[0], h)
    pool.register(pages[1], h)
    assert pool.num_cached == 1
    pool.free(pages)
    assert pool.match_prefix([h]) == pages[:1]


def test_without_prefix_caching_nothing_ever_matches() -> None:
    pool = PagePool(num_pages=4, page_size=PS, prefix_caching=False)
    tokens = list(range(8))
    cached_pages(pool, tokens)
    assert pool.num_cached == 0
    assert pool.match_prefix(hash_pages(tokens, PS)) == []
    assert pool.num_free == 4


def test_prefix_statistics_count_tokens_looked_up_and_found() -> None:
    pool = PagePool(num_pages=4, page_size=PS)
    tokens = list(range(8))
    cached_pages(pool, tokens[:4])
    hashes = hash_pages(tokens, PS)
    found = pool.match_prefix(hashes)
    assert (pool.prefix_queries, pool.prefix_hits) == (0, 0)  # counted on admission only
    pool.count_lookup(len(hashes), len(found))
    assert (pool.prefix_queries, pool.prefix_hits) == (8, 4)
