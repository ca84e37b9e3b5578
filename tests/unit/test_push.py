"""The sender's push state machine as a table: in every order of the events a prefill
worker can see for one push, no WRITE is posted before the receiver's ACK or after the
push stopped (REVOKE, abort, transport error, a stall past the lease), CANCEL goes out
only when no WRITE is in flight, DONE counts every WRITE posted, and the push closes
exactly once."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from cluster.transfer import push as m
from cluster.transfer.push import RENEWALS, PushStatus, StopCause
from cluster.types import SampledToken

LEASE_S = 30.0


@dataclass(frozen=True)
class Lapse:
    """This worker stalls (a long step) for longer than the lease, then ticks."""


STEP = 0.001
TOKEN = SampledToken(7, -0.5)
FIRST = m.PromptSampled(TOKEN)


@dataclass
class Run:
    state: m.Push
    now: float
    actions: list[m.Action]


def feedable(p: m.Push, e: object) -> bool:
    """Whether the sender would feed this event now (a real WRITE must be ready or done)."""
    if isinstance(e, m.Ready):
        return p.status is PushStatus.PUSHING and p.planned > 0
    if isinstance(e, m.WriteDone):
        return p.in_flight > 0
    return True


def run(events: list[object], start: float = 0.0) -> Run:
    """Feed the events the sender would feed, checking the push's promises at each step."""
    r = Run(m.start(LEASE_S, start), start, [])
    acked = stopped = False
    posted = completed = 0
    for e in events:
        if not feedable(r.state, e):
            continue
        r.now += LEASE_S + 1 if isinstance(e, Lapse) else STEP
        event = m.Tick() if isinstance(e, Lapse) else e
        assert isinstance(event, m.Event)
        closed = r.state.status is PushStatus.CLOSED
        r.state, actions = m.on_event(r.state, event, r.now)
        assert not (closed and actions), "a closed push acted"
        acked = acked or isinstance(event, m.Acked)
        completed += isinstance(event, m.WriteDone)
        for action in actions:
            if isinstance(action, m.Post):
                assert acked and not stopped, f"a WRITE posted unacked or stopped: {events}"
                posted += 1
            stopped = stopped or isinstance(action, m.Stop)
            if isinstance(action, m.SendCancel):
                assert stopped and posted == completed, f"CANCEL with WRITEs in flight: {events}"
            if isinstance(action, m.SendDone):
                assert action.num_writes == posted and not stopped
        r.actions += actions
    return r


def finish(r: Run) -> Run:
    """What ends any push: its WRITEs complete, then it is aborted."""
    tail: list[object] = [m.WriteDone(True)] * r.state.in_flight + [m.Abort()]
    for e in tail:
        assert isinstance(e, m.Event)
        r.state, actions = m.on_event(r.state, e, r.now)
        r.actions += actions
    return r


TABLES = {
    "revoke_and_abort": [
        m.Acked(),
        m.Revoked(),
        m.Abort(),
        m.Planned(),
        m.Ready(),
        m.WriteDone(True),
        FIRST,
        Lapse(),
    ],
    "transport_errors": [
        m.Acked(),
        m.Unreachable(),
        m.Planned(),
        m.Planned(),
        m.Ready(),
        m.Ready(),
        m.WriteDone(False),
        FIRST,
    ],
}


@pytest.mark.parametrize("table", TABLES)
def test_every_order_posts_only_while_acked_and_unstopped_and_closes_once(table: str) -> None:
    for order in itertools.permutations(TABLES[table]):
        r = finish(run(list(order)))
        assert r.state.status is PushStatus.CLOSED, order
        assert r.actions.count(m.Close()) == 1, order
        assert r.actions.count(m.SendCancel()) <= 1, order
        assert r.state.done_sent or m.SendCancel() in r.actions, order  # the receiver hears an end
        assert r.actions[-1] == m.Close()


def test_the_happy_path_posts_after_the_ack_then_done_then_closes() -> None:
    r = run([m.Planned(), m.Planned(), m.Acked(), m.Ready(), FIRST, m.Ready()])
    assert r.actions == [m.Post(), m.Post(), m.SendDone(2, TOKEN)]
    r = run([m.Planned(), m.Acked(), m.Ready(), FIRST, m.WriteDone(True)])
    assert r.actions[-2:] == [m.SendDone(1, TOKEN), m.Close()]


def test_nothing_is_posted_before_the_ack() -> None:
    r = run([m.Planned(), m.Ready(), FIRST])
    assert r.actions == [] and r.state.status is PushStatus.CLAIMING


def test_a_revoke_drops_planned_writes_and_cancels_once_the_in_flight_ones_complete() -> None:
    r = run([m.Acked(), m.Planned(), m.Planned(), m.Ready(), m.Revoked()])
    assert r.actions == [m.Post(), m.Stop(StopCause.REVOKED), m.Drop()]
    r = run([m.Acked(), m.Planned(), m.Planned(), m.Ready(), m.Revoked(), m.WriteDone(True)])
    assert r.actions[-2:] == [m.SendCancel(), m.Close()]


def test_a_waiting_push_renews_the_lease_and_a_stalled_one_stops() -> None:
    r = Run(m.start(LEASE_S, 0.0), 0.0, [])
    for tick in range(1, 20):  # queued for minutes, ticking every few seconds
        r.state, actions = m.on_event(r.state, m.Tick(), tick * LEASE_S / RENEWALS)
        assert actions == (m.SendRenew(),)
    r = run([m.Acked(), m.Planned(), Lapse()])
    assert r.actions == [m.Stop(StopCause.LAPSED), m.Drop(), m.SendCancel(), m.Close()]


def test_after_done_an_abort_lets_the_push_finish() -> None:
    r = run([m.Acked(), m.Planned(), m.Ready(), FIRST, m.Abort(), m.WriteDone(True)])
    assert r.actions == [m.Post(), m.SendDone(1, TOKEN), m.Close()]
