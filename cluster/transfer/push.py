"""The sender's side of one KV transfer (a push), as a pure state machine.

`on_event(push, event, now) -> (push, actions)`: no transport, no engine and no clock of
its own. The prefill worker's sender turns the engine's hooks, the receiver's notices
and its ticks into events, passes its own monotonic time, and applies the actions. The
WRITEs themselves (which pages, whether the device has computed them) stay with it;
here they are counted: planned, in flight.

1. CLAIMING: STARTED went to the receiver when the request was admitted to prefill.
   WRITEs are planned as layers are queued, but none is posted before the ACK.
2. PUSHING: acked. A planned WRITE is posted once its layers are computed, each with
   its LAYERS notice. Progress renews the receiver's lease: a RENEW goes out whenever
   `lease_s / RENEWALS` passed with nothing else sent. Once the first token is known
   and nothing is left to post, DONE carries the token and the WRITE count; the push
   closes when the last WRITE completes.
3. STOPPING: revoked by the receiver, aborted here, a transport error, or no progress
   sent for `lease_s` on this side's clock (a stalled worker): nothing more is posted,
   planned WRITEs are dropped, and CANCEL goes out once no WRITE is in flight, which
   tells the receiver that none can land any more.
4. CLOSED: nothing in flight, nothing more to send.

So every WRITE is posted within `lease_s` of progress this side sent, and never after
a REVOKE: a receiver that frees pages on CANCEL, or on its cap long after revoking,
frees pages no WRITE can reach.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from cluster.types import SampledToken

RENEWALS = 4  # RENEWs per lease_s while nothing else is sent


class PushStatus(enum.Enum):
    CLAIMING = "claiming"
    PUSHING = "pushing"
    STOPPING = "stopping"
    CLOSED = "closed"


class StopCause(enum.Enum):
    ABORT = "aborted here"
    REVOKED = "the receiver revoked the lease"
    LAPSED = "no progress sent for lease_s"
    TRANSPORT = "a transport error"


# --- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Acked:
    """The receiver accepted the claim: WRITEs may be posted."""


@dataclass(frozen=True)
class Revoked:
    """The receiver revoked the lease (it ended there, or the request was aborted there)."""


@dataclass(frozen=True)
class Abort:
    """The request was aborted here, or its prefill failed."""


@dataclass(frozen=True)
class Unreachable:
    """A notice to the receiver could not be sent."""


@dataclass(frozen=True)
class Planned:
    """A WRITE was planned (its layers are queued on the device)."""


@dataclass(frozen=True)
class Ready:
    """The oldest planned WRITE's layers are computed: it may be posted."""


@dataclass(frozen=True)
class WriteDone:
    """A posted WRITE completed (ok) or failed (in flight, or to post)."""

    ok: bool


@dataclass(frozen=True)
class PromptSampled:
    """The prompt is done and its first token sampled."""

    first: SampledToken


@dataclass(frozen=True)
class Tick:
    """Time passed: renew, or stop if this side stalled past the lease."""


Event = Acked | Revoked | Abort | Unreachable | Planned | Ready | WriteDone | PromptSampled | Tick


# --- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Post:
    """Post the oldest planned WRITE with its LAYERS notice."""


@dataclass(frozen=True)
class Drop:
    """Drop every planned WRITE (release its source pages)."""


@dataclass(frozen=True)
class Stop:
    """The push stopped: nothing more will be posted."""

    cause: StopCause


@dataclass(frozen=True)
class SendRenew:
    pass


@dataclass(frozen=True)
class SendDone:
    num_writes: int
    first: SampledToken


@dataclass(frozen=True)
class SendCancel:
    pass


@dataclass(frozen=True)
class Close:
    """Nothing in flight and nothing more to send: forget the push."""


Action = Post | Drop | Stop | SendRenew | SendDone | SendCancel | Close


@dataclass(frozen=True)
class Push:
    lease_s: float  # the receiver's lease, a duration
    status: PushStatus
    progress_at: float  # this side's clock: the last STARTED, RENEW or WRITE sent
    planned: int = 0
    in_flight: int = 0
    num_writes: int = 0  # posted
    first: SampledToken | None = None
    done_sent: bool = False


def start(lease_s: float, now: float) -> Push:
    """STARTED is being sent now."""
    return Push(lease_s, PushStatus.CLAIMING, now)


def on_event(p: Push, e: Event, now: float) -> tuple[Push, tuple[Action, ...]]:
    """The push's next state and what to do; no Post ever follows a Stop."""
    if p.status is PushStatus.CLOSED:
        return p, ()
    stopping = p.status is PushStatus.STOPPING
    match e:
        case Acked() if p.status is PushStatus.CLAIMING:
            p = dataclasses.replace(p, status=PushStatus.PUSHING)
        case Revoked():
            return _stop(p, StopCause.REVOKED)
        case Abort() if not p.done_sent:  # after DONE the push just finishes
            return _stop(p, StopCause.ABORT)
        case Unreachable():
            return _stop(p, StopCause.TRANSPORT)
        case Planned():
            if stopping:
                return p, (Drop(),)
            p = dataclasses.replace(p, planned=p.planned + 1)
        case Ready() if p.status is PushStatus.PUSHING and p.planned:
            if _lapsed(p, now):
                return _stop(p, StopCause.LAPSED)
            p = dataclasses.replace(
                p,
                planned=p.planned - 1,
                in_flight=p.in_flight + 1,
                num_writes=p.num_writes + 1,
                progress_at=now,
            )
            return _then(p, (Post(),))
        case WriteDone(ok):
            p = dataclasses.replace(p, in_flight=p.in_flight - 1)
            if not ok and not stopping:
                return _stop(p, StopCause.TRANSPORT)
        case PromptSampled(first) if not stopping:
            p = dataclasses.replace(p, first=first)
        case Tick() if not stopping:
            if _lapsed(p, now):
                return _stop(p, StopCause.LAPSED)
            if now - p.progress_at >= p.lease_s / RENEWALS:
                return _then(dataclasses.replace(p, progress_at=now), (SendRenew(),))
    return _then(p, ())


def _lapsed(p: Push, now: float) -> bool:
    """This side sent no progress for a whole lease: the receiver may be revoking."""
    return not p.done_sent and now - p.progress_at >= p.lease_s


def _stop(p: Push, cause: StopCause) -> tuple[Push, tuple[Action, ...]]:
    if p.status is PushStatus.STOPPING:
        return p, ()
    dropped: tuple[Action, ...] = (Drop(),) if p.planned else ()
    p = dataclasses.replace(p, status=PushStatus.STOPPING, planned=0)
    return _then(p, (Stop(cause), *dropped))


def _then(p: Push, actions: tuple[Action, ...]) -> tuple[Push, tuple[Action, ...]]:
    """After any change: DONE once all is posted, then CANCEL (stopping) or close once
    nothing is in flight."""
    pushing = p.status is PushStatus.PUSHING
    first = p.first
    if pushing and first is not None and not p.planned and not p.done_sent:
        p = dataclasses.replace(p, done_sent=True)
        actions = (*actions, SendDone(p.num_writes, first))
    if p.in_flight:
        return p, actions
    if p.status is PushStatus.STOPPING:
        return dataclasses.replace(p, status=PushStatus.CLOSED), (*actions, SendCancel(), Close())
    if pushing and p.done_sent:
        return dataclasses.replace(p, status=PushStatus.CLOSED), (*actions, Close())
    return p, actions
