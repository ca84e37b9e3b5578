"""Scheduler: token budget, chunked prefill, admission, preemption, prefix hits and abort.

The engine loop is played by hand: schedule, commit every scheduled chunk, give each
sequence whose last token was computed a made-up next token, finish at max_tokens.
"""

from __future__ import annotations

from cluster.engine.sched.page_pool import PagePool
from cluster.engine.sched.scheduler import Scheduler, Step
from cluster.engine.sched.sequence import Sequence
from cluster.types import FinishReason, RequestId, RequestStatus, SamplingParams

PS = 4  # tokens per page in these tests


def make_scheduler(
    num_pages: int = 64,
    max_num_seqs: int = 8,
    budget: int = 16,
    chunked_prefill: bool = True,
    prefix_caching: bool = False,
) -> Scheduler:
    pool = PagePool(num_pages, PS, prefix_caching)
    return Scheduler(pool, max_num_seqs, budget, chunked_prefill)


def make_seq(name: str, prompt: int | list[int], max_tokens: int = 4) -> Sequence:
    """A request; an int prompt is that many token ids unique to this request."""
    if isinstance(prompt, int):
        base = 10_000 * (1 + sum(map(ord, name)))
        prompt = list(range(base, base + prompt))
    return Sequence(RequestId(name), list(prompt), len(prompt), SamplingParams(max_tokens))


def chunks(step: Step) -> list[tuple[Sequence, int]]:
    return [(seq, 1) for seq in step.decodes] + step.prefills


def sizes(step: Step) -> dict[str, int]:
    return {seq.request_id: n for seq, n in chunks(step)}


def run_step(sched: Scheduler) -> Step:
    """One engine step without a model: the sampled token is 1000 + its output index."""
    step = sched.schedule()
    sampled = [seq for seq, n in chunks(step) if seq.num_computed + n == len(seq.token_ids)]
    for seq, n in chunks(step):
        sched.commit(seq, n)
    for seq in sampled:
        seq.token_ids.append(1000 + len(seq.output_ids))
        if len(seq.output_ids) >= seq.sampling.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
    return step


def run_to_end(sched: Scheduler, max_steps: int = 500) -> list[Step]:
    steps = []
    while sched.has_work:
        steps.append(run_step(sched))
        assert len(steps) < max_steps, "the scheduler made no progress"
    return steps


def assert_no_leak(sched: Scheduler) -> None:
    """Nothing queued, nothing running, and every page back in the pool."""
    assert not sched.waiting and not sched.running
    assert sched.pool.num_free == sched.pool.num_pages


def assert_completed(seq: Sequence) -> None:
    assert seq.status is RequestStatus.FINISHED
    assert seq.finish_reason is FinishReason.LENGTH
    assert seq.pages == []
    assert seq.output_ids == [1000 + i for i in range(seq.sampling.max_tokens)]


# --- budget and chunked prefill -------------------------------------------------------------


def test_no_step_exceeds_the_token_budget_and_every_request_completes() -> None:
    sched = make_scheduler(budget=16)
    seqs = [make_seq(f"r{i}", 10, max_tokens=3) for i in range(5)]
    for seq in seqs:
        sched.add(seq)

    steps = run_to_end(sched)

    assert all(1 <= step.num_tokens <= 16 for step in steps)
    assert steps[0].num_tokens == 16  # a full first step: one whole prompt and a chunk
    for seq in seqs:
        assert_completed(seq)
    assert_no_leak(sched)


def test_a_long_prompt_is_prefilled_in_chunks_while_running_requests_keep_decoding() -> None:
    sched = make_scheduler(budget=16)
    short = make_seq("short", 4, max_tokens=10)
    sched.add(short)
    assert sizes(run_step(sched)) == {"short": 4}
    long = make_seq("long", 40, max_tokens=2)
    sched.add(long)

    step = run_step(sched)
    assert step.decodes == [short] and step.prefills == [(long, 15)]
    assert long.status is RequestStatus.PREFILLING and long.num_computed == 15
    assert len(long.pages) == 4  # pages for the computed chunk only
    step = run_step(sched)
    assert step.decodes == [short] and step.prefills == [(long, 15)]
    step = run_step(sched)
    assert step.decodes == [short] and step.prefills == [(long, 10)]
    assert long.status is RequestStatus.RUNNING and long.output_ids == [1000]
    step = run_step(sched)
    assert step.decodes == [short, long] and step.prefills == []

    run_to_end(sched)
    assert_completed(short)
    assert_completed(long)
    assert_no_leak(sched)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it() -> None:
    sched = make_scheduler(budget=16, chunked_prefill=False)
    running = make_seq("running", 4, max_tokens=3)
    sched.add(running)
    run_step(sched)
    waiting = make_seq("waiting", 16, max_tokens=1)
    sched.add(waiting)

    assert sizes(run_step(sched)) == {"running": 1}  # 15 tokens left: not enough
    assert sizes(run_step(sched)) == {"running": 1}
    assert running.status is RequestStatus.FINISHED
    assert waiting.status is RequestStatus.WAITING and waiting.pages == []
    assert sizes(run_step(sched)) == {"waiting": 16}
    assert_no_leak(sched)


