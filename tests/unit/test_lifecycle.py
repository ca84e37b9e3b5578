"""The router's view of one request (router/lifecycle.py): a table of the cases, then
every path through the events the world can send, up to ten deep, against the
invariants: a request is submitted at most 1 + max_migrations times, each time resumed
after exactly the tokens the client has; only a dead worker is marked dead, once; a moved
request routes without its session's hint; it ends DONE or with exactly one Unavailable
or Fail, and then nothing more happens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cluster.types import FinishReason
from router import policy
from router.lifecycle import (
    Action,
    Event,
    Fail,
    Failed,
    Finished,
    Lost,
    MarkDead,
    MovePolicy,
    NoWorker,
    Phase,
    Route,
    Routed,
    Submit,
    Tokens,
    Unavailable,
    View,
    Wait,
    on_event,
)
from router.policy import SessionHint

POLICY = MovePolicy(max_migrations=2, migration_wait_s=30.0)
HINT = SessionHint("d0", "epoch", None, 12)


def routed(decode: str) -> Routed:
    """The policy picked `decode`, with prefill worker p0, at the decode worker's epoch."""
    return Routed(policy.Route(decode, "p0", "test"), f"{decode}-epoch")


def submit(decode: str, resumed: int) -> Submit:
    """What the router runs once `routed(decode)`: exactly those workers, that epoch."""
    return Submit(policy.Route(decode, "p0", "test"), f"{decode}-epoch", resumed)


def run(
    events: list[tuple[Event, float]], policy: MovePolicy = POLICY
) -> tuple[View, list[Action]]:
    view, actions = View(policy, HINT), []
    for event, now in events:
        view, more = on_event(view, event, now)
        actions += more
    return view, actions


def test_a_request_that_finishes_is_submitted_once() -> None:
    view, actions = run([(routed("d0"), 0), (Tokens(3), 1), (Tokens(1), 2), (Finished(), 2)])
    assert view.phase is Phase.DONE and view.delivered == 4
    assert actions == [submit("d0", 0)]


def test_a_new_request_with_no_decode_worker_is_refused_at_once() -> None:
    view, actions = run([(NoWorker("no decode worker"), 0)])
    assert view.phase is Phase.FAILED and actions == [Unavailable("no decode worker")]


def test_a_dead_workers_stream_moves_and_resumes_after_what_the_client_has() -> None:
    view, actions = run(
        [(routed("d0"), 0), (Tokens(5), 1), (Lost("gone", dead=True), 2), (routed("d1"), 2)]
    )
    assert view.phase is Phase.STREAMING and view.moves == 1 and view.decode == "d1"
    assert actions == [submit("d0", 0), MarkDead("d0", "gone"), Route(), submit("d1", 5)]


def test_a_moved_request_forgets_its_sessions_hint_and_a_routed_one_keeps_it() -> None:
    view, _ = run([(routed("d0"), 0), (Tokens(2), 1)])
    assert view.hint == HINT
    view, _ = run([(routed("d0"), 0), (Lost("gone", dead=True), 1)])
    assert view.phase is Phase.MOVING and view.hint is None


def test_an_error_or_abort_from_the_workers_fails_the_request_without_a_move() -> None:
    for reason in (FinishReason.ERROR, FinishReason.ABORT):
        view, actions = run([(routed("d0"), 0), (Tokens(3), 1), (Failed(reason, "why"), 2)])
        assert view.phase is Phase.FAILED and view.moves == 0 and view.delivered == 3
        assert actions == [submit("d0", 0), Fail(reason, "why")]


def test_a_drained_workers_stream_moves_without_marking_it_dead() -> None:
    _, actions = run([(routed("d0"), 0), (Lost("drained", dead=False), 1), (routed("d1"), 1)])
    assert actions == [submit("d0", 0), Route(), submit("d1", 0)]


