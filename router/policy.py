"""Routing policy: which decode worker and which prefill worker serve one request.

Pure functions over a snapshot of worker loads: no I/O, no clock, no Ray, so the router,
a replay and the tests drive the same code through one entry point, `route`.

For a request of P prompt tokens and M max tokens, on worker w of either pool:

    cached(w)   = CACHE_AWARE: the larger of the leading prompt tokens w holds per the prefix
                  index (RouteRequest.cached, from the workers' KV events) and, if w is the
                  session's decode worker at the same epoch, the session's cached_tokens.
                  ROUND_ROBIN and LEAST_LOADED: 0 (they ignore caches and sessions)
    uncached(w) = max(P - cached(w), 0)
    pages(w)    = ceil((uncached(w) + M) / page_size(w)); w fits when pages(w) <= free_pages(w)

Decode worker:
    ROUND_ROBIN   decode[turn % n]
    LEAST_LOADED, CACHE_AWARE
                  argmin_w (not fits(w), cost(w), not session(w), -free_pages(w)) with
                  cost(w) = uncached(w) + seq_cost_tokens * (running(w) + waiting(w)):
                  one that can hold the request, then the prompt tokens it would still have
                  to receive or compute plus a price per sequence already on it; so a
                  worker holding C of the prompt wins while it runs fewer than
                  C / seq_cost_tokens more sequences than the idlest (with nothing cached
                  anywhere: the fewest sequences, then the most free pages)
Prefill worker, None (the decode worker prefills) when uncached(decode) <= local_prefill_tokens
or no prefill worker is live; else picked as below, and None again when
0 < RECOMPUTE_WASTE * (cached(decode) - held(p)) >= uncached(decode), held(p) being the
leading prompt tokens the prefix index says p holds: p would recompute tokens the
decode worker already holds (a conversation's last reply, which no prefill worker
computed) amounting to a quarter or more of what is new to the decode worker, so the
decode worker prefills the new part itself (never under ROUND_ROBIN and LEAST_LOADED:
both are 0 there). A long new part still goes to p (recomputing a few held tokens is
cheaper than stalling the decode worker's batch), and a fresh prefill worker holding
nothing is not routed around for the page or two every decode worker holds of every
prompt (the chat template's start);
and None when `prefill_by_cost` and the costs the workers measure make the decode
worker's own prefill cheaper (router/prefill_cost.py: U_d = uncached(decode), U_p =
P - held(p); unmeasured costs prefill remotely):
    ROUND_ROBIN   prefill[turn % m]
    LEAST_LOADED  argmin_p queued_tokens(p)
    CACHE_AWARE   argmin_p (queued_tokens(p) - credit(p), not session(p)), with
                  credit(p) = max(cached(p), affinity_slack_tokens if p is the session's):
                  the prompt compute ahead of the first token, queued(p) + P - cached(p),
                  less P; the session's prefill worker, holding a prefix of unknown length,
                  wins while its queue is at most affinity_slack_tokens longer
Left tied by the keys above, the earlier worker in the snapshot wins.

Route.reason is the decode reason ("round_robin", "least_loaded"; under CACHE_AWARE
"session" for the session's worker, "cached" for one the index says holds part of the
prompt), plus "+local_prefill" when prefill is None ("+local_prefill_cost" when the costs
decided it), or "+prefix" when the prefill worker is credited a prefix (cached or the
session's).

Cost per call: the snapshot orders its workers by load once. Workers holding as much of
the prompt (one group of RouteRequest.cached, or the group holding nothing) differ only
in load, so each group has one contender: the first in load order that fits, found
member by member in a small group and by walking the order in a large one. A call is
O(groups) for the usual few groups, however many workers hold a common prefix.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TypeVar

from cluster.config import ConfigError
from router.prefill_cost import LocalPrefill, RemotePrefill, prefill_remotely

W = TypeVar("W", "DecodeLoad", "PrefillLoad")


class PolicyName(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    CACHE_AWARE = "cache_aware"


class NoWorkerError(Exception):
    """No live decode worker: the caller answers UNAVAILABLE."""


@dataclass(frozen=True)
class DecodeLoad:
    worker: str
    epoch: str  # changes when the worker restarts (and loses its KV)
    free_pages: int
    num_pages: int
    page_size: int
    running: int  # sequences decoding
    waiting: int  # admitted but not yet running (waiting for pages, transferring, queued)
    s_per_token: float | None = None  # what a prompt token adds to its steps; None: unmeasured


@dataclass(frozen=True)
class PrefillLoad:
    worker: str
    epoch: str
    queued_tokens: int  # prompt tokens queued or being prefilled, not yet computed
    s_per_token: float | None = None  # what a prompt token adds to its steps; None: unmeasured
    transfer_s_per_token: float | None = None  # pushing a token's KV; None: nothing pushed yet


@dataclass(frozen=True)
class Snapshot:
    """Loads of the live workers only, in a stable order (ties go to the earlier one)."""

    decode: tuple[DecodeLoad, ...]
    prefill: tuple[PrefillLoad, ...]

    @cached_property
    def _decode_at(self) -> dict[str, tuple[int, DecodeLoad]]:
        return {w.worker: (i, w) for i, w in enumerate(self.decode)}

    @cached_property
    def _prefill_at(self) -> dict[str, tuple[int, PrefillLoad]]:
        return {w.worker: (i, w) for i, w in enumerate(self.prefill)}

    @cached_property
    def _decode_by_load(self) -> tuple[tuple[int, DecodeLoad], ...]:
        """By (sequences, -free pages), then snapshot order: the order of decode cost among
        workers that hold as much of a prompt (for any seq_cost_tokens >= 1)."""
        load = {w.worker: (w.running + w.waiting, -w.free_pages) for w in self.decode}
        return tuple(sorted(enumerate(self.decode), key=lambda e: load[e[1].worker]))

    @cached_property
    def _prefill_by_queue(self) -> tuple[tuple[int, PrefillLoad], ...]:
        """By queued tokens, then snapshot order."""
        return tuple(sorted(enumerate(self.prefill), key=lambda e: e[1].queued_tokens))


@dataclass(frozen=True)
class SessionHint:
    """Where the request's session ran before, as the session store remembers it."""

    decode_worker: str
    decode_epoch: str
    prefill_worker: str | None
    cached_tokens: int  # prompt tokens the decode worker holds for this session