def test_without_chunked_prefill_a_prompt_over_the_whole_budget_runs_alone() -> None:
    sched = make_scheduler(budget=16, chunked_prefill=False)
    big = make_seq("big", 40, max_tokens=2)
    small = make_seq("small", 4, max_tokens=2)
    sched.add(big)
    sched.add(small)

    step = run_step(sched)
    assert sizes(step) == {"big": 40}
    assert step.num_tokens == 40
    assert sizes(run_step(sched)) == {"big": 1, "small": 4}
    run_to_end(sched)
    assert_completed(big)
    assert_completed(small)
    assert_no_leak(sched)


def test_without_chunked_prefill_a_prompt_over_the_budget_waits_for_running_decodes() -> None:
    sched = make_scheduler(budget=16, chunked_prefill=False)
    running = make_seq("running", 4, max_tokens=2)
    sched.add(running)
    run_step(sched)
    big = make_seq("big", 40, max_tokens=1)
    sched.add(big)

    assert sizes(run_step(sched)) == {"running": 1}
    assert sizes(run_step(sched)) == {"big": 40}
    assert_no_leak(sched)


def test_no_more_than_max_num_seqs_run_at_once() -> None:
    sched = make_scheduler(max_num_seqs=2, budget=64)
    seqs = [make_seq(f"r{i}", 4, max_tokens=3) for i in range(4)]
    for seq in seqs:
        sched.add(seq)

    step = run_step(sched)
    assert sizes(step) == {"r0": 4, "r1": 4}
    assert [s.request_id for s in sched.waiting] == ["r2", "r3"]
    steps = [step, *run_to_end(sched)]
    assert all(len(chunks(s)) <= 2 for s in steps)
    for seq in seqs:
        assert_completed(seq)
    assert_no_leak(sched)


# --- pages ----------------------------------------------------------------------------------


def test_a_finished_request_returns_its_pages_at_once() -> None:
    sched = make_scheduler(num_pages=16, budget=64)
    quick = make_seq("quick", 8, max_tokens=1)
    slow = make_seq("slow", 8, max_tokens=5)
    sched.add(quick)
    sched.add(slow)

    run_step(sched)

    assert quick.status is RequestStatus.FINISHED and quick.pages == []
    assert len(slow.pages) == 2
    assert sched.pool.num_free == 16 - 2
    run_to_end(sched)
    assert_no_leak(sched)


def test_pages_grow_one_at_a_time_as_a_request_decodes() -> None:
    sched = make_scheduler(num_pages=16, budget=64)
    seq = make_seq("r", 4, max_tokens=6)
    sched.add(seq)
    page_counts = []
    while sched.has_work:
        run_step(sched)
        page_counts.append(len(seq.pages))
    # after each step: 4, 5, 6, 7, 8, 9 tokens computed -> 1, 2, 2, 2, 2, then finished
    assert page_counts == [1, 2, 2, 2, 2, 0]
    assert_no_leak(sched)


def test_when_pages_run_out_the_newest_request_is_preempted_and_later_recomputed() -> None:
    sched = make_scheduler(num_pages=6, budget=64)  # 6 pages: not enough for both to finish
    old = make_seq("old", 8, max_tokens=12)
    new = make_seq("new", 8, max_tokens=12)
    sched.add(old)
    sched.add(new)

    assert sizes(run_step(sched)) == {"old": 8, "new": 8}
    step = run_step(sched)
    while not step.preempted:
        assert step.decodes == [old, new]
        step = run_step(sched)

    assert step.preempted == [new]
    assert step.decodes == [old]
    assert new.status is RequestStatus.WAITING
    assert new.pages == [] and new.num_computed == 0
    assert sched.waiting[0] is new
    assert sched.running == [old]
    kept = list(new.output_ids)
    assert kept  # tokens sampled before the preemption are kept

    steps = run_to_end(sched)
    recompute = next(s for s in steps if s.prefills and s.prefills[0][0] is new)
    assert recompute.prefills[0][1] == 8 + len(kept)  # the prompt and the kept tokens
    assert new.output_ids[: len(kept)] == kept
    assert_completed(old)
    assert_completed(new)
    assert_no_leak(sched)


def test_under_heavy_page_pressure_every_request_still_completes() -> None:
    sched = make_scheduler(num_pages=8, max_num_seqs=4, budget=32)
    seqs = [make_seq(f"r{i}", 5 + i, max_tokens=20) for i in range(6)]
    for seq in seqs:
        sched.add(seq)

    steps = run_to_end(sched, max_steps=2000)

    assert any(step.preempted for step in steps)
    for seq in seqs:
        assert_completed(seq)
    assert_no_leak(sched)


