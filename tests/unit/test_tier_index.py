"""The KV tier's index: LRU slots, prefix runs, failed entries, its events, and the pool
and scheduler around it (page references held for copies, RESTORING requests).

The tier's bytes (cluster/engine/kv_tier.py) are tested on the real model in
tests/integration/test_kv_tier.py; here the copies are played by hand.
"""

from __future__ import annotations

from cluster.engine.sched.kv_events import KVEventLog
from cluster.engine.sched.page_pool import PagePool, hash_pages
from cluster.engine.sched.scheduler import Scheduler
from cluster.engine.sched.tier_index import TierIndex
from cluster.protocol import KVEvent, KVEventKind
from cluster.types import BlockHash, FinishReason, RequestStatus
from tests.unit.test_page_pool import PS, cached_pages
from tests.unit.test_scheduler import make_seq, run_step

TIER_STORED, TIER_REMOVED = KVEventKind.TIER_STORED, KVEventKind.TIER_REMOVED


def hashes(n: int, base: int = 0) -> list[BlockHash]:
    return hash_pages(list(range(base, base + n * PS)), PS)


def test_a_full_tier_evicts_the_least_recently_used_entry_into_its_slot() -> None:
    log = KVEventLog(64)
    tier = TierIndex(3, log)
    a, b, c, d = hashes(4)
    slots = [tier.add(h).slot for h in (a, b, c)]
    assert sorted(slots) == [0, 1, 2]
    assert [e.hash for e in tier.take([a])] == [a]  # a is now the most recently used
    e_d = tier.add(d)  # evicts b, the least recently used
    assert b not in tier and {a, c, d} <= set(tier.held)
    assert e_d.slot == slots[1]
    tier.add(b)  # evicts c now
    assert c not in tier
    assert log.read("e", 0, ()).events == (
        KVEvent(TIER_STORED, (a, b, c)),
        KVEvent(TIER_REMOVED, (b,)),
        KVEvent(TIER_STORED, (d,)),
        KVEvent(TIER_REMOVED, (c,)),
        KVEvent(TIER_STORED, (b,)),
    )


def test_a_prefix_hit_is_the_leading_run_held() -> None:
    tier = TierIndex(8, KVEventLog(64))
    chain = hashes(4)
    for h in (chain[0], chain[1], chain[3]):
        tier.add(h)
    assert tier.count_prefix(chain) == 2
    assert [e.hash for e in tier.take(chain)] == chain[:2]
    assert tier.count_prefix(chain[2:]) == 0


def test_a_failed_entry_is_dropped_only_if_still_held_and_its_slot_is_reused() -> None:
    tier = TierIndex(2, KVEventLog(64))
    a, b, c = hashes(3)
    old_a = tier.add(a)
    assert tier.drop(old_a) and a not in tier
    assert not tier.drop(old_a)  # twice: nothing
    new_a = tier.add(a)
    tier.add(b)
    assert not tier.drop(old_a) and a in tier  # a stale entry does not drop the new one
    assert tier.drop(new_a)
    assert tier.add(c).slot == new_a.slot  # the free slot, no eviction
    assert b in tier


def test_the_pool_holds_each_new_cached_page_for_its_copy_out_once() -> None:
    pool = PagePool(8, PS, offload_slots=4)
    assert pool.tier is not None
    tokens = list(range(3 * PS))
    pages = cached_pages(pool, tokens)
    assert [page for page, _ in pool.spills] == pages
    assert [e.hash for _, e in pool.spills] == hash_pages(tokens, PS)
    assert pool.num_free == 8 - 3  # the copies hold them
    spills, pool.spills = pool.spills, []
    pool.free([page for page, _ in spills])  # copies done
    assert pool.num_free == 8
    cached_pages(pool, tokens)  # the same pages again: the tier holds them, no copy
    assert pool.spills == [] and pool.num_free == 8
    snapshot = pool.kv_events("e", "", -1).events
    assert snapshot[1] == KVEvent(TIER_STORED, tuple(hash_pages(tokens, PS)))


def test_a_prefix_in_the_tier_is_restored_before_the_rest_is_prefilled() -> None:
    pool = PagePool(6, PS, prefix_caching=True, offload_slots=8)
    sched = Scheduler(pool, 4, 16, True)
    first = make_seq("a", 3 * PS + 1, max_tokens=1)
    prompt = list(first.token_ids)
    sched.add(first)
    run_step(sched)
    assert not sched.has_work
    spills, pool.spills = pool.spills, []
    pool.free([page for page, _ in spills])
    assert pool.allocate(6) is not None  # evicts every cached page: the tier has 3
    pool.free(list(range(6)))  # type: ignore[arg-type]
    assert pool.num_cached == 0 and pool.tier is not None and len(pool.tier) == 3
    again = make_seq("b", prompt, max_tokens=1)
    sched.add(again)
    step = sched.schedule()
    assert step.empty and again.status is RequestStatus.RESTORING
    (restore,) = step.restores
    assert restore.seq is again and len(restore.pages) == 3
    assert [e.hash for e in restore.entries] == again.page_hashes(3, PS)
    assert pool.tier.hits == 3 * PS and pool.tier.queries == 6 * PS  # the first looked too
    sched.restored(again, 2)  # the third failed its checksum: recomputed
    assert again.status is RequestStatus.PREFILLING and again.num_computed == 2 * PS
    assert again.num_cached == 2 * PS
    step = run_step(sched)
    assert step.prefills == [(again, PS + 1)] and not sched.has_work
    assert pool.num_free == 6


def test_a_request_ended_while_restoring_frees_its_pages_and_is_not_resumed() -> None:
    pool = PagePool(6, PS, offload_slots=8)
    sched = Scheduler(pool, 4, 16, True)
    assert pool.tier is not None
    tokens = list(range(2 * PS + 1))
    for h in hash_pages(tokens, PS):
        pool.tier.add(h)
    seq = make_seq("a", tokens)
    sched.add(seq)
    assert sched.schedule().restores
    sched.finish(seq, FinishReason.ABORT)
    sched.restored(seq, 2)  # the copy finishes after: nothing happens
    assert not sched.has_work and not sched.requests and pool.num_free == 6
