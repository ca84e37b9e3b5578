"""The engine's side of the KV-connector seam, on a real Scheduler and PagePool with no
model: each layer of a step reports every request in it with the pages its computed
tokens fill, and pages a sink holds are never handed out again (the request finished or
was preempted meanwhile) until the sink releases them; then every page is free."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import pytest
import torch

from cluster.engine.kv_sink import KVStored, PageHolds, PromptDone, layer_hook
from cluster.engine.sched.page_pool import PagePool
from cluster.engine.sched.scheduler import Scheduler
from cluster.engine.sched.sequence import Sequence
from cluster.types import FinishReason, PageId, RequestId, SamplingParams

PAGE, LAYERS = 4, 2


class Recorder:
    """A sink that records every event and holds the pages of the requests it is told to."""

    def __init__(self, holds: PageHolds, hold: Seq[str] = ()) -> None:
        self.holds = holds
        self.hold = set(hold)
        self.events: list[list[KVStored]] = []
        self.held: list[PageId] = []

    def stored(self, events: Seq[KVStored]) -> None:
        self.events.append(list(events))
        for e in events:
            if e.request_id in self.hold:
                self.holds.hold(e.pages)
                self.held += e.pages

    def prompt_done(self, event: PromptDone) -> None:
        raise AssertionError("the engine reports prompts done, not the layer hook")

    def release(self) -> None:
        self.holds.release(self.held)
        self.held = []


def seq(name: str, n: int) -> Sequence:
    return Sequence(
        RequestId(name), list(range(100 * len(name), 100 * len(name) + n)), n, SamplingParams()
    )


def run_step(sched: Scheduler, sink: Recorder) -> None:
    """One step with no model: every layer reported, then the KV committed."""
    step = sched.schedule()
    hook = layer_hook(step, PAGE, torch.device("cpu"), sink)
    for layer in range(LAYERS):
        hook(layer)
    for s in step.decodes:
        sched.commit(s, 1)
    for s, n in step.prefills:
        sched.commit(s, n)


def test_each_layer_reports_every_request_in_the_step_and_the_pages_its_tokens_fill() -> None:
    pool = PagePool(16, PAGE)
    sink = Recorder(PageHolds(pool))
    sched = Scheduler(pool, 4, 8, chunked_prefill=True)
    a, b = seq("a", 10), seq("bb", 3)
    sched.add(a)
    sched.add(b)
    run_step(sched, sink)  # a's first 8 tokens
    run_step(sched, sink)  # a's last 2, all 3 of b's
    reported = [[(e.request_id, e.layers, e.num_tokens, e.pages) for e in es] for es in sink.events]
    first = [("a", range(i, i + 1), 8, tuple(a.pages[:2])) for i in range(LAYERS)]
    second = [
        [("a", range(i, i + 1), 10, tuple(a.pages)), ("bb", range(i, i + 1), 3, tuple(b.pages))]
        for i in range(LAYERS)
    ]
    assert reported == [[f] for f in first] + second
    assert all(len({id(e.ready) for e in es}) == 1 and es[0].ready.done() for es in sink.events)
    assert {e.num_prompt for es in sink.events for e in es} == {10, 3}


def test_held_pages_outlive_their_request_until_released() -> None:
    pool = PagePool(4, PAGE)
    holds = PageHolds(pool)
    sink = Recorder(holds, hold=["a"])
    sched = Scheduler(pool, 4, 64, chunked_prefill=True)
    a = seq("a", 8)
    sched.add(a)
    run_step(sched, sink)
    pages = list(a.pages)
    sched.finish(a, FinishReason.ABORT)  # a WRITE from them may still be in flight
    assert holds.num_held == 2 * LAYERS and pool.num_free == 2
    others = pool.allocate(pool.num_free) or []
    assert not set(others) & set(pages)
    pool.free(others)
    sink.release()
    assert holds.num_held == 0 and pool.num_free == 4


def test_a_preempted_requests_held_pages_are_not_reused_until_released() -> None:
    pool = PagePool(5, PAGE)
    holds = PageHolds(pool)
    sink = Recorder(holds, hold=["bb"])
    sched = Scheduler(pool, 4, 64, chunked_prefill=True)
    a, b = seq("a", 8), seq("bb", 8)
    sched.add(a)
    sched.add(b)
    run_step(sched, sink)  # both prompts: four of the five pages
    held = list(b.pages)
    a.token_ids.append(1)  # each needs a third page for its next token
    b.token_ids.append(2)
    run_step(sched, sink)  # a takes the last free page; b is preempted while a WRITE reads
    assert sched.num_preemptions == 1 and not b.pages and len(a.pages) == 3
    assert not set(held) & set(a.pages) and pool.num_free == 0
    assert pool.allocate(1) is None  # b's pages are not free, although b let them go
    sink.release()
    assert pool.num_free == 2
    for s in (a, b):
        sched.finish(s, FinishReason.ABORT)
    assert holds.num_held == 0 and pool.num_free == 5


def test_releasing_a_page_not_held_is_refused() -> None:
    pool = PagePool(4, PAGE)
    holds = PageHolds(pool)
    pages = pool.allocate(1) or []
    holds.hold(pages)
    holds.release(pages)
    with pytest.raises(AssertionError, match="released but not held"):
        holds.release(pages)
    assert pool.num_free == 3
