"""The receiver's transfer state machine as a table: every order of the events a decode
worker can see for one transfer ends with its pages handed on exactly once, and never
while a WRITE could still land (after an ACK, only on CANCEL, every WRITE landed, the
sender's death, or the cap after a REVOKE)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from cluster.transfer import inbound as m
from cluster.transfer.inbound import InboundStatus, Terms
from cluster.types import SampledToken

TERMS = Terms(lease_s=30.0, revoke_cap_s=300.0, recompute=True)


@dataclass(frozen=True)
class Wait:
    """Time passes past a deadline: the lease's (or claim's) or the cap's, then a tick."""

    seconds: float


LAPSE, CAP = Wait(TERMS.lease_s + 1), Wait(TERMS.revoke_cap_s + 1)
STEP = 0.001  # between two notices


@dataclass
class Run:
    state: m.Inbound
    now: float
    actions: list[m.Action]
    released_by: int = -1  # the index of the event the pages were released on


def reserved(terms: Terms, now: float) -> m.Inbound:
    """A request whose pages were reserved at `now`, after its wait for them."""
    state, actions = m.on_event(m.waiting(terms), m.Reserved(), now)
    assert actions == () and state.status is InboundStatus.RESERVED
    return state


def run(
    events: list[object], terms: Terms = TERMS, start: float = 0.0, state: m.Inbound | None = None
) -> Run:
    """Feed the events in order, checking at each release that no WRITE could still land;
    from `state`, by default pages reserved at `start`."""
    r = Run(reserved(terms, start) if state is None else state, start, [])
    landed, done, revoked_at = 0, None, None
    for i, e in enumerate(events):
        r.now += e.seconds if isinstance(e, Wait) else STEP
        event = m.Tick() if isinstance(e, Wait) else e
        assert isinstance(event, m.Event)
        r.state, actions = m.on_event(r.state, event, r.now)
        landed += isinstance(event, m.Layers)
        done = event if isinstance(event, m.Done) else done
        for action in actions:
            if isinstance(action, m.Revoke) and revoked_at is None:
                revoked_at = r.now
            if isinstance(action, m.RELEASES):
                r.released_by = i
            if isinstance(action, m.RELEASES) and m.Ack() in r.actions:
                assert (
                    isinstance(event, m.Cancel | m.SenderGone)
                    or (done is not None and landed >= done.num_writes)
                    or (revoked_at is not None and r.now - revoked_at >= terms.revoke_cap_s)
                ), f"released while a WRITE could land: {events}"
        r.actions += actions
    return r


def releases(r: Run) -> list[m.Action]:
    return [a for a in r.actions if isinstance(a, m.RELEASES)]


DONE = m.Done(1, SampledToken(7, -0.5))
EVENTS = [m.Started(), m.Renew(), m.Layers(), DONE, m.Cancel(), LAPSE, CAP, m.Abort()]
LAST = m.SenderGone("the router reports the sender dead")  # what ends any transfer


@pytest.mark.parametrize("recompute", [True, False])
def test_every_order_hands_the_pages_on_once_and_only_when_no_write_can_land(
    recompute: bool,
) -> None:
    terms = Terms(TERMS.lease_s, TERMS.revoke_cap_s, recompute)
    for order in itertools.permutations(EVENTS):
        r = run([*order, LAST], terms)
        assert r.state.status is InboundStatus.RELEASED
        (release,) = releases(r)
        after = r.actions[r.actions.index(release) + 1 :]
        assert set(after) <= {m.Revoke()}, order  # a late STARTED is answered, nothing else
        if m.Abort() in order[: r.released_by + 1]:
            assert release == m.FreePages(), order
        elif isinstance(release, m.StartDecode):
            assert release == m.StartDecode(SampledToken(7, -0.5))
        else:
            assert isinstance(release, m.Recompute if recompute else m.Fail), order


def test_from_the_wait_for_pages_every_order_ends_once_and_an_abort_first_withdraws() -> None:
    """The wait for pages and the transfer are one machine: an abort before the
    reservation withdraws the request (nothing held), after it the transfer's rules hold."""
    events = [m.Reserved(), m.Started(), m.Layers(), DONE, m.Abort(), LAPSE]
    for order in itertools.permutations(events):
        r = run([*order, LAST], state=m.waiting(TERMS))
        assert r.state.status is InboundStatus.RELEASED and not r.state.holding
        (release,) = releases(r)
        if order.index(m.Abort()) < order.index(m.Reserved()):
            assert release == m.Withdraw() and r.released_by == order.index(m.Abort()), order
        elif m.Abort() in order[: r.released_by + 1]:
            assert release == m.FreePages(), order


def test_the_happy_path_acks_the_claim_and_decodes_once_every_write_has_landed() -> None:
    r = run([m.Started(), m.Layers(), m.Layers(), m.Done(3, SampledToken(7, -0.5)), m.Layers()])
    assert r.actions == [m.Ack(), m.StartDecode(SampledToken(7, -0.5))]


def test_the_lease_counts_from_the_claim_and_each_notice_of_progress_renews_it() -> None:
    r = run([Wait(TERMS.lease_s - 1), m.Started()])  # a long queue before the claim: fine
    assert r.state.holding
    for _ in range(5):  # minutes of prefill, each notice within a lease of the last
        r.now += TERMS.lease_s - 1
        r.state, actions = m.on_event(r.state, m.Renew(), r.now)
        r.state, actions = m.on_event(r.state, m.Tick(), r.now)
        assert actions == () and r.state.status is InboundStatus.RECEIVING


def test_pages_nobody_claims_within_the_lease_are_released_and_a_late_claim_is_revoked() -> None:
    r = run([LAPSE])
    (release,) = releases(r)
    assert isinstance(release, m.Recompute) and "claimed" in release.why
    r.state, actions = m.on_event(r.state, m.Started(), r.now)
    assert actions == (m.Revoke(),)  # the sender posts nothing and cancels


