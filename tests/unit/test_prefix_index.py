"""The router's prefix index, fed with the KV events of real page pools (no model).

Whatever it has read, the index must say for every worker what that worker's own pool
would find for a prompt: PagePool.count_prefix over the prompt's reusable pages.
"""

from __future__ import annotations

import random

from cluster.engine.sched.page_pool import PagePool
from cluster.engine.sched.sequence import Sequence
from cluster.types import RequestId, SamplingParams
from router.prefix_index import PrefixIndex, prompt_hashes

PS = 4


class Worker:
    """A page pool under a worker's name and epoch, caching whole prompts."""

    def __init__(self, name: str, num_pages: int = 32, capacity: int = 1000) -> None:
        self.name, self.epoch = name, f"{name}-1"
        self.pool = PagePool(num_pages, PS, event_capacity=capacity)

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

    def restart(self) -> None:
        self.epoch += "+"
        self.pool = PagePool(self.pool.num_pages, PS)

    def read_into(self, index: PrefixIndex) -> None:
        """One poll: what the WorkerRegistry does for this worker."""
        index.apply(self.name, self.pool.kv_events(self.epoch, *index.cursor(self.name)))

    def cached(self, prompt: list[int]) -> int:
        return self.pool.count_prefix(prompt_hashes(prompt, PS))


def overlaps(index: PrefixIndex, prompt: list[int]) -> dict[str, int]:
    """Leading pages of the prompt each worker holds, per the index."""
    groups = index.overlaps(prompt_hashes(prompt, PS))
    return {w: pages for pages, group in groups.items() for w in group}


def expected(workers: list[Worker], prompt: list[int]) -> dict[str, int]:
    return {w.name: n for w in workers if (n := w.cached(prompt))}


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
    assert overlaps(index, A) == {"d1": 4, "d2": 3}
    assert overlaps(index, B) == {"d1": 3, "d2": 4}
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
    assert overlaps(index, A) == expected([d1], A) == {"d1": 3}
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
    assert overlaps(index, A) == {"d1": 3}  # the shared system prompt
    assert overlaps(index, B) == {"d1": 4}
    assert index.cursor("d1") == (d1.epoch, 4)


def test_a_removed_worker_leaves_nothing_and_its_slot_goes_to_the_next() -> None:
    d1, d2 = Worker("d1"), Worker("d2")
    index = PrefixIndex()
    for w in (d1, d2):
        w.run(A)
        w.read_into(index)
    index.remove("d1")
    assert overlaps(index, A) == {"d2": 4}
    index.remove("d2")
    assert len(index) == 0 and index.cursor("d2") == ("", -1)
    d3 = Worker("d3")
    d3.run(B)
    d3.read_into(index)
    assert overlaps(index, B) == {"d3": 4}


def test_routers_reading_at_different_moments_agree() -> None:
    """Random traffic on three workers (one restarts midway); one router reads after
    every request, another starts late and reads now and then. Each read, both answer
    every prompt as the pools themselves would."""
    rng = random.Random(3)
    workers = [Worker(f"d{i}", num_pages=12, capacity=6) for i in range(3)]
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
        4: frozenset(f"d{i}" for i in range(40) if i % 4),
        3: frozenset(f"d{i}" for i in range(0, 40, 4)),
    }
    assert index.overlaps(prompt_hashes(A, PS))[4] is groups[4]  # built once
