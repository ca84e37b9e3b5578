"""One request as the router sees it, as a pure state machine.

`on_event(view, event, now) -> (view, actions)`: no Ray, no workers and no clock of its
own. Router._generate turns what routing and the Dispatcher report into events, passes
time.monotonic(), and applies the actions.

1. ROUTING: the policy picks workers. Routed: Submit the prompt there (the route and the
   decode worker's epoch as routing saw them: the attempt runs on what Submit names).
   STREAMING. No decode worker: Unavailable at once (a new request is not kept waiting).
2. STREAMING: tokens reach the client; Tokens counts them. Finished: DONE.
3. Lost (the decode worker died, or was drained and gave the request up): MOVING. A dead
   worker is marked dead (routing skips it from now on); then Route again, as the prompt
   plus the tokens delivered, without the session's hint (the KV it names is not where the
   request goes on). Routed: Submit with those tokens resumed. STREAMING. No
   decode worker: Wait and route again, until `migration_wait_s` after the loss, then
   Unavailable. A request that already moved `max_migrations` times is Unavailable
   instead of moving.
4. Failed (the workers reported an error, or the request was aborted) while STREAMING:
   FAILED, Fail with the reason; it is not a move.
5. DONE and FAILED are final: any later event changes nothing and asks for nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from cluster.types import FinishReason
from router import policy
from router.policy import SessionHint


class Phase(enum.Enum):
    ROUTING = "routing"
    STREAMING = "streaming"
    MOVING = "moving"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class MovePolicy:
    max_migrations: int  # moves per request; 0: a lost stream fails
    migration_wait_s: float  # how long a moving request waits for a decode worker


@dataclass(frozen=True)
class View:
    policy: MovePolicy
    hint: SessionHint | None = None  # where the session's KV was left (routing reads it)
    phase: Phase = Phase.ROUTING
    decode: str | None = None  # the decode worker streaming it (STREAMING)
    delivered: int = 0  # tokens the client has
    moves: int = 0
    give_up_at: float = 0.0  # MOVING: no decode worker by then, Unavailable


# --- events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Routed:
    route: policy.Route  # the workers the policy picked
    epoch: str  # the decode worker's, in the snapshot it was picked from


@dataclass(frozen=True)
class NoWorker:
    why: str


@dataclass(frozen=True)
class Tokens:
    count: int


@dataclass(frozen=True)
class Finished:
    pass


@dataclass(frozen=True)
class Lost:
    why: str
    dead: bool  # died (False: drained, it let the request go)


@dataclass(frozen=True)
class Failed:
    reason: FinishReason  # ERROR or ABORT
    why: str


Event = Routed | NoWorker | Tokens | Finished | Lost | Failed


# --- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    route: policy.Route
    epoch: str
    resumed: int  # tokens of the request's output the workers get as the prompt's end


@dataclass(frozen=True)
class MarkDead:
    worker: str
    why: str


@dataclass(frozen=True)
class Route:
    pass


@dataclass(frozen=True)
class Wait:
    pass


@dataclass(frozen=True)
class Unavailable:
    why: str


@dataclass(frozen=True)
class Fail:
    reason: FinishReason
    why: str


Action = Submit | MarkDead | Route | Wait | Unavailable | Fail


def on_event(view: View, event: Event, now: float) -> tuple[View, list[Action]]:
    """The view after `event` at `now`, and what the router does about it."""
    phase = view.phase
    if phase in (Phase.DONE, Phase.FAILED):
        return view, []
    if isinstance(event, Routed) and phase in (Phase.ROUTING, Phase.MOVING):
        decode = event.route.decode
        streaming = dataclasses.replace(view, phase=Phase.STREAMING, decode=decode)
        return streaming, [Submit(event.route, event.epoch, view.delivered)]
    if isinstance(event, NoWorker) and phase is Phase.ROUTING:
        return _failed(view, event.why)
    if isinstance(event, NoWorker) and phase is Phase.MOVING:
        if now >= view.give_up_at:
            wait_s = view.policy.migration_wait_s
            return _failed(view, f"{event.why} within migration_wait_s={wait_s:g}")
        return view, [Wait()]
    if isinstance(event, Tokens) and phase is Phase.STREAMING:
        return dataclasses.replace(view, delivered=view.delivered + event.count), []
    if isinstance(event, Finished) and phase is Phase.STREAMING:
        return dataclasses.replace(view, phase=Phase.DONE), []
    if isinstance(event, Failed) and phase is Phase.STREAMING:
        failed = dataclasses.replace(view, phase=Phase.FAILED, decode=None)
        return failed, [Fail(event.reason, event.why)]
    if isinstance(event, Lost) and phase is Phase.STREAMING:
        assert view.decode is not None
        dead: list[Action] = [MarkDead(view.decode, event.why)] if event.dead else []
        if view.moves >= view.policy.max_migrations:
            failed, fail = _failed(
                view,
                f"{event.why}; the request already moved {view.moves} times "
                f"(max_migrations={view.policy.max_migrations})",
            )
            return failed, dead + fail
        moving = dataclasses.replace(
            view,
            phase=Phase.MOVING,
            hint=None,
            decode=None,
            moves=view.moves + 1,
            give_up_at=now + view.policy.migration_wait_s,
        )
        return moving, [*dead, Route()]
    raise AssertionError(f"{type(event).__name__} cannot happen while {phase.value}")


def _failed(view: View, why: str) -> tuple[View, list[Action]]:
    return dataclasses.replace(view, phase=Phase.FAILED, decode=None), [Unavailable(why)]