def test_a_lease_that_ends_revokes_and_keeps_the_pages_until_the_sender_cancels() -> None:
    r = run([m.Started(), m.Layers(), LAPSE])
    assert r.actions == [m.Ack(), m.Revoke()]
    r.state, actions = m.on_event(r.state, m.Layers(), r.now + 1)  # in flight: it lands
    assert actions == () and r.state.status is InboundStatus.REVOKING
    r.state, actions = m.on_event(r.state, m.Renew(), r.now + 2)  # progress no longer counts
    r.state, actions = m.on_event(r.state, m.Tick(), r.now + TERMS.revoke_cap_s - 1)
    assert actions == ()
    r.state, actions = m.on_event(r.state, m.Cancel(), r.now + TERMS.revoke_cap_s - 1)
    assert len(actions) == 1 and isinstance(actions[0], m.Recompute)
    assert "lease_s=30.0" in actions[0].why


def test_a_revoked_transfer_whose_writes_all_land_still_decodes() -> None:
    r = run([m.Started(), m.Done(1, SampledToken(7, -0.5)), LAPSE, m.Layers()])
    assert r.actions == [m.Ack(), m.Revoke(), m.StartDecode(SampledToken(7, -0.5))]


def test_an_unanswered_revoke_frees_the_pages_only_at_the_cap() -> None:
    r = run([m.Started(), LAPSE, Wait(TERMS.revoke_cap_s - 1)])
    assert r.state.status is InboundStatus.REVOKING
    r = run([m.Started(), LAPSE, CAP], Terms(TERMS.lease_s, TERMS.revoke_cap_s, False))
    (release,) = releases(r)
    assert isinstance(release, m.Fail) and "revoke_cap_s=300.0" in release.why


def test_an_abort_before_the_claim_frees_at_once_after_it_revokes_first() -> None:
    assert releases(run([m.Abort()])) == [m.FreePages()]
    r = run([m.Started(), m.Abort()])
    assert r.actions == [m.Ack(), m.Revoke()]
    r.state, actions = m.on_event(r.state, m.Cancel(), r.now + 1)
    assert actions == (m.FreePages(),)


def test_the_clock_s_origin_does_not_matter() -> None:
    """Only durations count: the same events on a clock that starts anywhere act alike."""
    events = [m.Started(), m.Layers(), LAPSE, m.Layers(), m.Done(2, SampledToken(1, 0.0))]
    for start in (-1e9, 0.0, 1.7e9, 1e12):
        assert run(events, start=start).actions == [
            m.Ack(),
            m.Revoke(),
            m.StartDecode(SampledToken(1, 0.0)),
        ]


def test_a_transfer_not_held_is_released_to_the_protocol_and_a_claim_on_it_is_revoked() -> None:
    # What the decode worker's receiver feeds a notice for a request it no longer holds
    # (or never held): the same RELEASED rule as above, not a rule of its own.
    gone = m.released(TERMS)
    assert m.on_event(gone, m.Started(), 0.0) == (gone, (m.Revoke(),))
    done = m.Done(1, SampledToken(5, 0.0))
    for event in (m.Renew(), m.Layers(), done, m.Cancel(), m.Tick(), m.Abort()):
        assert m.on_event(gone, event, 1e9) == (gone, ())


def test_a_request_waiting_for_pages_has_no_lease_and_its_abort_withdraws_it_at_once() -> None:
    waiting = m.waiting(TERMS)
    assert not waiting.holding and not waiting.aborted
    for event in (
        m.Renew(),
        m.Layers(),
        m.Done(1, SampledToken(5, 0.0)),
        m.Cancel(),
        m.Tick(),
        LAST,
    ):
        assert m.on_event(waiting, event, 1e9) == (waiting, ())  # waits as long as it takes
    assert m.on_event(waiting, m.Started(), 1e9) == (waiting, (m.Revoke(),))  # on no pages
    gone, actions = m.on_event(waiting, m.Abort(), 1e9)
    assert actions == (m.Withdraw(),)
    assert gone.status is InboundStatus.RELEASED and gone.aborted and not gone.holding


def test_the_claim_s_lease_counts_from_the_reservation_not_from_the_wait_for_pages() -> None:
    state = m.waiting(TERMS)
    state, actions = m.on_event(state, m.Tick(), 10 * TERMS.lease_s)  # a long wait: fine
    state, actions = m.on_event(state, m.Reserved(), 10 * TERMS.lease_s)
    state, actions = m.on_event(state, m.Tick(), 11 * TERMS.lease_s - 1)
    assert actions == () and state.status is InboundStatus.RESERVED
    state, actions = m.on_event(state, m.Tick(), 11 * TERMS.lease_s)
    assert len(actions) == 1 and isinstance(actions[0], m.Recompute)


def test_holding_is_true_from_the_reservation_to_the_release_and_an_abort_is_kept() -> None:
    """TRANSFERRING is the machine's: it ends with the one release, aborted or not."""
    state = reserved(TERMS, 0.0)
    seen = []
    for event in (m.Started(), m.Layers(), m.Abort(), m.Layers(), m.Cancel()):
        state, actions = m.on_event(state, event, 1.0)
        seen.append((state.holding, state.aborted, actions))
    assert seen == [
        (True, False, (m.Ack(),)),
        (True, False, ()),
        (True, True, (m.Revoke(),)),  # its last delta is out; the pages wait for the sender
        (True, True, ()),
        (False, True, (m.FreePages(),)),
    ]
    assert m.on_event(state, m.Reserved(), 2.0) == (state, ())  # a reservation only once
