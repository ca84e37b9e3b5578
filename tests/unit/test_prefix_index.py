"""The router's prefix index, fed with the KV events of real page pools (no model).

Whatever it has read, the index must say for every worker what that worker's own pool
would find for a prompt: PagePool.count_prefix over the prompt's reusable pages, then its
KV tier's run after them (TierIndex.count_prefix), as the scheduler looks them up.
"""

from __future__ import annotations

import random

from cluster.engine.sched.page_pool import PagePool
from cluster.engine.sched.sequence import Sequence
from cluster.types import RequestId, SamplingParams
from router.policy import (
    DecodeLoad,
    PolicyConfig,
    PolicyName,
    RouteRequest,
    Snapshot,
    route,
)
from router.prefix_index import TIER_TOKEN_COST, PrefixIndex, credited_tokens, prompt_hashes

PS = 4


class Worker:
    """A page pool under a worker's name and epoch, caching whole prompts."""

    def __init__(
        self, name: str, num_pages: int = 32, capacity: int = 1000, tier_slots: int = 0
    ) -> None:
        self.name, self.epoch = name, f"{name}-1"
        self.pool = PagePool(num_pages, PS, event_capacity=capacity, offload_slots=tier_slots)

    def run(self, prompt: list[int]) -> None:
        """Prefill the prompt (its cached prefix reused) and finish: its pages stay cached."""
        hashes = prompt_hashes(prompt, PS)
        pages = self.pool.match_prefix(hashes)
        fresh = self.pool.allocate(len(hashes) - len(pages))
        assert fresh is not None
        pages += fresh
        for page, h in zip(pages, hashes, strict=True):
            self.pool.register(page, h)
        self.pool.free(pages)
        spills, self.pool.spills = self.pool.spills, []
        self.pool.free([page for page, _ in spills])  # their copies to the tier are done

    def restart(self) -> None:
        self.epoch += "+"
        tier = self.pool.tier
        self.pool = PagePool(self.pool.num_pages, PS, offload_slots=tier.num_slots if tier else 0)

    def read_into(self, index: PrefixIndex) -> None:
        """One poll: what the WorkerRegistry does for this worker."""
        index.apply(self.name, self.pool.kv_events(self.epoch, *index.cursor(self.name)))

    def cached(self, prompt: list[int]) -> tuple[int, int]:
        """Leading pages of the prompt in the pool, then in the tier."""
        hashes = prompt_hashes(prompt, PS)
        pool = self.pool.count_prefix(hashes)
        tier = self.pool.tier.count_prefix(hashes[pool:]) if self.pool.tier else 0
        return pool, tier


def overlaps(index: PrefixIndex, prompt: list[int]) -> dict[str, tuple[int, int]]:
    """Leading pages of the prompt each worker holds (pool, then tier), per the index."""
    groups = index.overlaps(prompt_hashes(prompt, PS))
    return {w: pages for pages, group in groups.items() for w in group}


def expected(workers: list[Worker], prompt: list[int]) -> dict[str, tuple[int, int]]:
    return {w.name: n for w in workers if (n := w.cached(prompt)) != (0, 0)}


SYSTEM = list(range(100, 112))  # 3 pages
A = [*SYSTEM, 1, 2, 3, 4, 5, 6, 7]  # 4 reusable pages (the last token never counts)
B = [*SYSTEM, 9, 9, 9, 9, 9]  # shares 3 pages with A


