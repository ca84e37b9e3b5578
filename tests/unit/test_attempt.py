"""One attempt of a request in the Dispatcher (router/attempt.py) as a table: each row a
state, an event, the state after it and the actions. Then the sequences the tests of
router/dispatch.py drive through real queues, here as events: the decode worker's
deltas ahead of the first token wait for it, and are lost without it."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.types import FinishReason, RequestId, TokenDelta
from router.attempt import (
    Abort,
    Action,
    Arrived,
    Attempt,
    CallEnded,
    Closed,
    DecodeGone,
    Decoding,
    Deliver,
    Event,
    Got,
    Lose,
    Next,
    Phase,
    PrefillDied,
    Raise,
    Refused,
    SubmitDied,
    Take,
    TransferFailed,
    on_event,
    start,
)

RID = RequestId("r.0")
FIRST = TokenDelta(RID, 0, (7,), "a")  # the prefill worker's first token
AHEAD = TokenDelta(RID, 1, (8,), "b")  # the decode worker's next, ahead of the first
LAST = TokenDelta(RID, 1, (8,), "b", finish_reason=FinishReason.LENGTH)
EVICTED = TokenDelta(RID, 1, (), "", evicted=True, error="drained")
REFUSAL = ValueError("max_tokens: too many")

PREFILLING = start(prefill=True)
STREAMING = start(prefill=False)
HOLDING = dataclasses.replace(PREFILLING, decoding=True, held=(AHEAD,))
DECODING = dataclasses.replace(STREAMING, decoding=True)
LOST = Attempt(Phase.LOST)
ENDED = Attempt(Phase.ENDED)
LOST_FIRST = Lose("the prefill worker lost the first token", dead=False)

ROWS: list[tuple[str, Attempt, Event, Attempt, list[Action]]] = [
    ("nothing held: take from the queue", PREFILLING, Next(0), PREFILLING, [Take()]),
    ("a held delta still ahead waits", HOLDING, Next(0), HOLDING, [Take()]),
    (
        "a held delta goes out once the first token has",
        HOLDING,
        Next(1),
        dataclasses.replace(HOLDING, held=()),
        [Deliver(AHEAD)],
    ),
    (
        "a held last delta ends the attempt",
        dataclasses.replace(HOLDING, held=(LAST,)),
        Next(1),
        dataclasses.replace(HOLDING, phase=Phase.ENDED, held=()),
        [Deliver(LAST)],
    ),
    ("the first token goes out", PREFILLING, Got(FIRST, 0), PREFILLING, [Deliver(FIRST)]),
    (
        "a delta already had goes out (the caller's side skips it)",
        DECODING,
        Got(FIRST, 1),
        DECODING,
        [Deliver(FIRST)],
    ),
    (
        "the last delta ends the attempt",
        DECODING,
        Got(LAST, 1),
        dataclasses.replace(ENDED, decoding=True),
        [Deliver(LAST)],
    ),
    (
        "a decode delta ahead of the first token is held",
        PREFILLING,
        Got(AHEAD, 0),
        dataclasses.replace(PREFILLING, held=(AHEAD,)),
        [Take()],
    ),
    (
        "ahead with no call out: the first token is lost",
        STREAMING,
        Got(AHEAD, 0),
        LOST,
        [LOST_FIRST],
    ),
    (
        "evicted: let go, nothing to abort",
        DECODING,
        Got(EVICTED, 1),
        dataclasses.replace(ENDED, decoding=True),
        [Lose("drained", dead=False)],
    ),
    (
        "evicted without a reason",
        PREFILLING,
        Got(dataclasses.replace(EVICTED, error=None), 0),
        ENDED,
        [Lose("evicted", dead=False)],
    ),
    ("the call ended: stream on", PREFILLING, CallEnded(), STREAMING, [Take()]),
    (
        "the call ended with deltas held: the first token is lost",
        HOLDING,
        CallEnded(),
        dataclasses.replace(HOLDING, phase=Phase.LOST),
        [LOST_FIRST],
    ),
    ("the decode worker is gone", STREAMING, DecodeGone("gone"), LOST, [Lose("gone", True)]),
    (
        "the decode worker is gone while prefilling",
        PREFILLING,
        DecodeGone("gone"),
        LOST,
        [Lose("gone", True)],
    ),
    ("the own submit's worker died", STREAMING, SubmitDied("died"), ENDED, [Lose("died", True)]),
    ("refused through the call", PREFILLING, Refused(REFUSAL), ENDED, [Raise(REFUSAL)]),
    ("refused on the own submit", STREAMING, Refused(REFUSAL), ENDED, [Raise(REFUSAL)]),
    (
        "the first decode delta: the KV is there",
        PREFILLING,
        Arrived(),
        dataclasses.replace(PREFILLING, decoding=True),
        [Decoding()],
    ),
    ("a later decode delta", DECODING, Arrived(), DECODING, []),
    (
        "a decode delta after the last one handed out",
        ENDED,
        Arrived(),
        dataclasses.replace(ENDED, decoding=True),
        [Decoding()],
    ),
    (
        "prefill worker died before the KV",
        PREFILLING,
        PrefillDied(),
        PREFILLING,
        [TransferFailed()],
    ),
    ("... also after its call ended", STREAMING, PrefillDied(), STREAMING, [TransferFailed()]),
    ("... after the KV: nothing to tell", DECODING, PrefillDied(), DECODING, []),
    ("... or after the last delta", ENDED, PrefillDied(), ENDED, [TransferFailed()]),
    ("closed early: abort", PREFILLING, Closed(), Attempt(Phase.CLOSED), [Abort()]),
    (
        "closed streaming: abort",
        DECODING,
        Closed(),
        dataclasses.replace(DECODING, phase=Phase.CLOSED),
        [Abort()],
    ),
    ("closed after a loss: abort", LOST, Closed(), Attempt(Phase.CLOSED), [Abort()]),
    ("closed when ended: nothing to abort", ENDED, Closed(), Attempt(Phase.CLOSED), []),
]


@pytest.mark.parametrize(
    ("before", "event", "after", "actions"), [row[1:] for row in ROWS], ids=[r[0] for r in ROWS]
)
def test_each_row(before: Attempt, event: Event, after: Attempt, actions: list[Action]) -> None:
    assert on_event(before, event) == (after, actions)


IMPOSSIBLE: list[tuple[Attempt, Event]] = [
    (STREAMING, CallEnded()),  # no call is out
    (PREFILLING, SubmitDied("x")),  # the prefill worker submits, not the Dispatcher
    (ENDED, Next(1)),  # the stream stopped reading at its last delta
    (LOST, Arrived()),  # a lost stream is closed before the reader runs again
    (Attempt(Phase.CLOSED), Closed()),
    (Attempt(Phase.CLOSED), PrefillDied()),
]


@pytest.mark.parametrize(("state", "event"), IMPOSSIBLE)
def test_an_event_that_cannot_happen_in_a_phase_is_a_bug(state: Attempt, event: Event) -> None:
    with pytest.raises(AssertionError, match=f"{type(event).__name__} cannot happen while"):
        on_event(state, event)


def run(state: Attempt, events: list[Event]) -> tuple[Attempt, list[Action]]:
    done: list[Action] = []
    for event in events:
        state, actions = on_event(state, event)
        done += actions
    return state, done


def test_decode_deltas_ahead_of_the_first_token_wait_for_it_and_follow_it() -> None:
    """The caller asks again after each delivery: the held delta goes before the queue's
    next item, the end of the prefill worker's call."""
    events: list[Event] = [Next(0), Arrived(), Got(AHEAD, 0), Got(FIRST, 0)]
    state, actions = run(PREFILLING, [*events, Next(1), Next(2), CallEnded(), Got(LAST, 2)])
    assert actions == [
        *[Take(), Decoding(), Take(), Deliver(FIRST)],
        *[Deliver(AHEAD), Take(), Take(), Deliver(LAST)],
    ]
    assert state == Attempt(Phase.ENDED, decoding=True)
    assert on_event(state, Closed()) == (Attempt(Phase.CLOSED, decoding=True), [])


def test_a_prefill_call_that_ends_without_the_first_token_loses_the_attempt() -> None:
    state, actions = run(PREFILLING, [Next(0), Arrived(), Got(AHEAD, 0), CallEnded(), Closed()])
    assert actions == [Take(), Decoding(), Take(), LOST_FIRST, Abort()]
    assert state.phase is Phase.CLOSED