# --- prefix cache -------------------------------------------------------------------------


def test_a_cached_prefix_is_skipped_at_admission() -> None:
    sched = make_scheduler(budget=64, prefix_caching=True)
    first = make_seq("first", list(range(12)), max_tokens=1)
    sched.add(first)
    run_step(sched)
    shared_pages = sched.pool.match_prefix(first.page_hashes(3, PS))
    sched.pool.free(shared_pages)
    assert len(shared_pages) == 3

    second = make_seq("second", [*range(12), 50, 51, 52], max_tokens=2)
    sched.add(second)
    step = run_step(sched)

    assert step.prefills == [(second, 3)]
    assert second.num_cached == 12
    assert second.pages[:3] == shared_pages
    run_to_end(sched)
    assert second.num_cached == 12
    assert_completed(second)
    assert_no_leak(sched)


def test_the_last_prompt_token_is_computed_even_when_every_full_page_is_cached() -> None:
    sched = make_scheduler(budget=64, prefix_caching=True)
    sched.add(make_seq("first", list(range(13)), max_tokens=4))
    run_to_end(sched)

    again = make_seq("again", list(range(13)), max_tokens=1)
    sched.add(again)
    step = run_step(sched)

    assert step.decodes == [again]  # one token: token 12, on top of 3 cached pages
    assert again.num_cached == 12
    assert again.status is RequestStatus.FINISHED
    assert_no_leak(sched)


def test_a_fully_cached_page_aligned_prompt_still_computes_a_token() -> None:
    sched = make_scheduler(budget=64, prefix_caching=True)
    sched.add(make_seq("first", list(range(12)), max_tokens=4))
    run_to_end(sched)

    again = make_seq("again", list(range(12)), max_tokens=1)
    sched.add(again)
    (n,) = sizes(run_step(sched)).values()

    assert n >= 1
    assert again.num_cached + n == 12
    assert again.output_ids == [1000]
    assert_no_leak(sched)


def test_num_cached_counts_only_what_the_first_admission_found() -> None:
    # 7 pages: "new" is preempted mid-prefill and, on readmission, finds its own pages cached
    sched = make_scheduler(num_pages=7, budget=8, prefix_caching=True)
    old = make_seq("old", 4, max_tokens=5)
    new = make_seq("new", 24, max_tokens=1)
    sched.add(old)
    sched.add(new)
    steps = run_to_end(sched)

    assert [s.request_id for step in steps for s in step.preempted] == ["new"]
    assert new.output_ids == [1000] and new.status is RequestStatus.FINISHED
    assert new.num_cached == 0  # its first admission found nothing cached
    assert_no_leak(sched)


# --- abort ----------------------------------------------------------------------------------


def test_abort_while_waiting_removes_the_request() -> None:
    sched = make_scheduler()
    seq = make_seq("r", 8)
    sched.add(seq)

    sched.finish(seq, FinishReason.ABORT)

    assert seq.status is RequestStatus.ABORTED and seq.finish_reason is FinishReason.ABORT
    assert sched.schedule().empty
    assert_no_leak(sched)


def test_abort_while_prefilling_frees_the_chunk_pages() -> None:
    sched = make_scheduler(budget=8, prefix_caching=True)
    seq = make_seq("r", 20)
    sched.add(seq)
    run_step(sched)
    assert seq.status is RequestStatus.PREFILLING and len(seq.pages) == 2

    sched.finish(seq, FinishReason.ABORT)

    assert seq.status is RequestStatus.ABORTED and seq.pages == []
    assert sched.schedule().empty
    assert_no_leak(sched)


def test_abort_while_running_frees_every_page_and_leaves_others_running() -> None:
    sched = make_scheduler(budget=64)
    seq = make_seq("r", 8, max_tokens=10)
    other = make_seq("other", 8, max_tokens=3)
    sched.add(seq)
    sched.add(other)
    run_step(sched)
    run_step(sched)
    assert seq.status is RequestStatus.RUNNING and len(seq.pages) == 3

    sched.finish(seq, FinishReason.ABORT)

    assert seq.status is RequestStatus.ABORTED and seq.pages == []
    assert sched.running == [other]
    assert sizes(run_step(sched)) == {"other": 1}
    run_to_end(sched)
    assert_completed(other)
    assert_no_leak(sched)


def test_abort_after_preemption_frees_everything() -> None:
    sched = make_scheduler(num_pages=6, budget=64)
    old = make_seq("old", 8, max_tokens=12)
    new = make_seq("new", 8, max_tokens=12)
    sched.add(old)
    sched.add(new)
    while not run_step(sched).preempted:
        pass

    sched.finish(new, FinishReason.ABORT)

    assert new.status is RequestStatus.ABORTED
    assert new not in sched.waiting
    run_to_end(sched)
    assert_completed(old)
    assert_no_leak(sched)