def test_prompt_hashes_are_the_pages_the_engine_could_reuse() -> None:
    for n in (1, 4, 5, 8, 9, 19):
        prompt = list(range(n))
        seq = Sequence(RequestId("r"), prompt, n, SamplingParams())
        assert prompt_hashes(prompt, PS) == seq.page_hashes((n - 1) // PS, PS)


def test_overlap_is_each_workers_leading_run_of_cached_pages() -> None:
    d1, d2, d3 = Worker("d1"), Worker("d2"), Worker("d3")
    d1.run(A)
    d2.run(B)
    index = PrefixIndex()
    for w in (d1, d2, d3):
        w.read_into(index)
    assert overlaps(index, A) == {"d1": (4, 0), "d2": (3, 0)}
    assert overlaps(index, B) == {"d1": (3, 0), "d2": (4, 0)}
    assert index.overlaps(prompt_hashes([7, *A], PS)) == {}  # same tokens, shifted: no prefix
    assert index.overlaps([]) == {}
    assert len(index) == 5  # the 3 shared pages once, each tail page once


def test_evicted_pages_leave_the_index() -> None:
    d1 = Worker("d1", num_pages=5)
    index = PrefixIndex()
    d1.run(A)
    d1.read_into(index)
    d1.run([50 + t for t in range(9)])  # two pages: the free one, then A's last (freed first)
    d1.read_into(index)
    assert overlaps(index, A) == expected([d1], A) == {"d1": (3, 0)}
    assert index.held("d1") == 5


def test_a_reader_that_fell_behind_resyncs_from_a_snapshot() -> None:
    d1 = Worker("d1", num_pages=8, capacity=4)
    index = PrefixIndex()
    d1.read_into(index)
    for i in range(6):  # 24 pages of traffic: the log keeps 4 events
        d1.run([1000 * i + t for t in range(17)])
    d1.read_into(index)
    prompts = [[1000 * i + t for t in range(17)] for i in range(6)]
    for prompt in prompts:
        assert overlaps(index, prompt) == expected([d1], prompt)
    assert index.held("d1") == d1.pool.num_cached == 8


def test_a_restarted_worker_is_read_from_a_snapshot_of_its_new_cache() -> None:
    d1 = Worker("d1")
    index = PrefixIndex()
    d1.run(A)
    d1.read_into(index)
    d1.restart()
    d1.run(B)
    d1.read_into(index)
    assert overlaps(index, A) == {"d1": (3, 0)}  # the shared system prompt
    assert overlaps(index, B) == {"d1": (4, 0)}
    assert index.cursor("d1") == (d1.epoch, 4)


def test_a_removed_worker_leaves_nothing_and_its_slot_goes_to_the_next() -> None:
    d1, d2 = Worker("d1"), Worker("d2")
    index = PrefixIndex()
    for w in (d1, d2):
        w.run(A)
        w.read_into(index)
    index.remove("d1")
    assert overlaps(index, A) == {"d2": (4, 0)}
    index.remove("d2")
    assert len(index) == 0 and index.cursor("d2") == ("", -1)
    d3 = Worker("d3")
    d3.run(B)
    d3.read_into(index)
    assert overlaps(index, B) == {"d3": (4, 0)}


def test_routers_reading_at_different_moments_agree() -> None:
    """Random traffic on three workers (one restarts midway); one router reads after
    every request, another starts late and reads now and then. Each read, both answer
    every prompt as the pools and their tiers themselves would."""
    rng = random.Random(3)
    workers = [Worker(f"d{i}", num_pages=12, capacity=6, tier_slots=16) for i in range(3)]
    systems = [[rng.randrange(500) for _ in range(8)] for _ in range(4)]
    prompts = [s + [rng.randrange(500) for _ in range(rng.randrange(1, 9))] for s in systems * 3]
    eager, late = PrefixIndex(), PrefixIndex()
    for step in range(300):
        rng.choice(workers).run(rng.choice(prompts))
        if step == 150:
            workers[1].restart()
        readers = [eager] + ([late] if step > 100 and rng.random() < 0.2 else [])
        for index in readers:
            for w in workers:
                w.read_into(index)
            for prompt in prompts:
                assert overlaps(index, prompt) == expected(workers, prompt)


def test_workers_holding_as_much_of_the_prompt_come_as_one_group() -> None:
    workers = [Worker(f"d{i}") for i in range(40)]
    index = PrefixIndex()
    for i, w in enumerate(workers):
        w.run(A if i % 4 else B)
        w.read_into(index)
    groups = index.overlaps(prompt_hashes(A, PS))
    assert groups == {
        (4, 0): frozenset(f"d{i}" for i in range(40) if i % 4),
        (3, 0): frozenset(f"d{i}" for i in range(0, 40, 4)),
    }
    assert index.overlaps(prompt_hashes(A, PS))[(4, 0)] is groups[(4, 0)]  # built once


def test_a_prefix_evicted_to_the_tier_is_counted_after_the_pools_run() -> None:
    d1 = Worker("d1", num_pages=5, tier_slots=16)
    index = PrefixIndex()
    d1.run(A)
    d1.run([50 + t for t in range(9)])  # evicts A's last page, then the free one's
    d1.read_into(index)
    assert overlaps(index, A) == expected([d1], A) == {"d1": (3, 1)}
    d1.run([70 + t for t in range(21)])  # 5 pages: all of A's leave the pool
    d1.read_into(index)
    assert overlaps(index, A) == expected([d1], A) == {"d1": (0, 4)}
    d1.run(B)  # the system prompt's 3 pages are in the pool again, B's own page too
    d1.read_into(index)
    assert overlaps(index, A) == expected([d1], A) == {"d1": (3, 1)}


def test_a_tier_page_is_credited_at_its_cost_between_the_pools_and_none() -> None:
    assert credited_tokens(4, 0, 16) == 64
    assert credited_tokens(0, 4, 16) == int(64 * (1 - TIER_TOKEN_COST))
    assert 0 < credited_tokens(0, 4, 16) < credited_tokens(4, 0, 16)
    assert credited_tokens(2, 2, 16) > credited_tokens(0, 4, 16)


def test_the_router_prefers_the_pool_then_the_tier_then_recompute() -> None:
    """Three idle decode workers, one holding the prompt in its pool, one in its tier,
    one nothing: the pool's holder wins; without it, the tier's holder."""
    pool, tier, none = Worker("pool"), Worker("tier", num_pages=8, tier_slots=16), Worker("none")
    prompt = list(range(1000, 1000 + 8 * PS + 1))
    pool.run(prompt)
    tier.run(prompt)
    tier.run(list(range(3000, 3000 + 8 * PS + 1)))  # evicts the prompt to the tier
    index = PrefixIndex()
    for w in (pool, tier, none):
        w.read_into(index)
    groups = index.overlaps(prompt_hashes(prompt, PS))
    assert groups == {(8, 0): frozenset({"pool"}), (0, 8): frozenset({"tier"})}
    cached = {credited_tokens(p, t, PS): ws for (p, t), ws in groups.items()}

    def decode_for(names: list[str]) -> str:
        loads = tuple(DecodeLoad(n, "e", 32, 32, PS, 0, 0) for n in names)
        request = RouteRequest(len(prompt), 4, None, 0, cached)
        return route(PolicyConfig(PolicyName.CACHE_AWARE), Snapshot(loads, ()), request).decode

    assert decode_for(["none", "tier", "pool"]) == "pool"
    assert decode_for(["none", "tier"]) == "tier"