def test_a_moving_request_waits_for_a_decode_worker_until_migration_wait_s_after_the_loss() -> None:
    lost: list[tuple[Event, float]] = [(routed("d0"), 0.0), (Lost("gone", dead=True), 10.0)]
    view, actions = run([*lost, (NoWorker("none"), 39.9)])
    assert view.phase is Phase.MOVING and actions[-1] == Wait()
    view, actions = run([*lost, (NoWorker("none"), 39.9), (routed("d1"), 39.95)])
    assert view.phase is Phase.STREAMING and actions[-1] == submit("d1", 0)
    view, actions = run([*lost, (NoWorker("none"), 40.0)])
    assert view.phase is Phase.FAILED and actions[-1] == Unavailable(
        "none within migration_wait_s=30"
    )


def test_past_max_migrations_a_lost_stream_is_unavailable() -> None:
    events: list[tuple[Event, float]] = [(routed("d0"), 0)]
    for i in range(1, 3):
        events += [(Lost("gone", dead=True), i), (routed(f"d{i}"), i)]
    view, actions = run([*events, (Lost("gone again", dead=True), 9)])
    assert view.phase is Phase.FAILED
    assert actions[-2:] == [
        MarkDead("d2", "gone again"),
        Unavailable("gone again; the request already moved 2 times (max_migrations=2)"),
    ]
    view, actions = run([(routed("d0"), 0), (Lost("x", dead=False), 1)], MovePolicy(0, 30.0))
    assert view.phase is Phase.FAILED and isinstance(actions[-1], Unavailable)


def test_a_final_view_ignores_whatever_comes_later() -> None:
    done, _ = run([(routed("d0"), 0), (Finished(), 1)])
    failed = Failed(FinishReason.ERROR, "x")
    for event in (routed("d1"), NoWorker("x"), Tokens(1), Finished(), Lost("x", True), failed):
        assert on_event(done, event, 2) == (done, [])


def test_an_event_that_cannot_happen_in_a_phase_is_a_bug() -> None:
    with pytest.raises(AssertionError, match="Tokens cannot happen while routing"):
        on_event(View(POLICY), Tokens(1), 0)


def _possible(view: View, now: float) -> list[tuple[Event, float]]:
    """What the world may report next: routing outcomes, stream outcomes."""
    if view.phase in (Phase.ROUTING, Phase.MOVING):
        late = view.give_up_at if view.phase is Phase.MOVING else now
        return [
            (routed(f"d{view.moves + 1}"), now),
            (NoWorker("none"), now),
            (NoWorker("none"), late),
        ]
    if view.phase is Phase.STREAMING:
        return [
            (Tokens(2), now),
            (Finished(), now),
            (Lost("died", dead=True), now),
            (Lost("drained", dead=False), now),
            (Failed(FinishReason.ABORT, "aborted"), now),
        ]
    return []


Step = tuple[View, Event, View, list[Action]]  # before, event, after, actions


def _paths(depth: int) -> Iterator[list[Step]]:
    def walk(view: View, now: float, path: list[Step]) -> Iterator[list[Step]]:
        options = _possible(view, now)
        if not options or len(path) == depth:
            yield path
            return
        for event, at in options:
            after, actions = on_event(view, event, at)
            yield from walk(after, at + 1.0, [*path, (view, event, after, actions)])

    yield from walk(View(POLICY, HINT), 0.0, [])


def test_every_path_keeps_the_invariants() -> None:
    paths = 0
    for path in _paths(10):
        paths += 1
        actions = [a for *_, acts in path for a in acts]
        assert len([a for a in actions if isinstance(a, Submit)]) <= 1 + POLICY.max_migrations
        for before, event, _, acts in path:
            for a in acts:
                if isinstance(a, Submit):
                    assert isinstance(event, Routed)
                    routed = (event.route, event.epoch, before.delivered)
                    assert (a.route, a.epoch, a.resumed) == routed
                if isinstance(a, MarkDead):
                    assert isinstance(event, Lost) and event.dead and a.worker == before.decode
        if any(before.moves for before, *_ in path):
            assert all(after.hint is None for _, _, after, _ in path if after.moves)
        ends = [a for a in actions if isinstance(a, Unavailable | Fail)]
        final = path[-1][2]
        assert len(ends) == (final.phase is Phase.FAILED)
        if ends:
            assert actions[-1] == ends[0], "nothing after Unavailable"
        if final.phase is Phase.DONE:
            assert isinstance(path[-1][1], Finished)
    assert paths > 3000
