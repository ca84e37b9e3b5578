"""One attempt of a request in the Dispatcher (one stream from one pair of workers), as a
pure state machine.

`on_event(attempt, event) -> (attempt, actions)`: no Ray, no queue and no clock. The
Dispatcher (router/dispatch.py) turns what its stream's queue, its decode worker's reader
and Ray report into events and applies the actions.

1. An attempt starts PREFILLING when a prefill worker's call is out (it brings the first
   token), else STREAMING (the decode worker was submitted the request itself).
2. Next (the caller wants a delta, having `delivered` tokens): a held delta that no longer
   runs ahead is Delivered; else Take the next item off the queue.
3. Got a delta: evicted (the decode worker let the request go: nothing to abort), ENDED
   and Lose it, the worker not dead. One past the tokens delivered (the decode worker's,
   ahead of the prefill worker's first token) is held while PREFILLING (Take on), and
   means the first token is lost when STREAMING: LOST, Lose it, the worker not dead.
   Any other is Delivered; one with a finish reason ends the attempt: ENDED.
4. CallEnded (the prefill worker's call ended, its first token queued before it):
   STREAMING, and Take on; with deltas still held the first token never came: LOST, Lose
   it, the worker not dead.
5. DecodeGone (the decode worker's reader ended): LOST, Lose it, the worker dead.
   SubmitDied (the decode worker died under the Dispatcher's own submit, so never took
   the request): ENDED, Lose it, the worker dead. Refused (a worker refused the request):
   ENDED, Raise its error.
6. Arrived (the reader has a delta of this attempt for the queue): the first one says the
   attempt's KV is there, Decoding. PrefillDied (Ray says the attempt's prefill worker is
   dead) before that: TransferFailed, the decode worker hears no WRITE can land.
7. Closed (the stream ended: finished, raised, or the caller left): Abort on both workers
   unless ENDED, which has nothing left to abort. CLOSED is final: any event there is a bug.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from cluster.types import TokenDelta


class Phase(enum.Enum):
    PREFILLING = "prefilling"  # the prefill worker's call is out
    STREAMING = "streaming"  # no call is out: deltas come in order
    LOST = "lost"  # lost a worker or the first token: still to be aborted
    ENDED = "ended"  # finished, refused or let go: nothing to abort
    CLOSED = "closed"


@dataclass(frozen=True)
class Attempt:
    phase: Phase
    decoding: bool = False  # the decode worker has sent a delta: the attempt's KV is there
    held: tuple[TokenDelta, ...] = ()  # the decode worker's, ahead of the first token


def start(prefill: bool) -> Attempt:
    """An attempt with a prefill worker's call out (`prefill`), or submitted to decode."""
    return Attempt(Phase.PREFILLING if prefill else Phase.STREAMING)


# --- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Next:
    delivered: int  # tokens the caller has


@dataclass(frozen=True)
class Got:
    delta: TokenDelta
    delivered: int


@dataclass(frozen=True)
class CallEnded:
    pass


@dataclass(frozen=True)
class DecodeGone:
    why: str


@dataclass(frozen=True)
class SubmitDied:
    why: str


@dataclass(frozen=True)
class Refused:
    error: Exception


@dataclass(frozen=True)
class Arrived:
    pass


@dataclass(frozen=True)
class PrefillDied:
    pass


@dataclass(frozen=True)
class Closed:
    pass


Event = Next | Got | CallEnded | DecodeGone | SubmitDied | Refused | Arrived | PrefillDied | Closed


# --- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Take:
    pass


@dataclass(frozen=True)
class Deliver:
    delta: TokenDelta


@dataclass(frozen=True)
class Lose:
    why: str
    dead: bool  # the decode worker died (False: it is alive, the attempt is not)


@dataclass(frozen=True)
class Raise:
    error: Exception


@dataclass(frozen=True)
class Decoding:
    pass


@dataclass(frozen=True)
class TransferFailed:
    pass


@dataclass(frozen=True)
class Abort:
    pass


Action = Take | Deliver | Lose | Raise | Decoding | TransferFailed | Abort

_OPEN = (Phase.PREFILLING, Phase.STREAMING)
_FIRST_LOST = "the prefill worker lost the first token"


def on_event(attempt: Attempt, event: Event) -> tuple[Attempt, list[Action]]:
    """The attempt after `event`, and what the Dispatcher does about it."""
    phase = attempt.phase
    if isinstance(event, Next) and phase in _OPEN:
        held = attempt.held
        if held and held[0].index <= event.delivered:
            return _deliver(dataclasses.replace(attempt, held=held[1:]), held[0])
        return attempt, [Take()]
    if isinstance(event, Got) and phase in _OPEN:
        delta = event.delta
        if delta.evicted:
            return _phase(attempt, Phase.ENDED), [Lose(delta.error or "evicted", dead=False)]
        if delta.index <= event.delivered:
            return _deliver(attempt, delta)
        if phase is Phase.STREAMING:
            return _phase(attempt, Phase.LOST), [Lose(_FIRST_LOST, dead=False)]
        return dataclasses.replace(attempt, held=(*attempt.held, delta)), [Take()]
    if isinstance(event, CallEnded) and phase is Phase.PREFILLING:
        if attempt.held:
            return _phase(attempt, Phase.LOST), [Lose(_FIRST_LOST, dead=False)]
        return _phase(attempt, Phase.STREAMING), [Take()]
    if isinstance(event, DecodeGone) and phase in _OPEN:
        return _phase(attempt, Phase.LOST), [Lose(event.why, dead=True)]
    if isinstance(event, SubmitDied) and phase is Phase.STREAMING:
        return _phase(attempt, Phase.ENDED), [Lose(event.why, dead=True)]
    if isinstance(event, Refused) and phase in _OPEN:
        return _phase(attempt, Phase.ENDED), [Raise(event.error)]
    if isinstance(event, Arrived) and phase in (*_OPEN, Phase.ENDED):
        if attempt.decoding:
            return attempt, []
        return dataclasses.replace(attempt, decoding=True), [Decoding()]
    if isinstance(event, PrefillDied) and phase in (*_OPEN, Phase.ENDED):
        return attempt, [] if attempt.decoding else [TransferFailed()]
    if isinstance(event, Closed) and phase is not Phase.CLOSED:
        return _phase(attempt, Phase.CLOSED), [] if phase is Phase.ENDED else [Abort()]
    raise AssertionError(f"{type(event).__name__} cannot happen while {phase.value}")


def _deliver(attempt: Attempt, delta: TokenDelta) -> tuple[Attempt, list[Action]]:
    """Hand `delta` out; the one with a finish reason is the attempt's last."""
    if delta.finish_reason is not None:
        attempt = _phase(attempt, Phase.ENDED)
    return attempt, [Deliver(delta)]


def _phase(attempt: Attempt, phase: Phase) -> Attempt:
    return dataclasses.replace(attempt, phase=phase)
