"""Scheduler, decode role: pages reserved for a prompt whose KV is computed elsewhere."""

from __future__ import annotations

from cluster.types import FinishReason, RequestStatus
from tests.unit.test_scheduler import (
    PS,
    assert_completed,
    assert_no_leak,
    make_scheduler,
    make_seq,
    run_to_end,
)


def test_reserve_takes_pages_for_the_whole_prompt_and_holds_the_request_outside_the_queue() -> None:
    sched = make_scheduler(num_pages=16)
    seq = make_seq("a", 10)
    assert sched.reserve(seq)
    assert len(seq.pages) == 3 and sched.pool.num_free == 13
    assert seq.status is RequestStatus.TRANSFERRING
    assert not sched.has_work  # nothing to run until the KV lands
    assert sched.schedule().empty


def test_an_activated_request_decodes_from_the_next_step_and_frees_everything() -> None:
    sched = make_scheduler(num_pages=16)
    seq = make_seq("a", 10, max_tokens=3)
    assert sched.reserve(seq)
    seq.token_ids.append(1000)  # the first token, sampled by the prefill worker
    sched.activate(seq)
    assert seq.status is RequestStatus.RUNNING and seq.num_computed == 10
    step = sched.schedule()
    assert step.decodes == [seq] and not step.prefills
    run_to_end(sched)
    assert_completed(seq)
    assert_no_leak(sched)


def test_reserve_refuses_without_enough_pages_and_holds_nothing() -> None:
    sched = make_scheduler(num_pages=2)
    assert not sched.reserve(make_seq("a", 3 * PS))
    assert sched.pool.num_free == 2 and not sched.transferring


def test_reservations_count_toward_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    assert sched.reserve(make_seq("a", 5))
    assert sched.reserve(make_seq("b", 5))
    assert not sched.reserve(make_seq("c", 5))


def test_reserve_reuses_cached_prefix_pages_and_reports_them() -> None:
    sched = make_scheduler(prefix_caching=True)
    first = make_seq("a", list(range(3 * PS + 1)), max_tokens=1)
    sched.add(first)
    run_to_end(sched)
    second = make_seq("b", list(range(3 * PS + 2)))
    assert sched.cached_prefix(second) == 3 * PS
    assert sched.reserve(second)
    assert second.num_computed == 3 * PS  # the writer sends only the page after these
    assert sched.pool.num_free == sched.pool.num_pages - 4  # 3 cached pages shared, 1 fresh


def test_requeue_frees_the_reservation_and_prefills_the_request_locally_first() -> None:
    sched = make_scheduler(num_pages=16)
    other = make_seq("other", 6)
    sched.add(other)
    seq = make_seq("a", 10, max_tokens=2)
    assert sched.reserve(seq)
    sched.requeue(seq)
    assert sched.pool.num_free == 16 and sched.waiting[0] is seq
    run_to_end(sched)
    assert_completed(seq)
    assert_completed(other)
    assert_no_leak(sched)


def test_finishing_a_transferring_request_frees_its_reservation() -> None:
    sched = make_scheduler(num_pages=16)
    seq = make_seq("a", 10)
    assert sched.reserve(seq)
    sched.finish(seq, FinishReason.ABORT)
    assert seq.status is RequestStatus.ABORTED and not sched.transferring
    assert_no_leak(sched)
