"""The receiver's side of one KV transfer, as a pure state machine.

`on_event(inbound, event, now) -> (inbound, actions)`: no transport, no engine and no
clock of its own. The decode worker turns its sender's notices, its ticks, aborts and
the router's reports into events, passes its own monotonic time, and applies the
actions. Every duration is counted on this side's clock alone, so no page safety
depends on two hosts' clocks agreeing.

0. WAITING: the request waits its turn for pages (none are free yet); nobody holds a
   KVTarget for it. RESERVED once they are (`Reserved`); an abort now ends it at once
   (`Withdraw`: nothing to free), and a STARTED, which no sender can send yet, is REVOKEd.
1. RESERVED: pages are held for the prompt and nobody may WRITE into them: a sender
   posts no WRITE before its ACK. The sender's STARTED (sent when its worker admits the
   request to prefill) claims them: ACK, and the lease starts. No STARTED within
   `lease_s` of the reservation: the pages are released at once (a late STARTED is
   answered with REVOKE, so no WRITE ever follows).
2. RECEIVING: WRITEs land, each announced by its LAYERS notice. STARTED, RENEW, LAYERS
   and DONE are progress: the lease ends `lease_s` after the latest. DONE brings the
   first token and the WRITE count; once every WRITE has landed the request decodes.
3. REVOKING: the lease ended or the request was aborted: REVOKE went to the sender, and
   the pages stay until no WRITE can land any more: the sender's CANCEL (sent once its
   in-flight WRITEs complete), every announced WRITE landed, the sender's confirmed
   death, or `revoke_cap_s` after the REVOKE with no answer (a hung sender; it stops
   posting on its own `lease_s` after its last progress, long before).
4. RELEASED: the pages were handed on exactly once: to decode (all landed), to a local
   prefill (recompute), or freed (failed, aborted), or none were ever held (withdrawn).
   Later notices change nothing; a STARTED is answered with REVOKE. A transfer the
   receiver no longer holds (or never held: a request that prefills here) is RELEASED too
   (`released`): so a late claim posts nothing.

RESERVED, RECEIVING and REVOKING are the request's TRANSFERRING here (`holding`); an
aborted request (`aborted`) has had its last delta and waits only for its release.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from cluster.types import SampledToken


class InboundStatus(enum.Enum):
    WAITING = "waiting"
    RESERVED = "reserved"
    RECEIVING = "receiving"
    REVOKING = "revoking"
    RELEASED = "released"


@dataclass(frozen=True)
class Terms:
    """The decode worker's transfer policy, the same for each of its requests."""

    lease_s: float  # no progress from the sender this long: revoke
    revoke_cap_s: float  # a REVOKE nobody answers: release the pages this long after it
    recompute: bool  # KV that will not arrive: prefill here (True) or fail the request


# --- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reserved:
    """Pages were reserved for the prompt: the sender has `lease_s` to claim them."""


@dataclass(frozen=True)
class Started:
    """The sender admitted the request to prefill and claims the pages."""


@dataclass(frozen=True)
class Renew:
    """The sender is still at it (queued or prefilling), no WRITE yet since the last."""


@dataclass(frozen=True)
class Layers:
    """A WRITE has landed (its LAYERS notice arrived after its bytes)."""


@dataclass(frozen=True)
class Done:
    """Every WRITE is posted: how many, and the first token the sender sampled."""

    num_writes: int
    first: SampledToken


@dataclass(frozen=True)
class Cancel:
    """The sender stopped and has no WRITE in flight: none can land any more."""


@dataclass(frozen=True)
class Tick:
    """Time passed (the lease and the cap are checked against `now`)."""


@dataclass(frozen=True)
class Abort:
    """The request was aborted here; its pages wait until no WRITE can land."""


@dataclass(frozen=True)
class SenderGone:
    """The sender is confirmed dead or refused the request: no WRITE can land."""

    why: str


Event = Reserved | Started | Renew | Layers | Done | Cancel | Tick | Abort | SenderGone


# --- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ack:
    """Tell the sender the claim holds: it may WRITE now."""


@dataclass(frozen=True)
class Revoke:
    """Tell the sender to post nothing more and CANCEL once nothing is in flight."""


@dataclass(frozen=True)
class StartDecode:
    """All KV landed: the pages go to the running batch with the first token."""

    first: SampledToken


@dataclass(frozen=True)
class Recompute:
    """The KV will not arrive: the pages go back and the prompt prefills here."""

    why: str


@dataclass(frozen=True)
class Fail:
    """The KV will not arrive: free the pages and end the request with an error."""

    why: str


@dataclass(frozen=True)
class FreePages:
    """The request was aborted: free its pages (its end was already published)."""


@dataclass(frozen=True)
class Withdraw:
    """The request was aborted before any pages were reserved: answer its submit with no
    target (its end was already published); there is nothing to free."""