@dataclass(frozen=True)
class RouteRequest:
    num_prompt_tokens: int
    max_tokens: int
    session: SessionHint | None
    turn: int  # a counter the caller increments per request (round robin)
    # The prefix index's answer: leading prompt tokens held -> the workers holding exactly
    # that many (a worker in one group at most; workers holding none in no group).
    cached: Mapping[int, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    decode: str
    prefill: str | None  # None: the decode worker prefills itself
    reason: str  # short, for logs and metrics


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PolicyConfig:
    name: PolicyName = PolicyName.CACHE_AWARE
    local_prefill_tokens: int = 32  # uncached prompt tokens a decode worker prefills itself
    affinity_slack_tokens: int = 2048  # extra queued prefill a session's prefill worker may have
    seq_cost_tokens: int = 64  # uncached prompt tokens one more sequence on a decode worker costs
    prefill_by_cost: bool = False  # True: also local when measured costs say (prefill_cost.py)

    def __post_init__(self) -> None:
        if not isinstance(self.name, PolicyName):
            names = tuple(p.value for p in PolicyName)
            raise ConfigError(f"name: must be one of {names}, got {self.name!r}")
        if not isinstance(self.prefill_by_cost, bool):
            raise ConfigError(
                f"prefill_by_cost: must be true or false, got {self.prefill_by_cost!r}"
            )
        for name, least in (
            ("local_prefill_tokens", 0),
            ("affinity_slack_tokens", 0),
            ("seq_cost_tokens", 1),
        ):
            value = getattr(self, name)
            if not (_is_int(value) and value >= least):
                raise ConfigError(f"{name}: must be an integer >= {least}, got {value!r}")


def route(config: PolicyConfig, snapshot: Snapshot, request: RouteRequest) -> Route:
    """Pick the decode worker, and the prefill worker unless the decode worker prefills itself.

    Raises NoWorkerError when the snapshot has no decode worker.
    """
    if not snapshot.decode:
        raise NoWorkerError("no live decode worker to route the request to")
    if config.name is PolicyName.ROUND_ROBIN:
        decode, reason = snapshot.decode[request.turn % len(snapshot.decode)], "round_robin"
        cached = 0
    else:
        aware = config.name is PolicyName.CACHE_AWARE
        decode, cached, reason = _pick_decode(config, snapshot, request, aware)
    if request.num_prompt_tokens - cached <= config.local_prefill_tokens or not snapshot.prefill:
        return Route(decode.worker, None, f"{reason}+local_prefill")
    if config.name is PolicyName.ROUND_ROBIN:
        prefill, held, credit = snapshot.prefill[request.turn % len(snapshot.prefill)], 0, 0
    else:
        prefill, held, credit = _pick_prefill(config, snapshot, request)
    recompute, new = cached - held, request.num_prompt_tokens - cached
    if recompute > 0 and recompute * RECOMPUTE_WASTE >= new:
        return Route(decode.worker, None, f"{reason}+local_prefill")
    if config.prefill_by_cost:
        prompt = request.num_prompt_tokens
        here = LocalPrefill(prompt - cached, decode.s_per_token, decode.running + decode.waiting)
        there = RemotePrefill(
            prompt - held,
            prefill.queued_tokens,
            prefill.s_per_token,
            prefill.transfer_s_per_token,
            prompt - cached,
        )
        if not prefill_remotely(here, there):
            return Route(decode.worker, None, f"{reason}+local_prefill_cost")
    return Route(decode.worker, prefill.worker, f"{reason}+prefix" if credit else reason)


# A prefill worker may recompute held tokens up to a quarter of the new part (see above).
RECOMPUTE_WASTE = 4

_SMALL_GROUP = 8  # a group this small is priced member by member


def _contenders(
    group: frozenset[str],
    at: Mapping[str, tuple[int, W]],
    order: tuple[tuple[int, W], ...],
    ok: Callable[[W], bool],
) -> list[tuple[int, W]]:
    """Workers of `group` that may be the cheapest of it: all of a small group; of a large
    one, the first in `order` that is `ok` (can take the request), else its first."""
    if len(group) <= _SMALL_GROUP:
        return [at[w] for w in group if w in at]
    first = None
    for e in order:
        if e[1].worker in group:
            if ok(e[1]):
                return [e]
            first = first or e
    return [first] if first else []


def _held(groups: Mapping[int, frozenset[str]], worker: str) -> int:
    return next((tokens for tokens, group in groups.items() if worker in group), 0)


def _pick_decode(
    config: PolicyConfig, snapshot: Snapshot, request: RouteRequest, aware: bool
) -> tuple[DecodeLoad, int, str]:
    """The decode worker, the prompt tokens it holds, and why it was picked."""
    hint = request.session if aware else None
    groups = request.cached if aware else {}
    prompt, need = request.num_prompt_tokens, request.num_prompt_tokens + request.max_tokens
    at, by_load = snapshot._decode_at, snapshot._decode_by_load

    def fits(w: DecodeLoad, held: int) -> bool:
        return -(-(need - min(held, prompt)) // w.page_size) <= w.free_pages

    # worker -> (position, load, cached(w), whether it holds the session)
    contenders: dict[str, tuple[int, DecodeLoad, int, bool]] = {}

    def add(i: int, w: DecodeLoad, held: int) -> None:
        if hint is not None and (w.worker, w.epoch) == (hint.decode_worker, hint.decode_epoch):
            contenders[w.worker] = (i, w, max(held, hint.cached_tokens), True)
        else:
            contenders[w.worker] = (i, w, held, False)

    for tokens, group in groups.items():
        for i, w in _contenders(group, at, by_load, partial(fits, held=tokens)):
            add(i, w, tokens)
    i, w = next((e for e in by_load if fits(e[1], 0)), by_load[0])
    if w.worker not in contenders:  # the best of those holding nothing
        add(i, w, 0)
    if hint is not None and hint.decode_worker in at and hint.decode_worker not in contenders:
        add(*at[hint.decode_worker], _held(groups, hint.decode_worker))

    def key(c: tuple[int, DecodeLoad, int, bool]) -> tuple[bool, int, bool, int, int]:
        i, w, held, session = c
        cost = max(prompt - held, 0) + config.seq_cost_tokens * (w.running + w.waiting)
        return not fits(w, held), cost, not session, -w.free_pages, i

    _, best, held, session = min(contenders.values(), key=key)
    if session:
        return best, held, "session"
    return best, held, "cached" if held else "least_loaded"


def _pick_prefill(
    config: PolicyConfig, snapshot: Snapshot, request: RouteRequest
) -> tuple[PrefillLoad, int, int]:
    """The prefill worker, the prompt tokens the index says it holds, and those it is
    credited with holding."""
    aware = config.name is PolicyName.CACHE_AWARE
    holder = request.session.prefill_worker if aware and request.session else None
    groups = request.cached if aware else {}
    at, by_queue = snapshot._prefill_at, snapshot._prefill_by_queue
    contenders: dict[str, tuple[int, PrefillLoad, int]] = {}
    for tokens, group in groups.items():
        for i, p in _contenders(group, at, by_queue, lambda p: True):
            contenders[p.worker] = (i, p, tokens)
    i, p = by_queue[0]
    contenders.setdefault(p.worker, (i, p, 0))
    if holder in at:
        i, p = at[holder]
        contenders.setdefault(holder, (i, p, _held(groups, holder)))

    def credit(p: PrefillLoad, held: int) -> int:
        return max(held, config.affinity_slack_tokens if p.worker == holder else 0)

    def key(c: tuple[int, PrefillLoad, int]) -> tuple[int, bool, int]:
        i, p, held = c
        return p.queued_tokens - credit(p, held), p.worker != holder, i

    _, best, held = min(contenders.values(), key=key)
    return best, held, credit(best, held)