Action = Ack | Revoke | StartDecode | Recompute | Fail | FreePages | Withdraw
RELEASES = (StartDecode, Recompute, Fail, FreePages, Withdraw)  # each ends the transfer, once


@dataclass(frozen=True)
class Inbound:
    terms: Terms
    status: InboundStatus
    deadline: float  # the claim's or lease's end (RESERVED, RECEIVING), the cap's (REVOKING)
    landed: int = 0  # WRITEs landed
    done: Done | None = None
    aborted: bool = False
    why: str = ""  # why it was revoked: reported if the KV does not complete

    @property
    def complete(self) -> bool:
        return self.done is not None and self.landed >= self.done.num_writes

    @property
    def holding(self) -> bool:
        """Pages are held for KV from elsewhere (TRANSFERRING): not yet handed on."""
        return self.status in (
            InboundStatus.RESERVED,
            InboundStatus.RECEIVING,
            InboundStatus.REVOKING,
        )


def waiting(terms: Terms) -> Inbound:
    """A request that will prefill elsewhere, waiting for pages to be reserved for it."""
    return Inbound(terms, InboundStatus.WAITING, 0.0)


def released(terms: Terms) -> Inbound:
    """A transfer this side does not hold (released, or never reserved here): RELEASED to
    the protocol, so a STARTED for it is answered with REVOKE and nothing else matters."""
    return Inbound(terms, InboundStatus.RELEASED, 0.0)


def on_event(s: Inbound, e: Event, now: float) -> tuple[Inbound, tuple[Action, ...]]:
    """The transfer's next state and what to do; RELEASES appear at most once per transfer."""
    if s.status is InboundStatus.WAITING:
        return _on_waiting(s, e, now)
    if s.status is InboundStatus.RELEASED:
        return s, ((Revoke(),) if isinstance(e, Started) else ())
    terms = s.terms
    match e:
        case Started() if s.status is InboundStatus.RESERVED:
            s = dataclasses.replace(s, status=InboundStatus.RECEIVING)
            return _renewed(s, now), (Ack(),)
        case Started() | Renew():
            return _renewed(s, now), ()
        case Layers():
            s = _renewed(dataclasses.replace(s, landed=s.landed + 1), now)
        case Done():
            s = _renewed(dataclasses.replace(s, done=e), now)
        case Cancel():
            return _release(s, "the prefill worker stopped the KV transfer (abort or error)")
        case SenderGone(why):
            return _release(s, why)
        case Abort():
            s = dataclasses.replace(s, aborted=True)
            if s.status is InboundStatus.RECEIVING:
                return _revoke(s, now, "aborted")
            if s.status is InboundStatus.RESERVED:
                return _release(s, "")
        case Tick() if now >= s.deadline:
            if s.status is InboundStatus.RESERVED:
                why = f"no prefill worker claimed the KV transfer within lease_s={terms.lease_s}"
                return _release(s, why)
            if s.status is InboundStatus.RECEIVING:
                why = f"the KV transfer made no progress for lease_s={terms.lease_s}"
                return _revoke(s, now, why)
            why = f"{s.why}; the sender did not answer REVOKE in revoke_cap_s={terms.revoke_cap_s}"
            return _release(dataclasses.replace(s, why=why), why)
    if s.complete and s.status is not InboundStatus.RESERVED:
        return _release(s, "")
    return s, ()


def _on_waiting(s: Inbound, e: Event, now: float) -> tuple[Inbound, tuple[Action, ...]]:
    """No pages yet: only their reservation or an abort matters; a claim is on nothing."""
    match e:
        case Reserved():
            return dataclasses.replace(
                s, status=InboundStatus.RESERVED, deadline=now + s.terms.lease_s
            ), ()
        case Abort():
            return dataclasses.replace(s, status=InboundStatus.RELEASED, aborted=True), (
                Withdraw(),
            )
        case Started():
            return s, (Revoke(),)
    return s, ()


def _renewed(s: Inbound, now: float) -> Inbound:
    """Progress: the lease runs lease_s from now (a claim's or a revoke's deadline stays)."""
    if s.status is not InboundStatus.RECEIVING:
        return s
    return dataclasses.replace(s, deadline=now + s.terms.lease_s)


def _revoke(s: Inbound, now: float, why: str) -> tuple[Inbound, tuple[Action, ...]]:
    deadline = now + s.terms.revoke_cap_s
    return dataclasses.replace(s, status=InboundStatus.REVOKING, deadline=deadline, why=why), (
        Revoke(),
    )


def _release(s: Inbound, why: str) -> tuple[Inbound, tuple[Action, ...]]:
    """No WRITE can land any more: hand the pages on."""
    action: Action
    if s.aborted:
        action = FreePages()
    elif s.complete and s.done is not None:
        action = StartDecode(s.done.first)
    elif s.terms.recompute:
        action = Recompute(s.why or why)  # a revoke's reason is the first cause
    else:
        action = Fail(s.why or why)
    return dataclasses.replace(s, status=InboundStatus.RELEASED), (action,)
