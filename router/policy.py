"""Routing policy: which decode worker and which prefill worker serve one request.

Pure functions over a snapshot of worker loads: no I/O, no clock, no Ray, so the router,
a replay and the tests drive the same code through one entry point, `route`.

For a request of P prompt tokens and M max tokens, on decode worker w:

    cached(w)   = the session's cached_tokens if w is its decode worker, same epoch; else 0
                  (ROUND_ROBIN and LEAST_LOADED ignore sessions: always 0)
    uncached(w) = max(P - cached(w), 0)
    pages(w)    = ceil((uncached(w) + M) / page_size(w))

Decode worker:
    ROUND_ROBIN   decode[turn % n]
    LEAST_LOADED  argmin_w (pages(w) > free_pages(w), running(w) + waiting(w), -free_pages(w)):
                  one that can hold the request, then the fewest sequences, then the most free pages
    CACHE_AWARE   the session's worker if live, same epoch and pages(w) <= free_pages(w);
                  else LEAST_LOADED
Prefill worker, None (the decode worker prefills) when uncached(decode) <= local_prefill_tokens
or no prefill worker is live:
    ROUND_ROBIN   prefill[turn % m]
    LEAST_LOADED  argmin_p queued_tokens(p)
    CACHE_AWARE   argmin_p queued_tokens(p) - affinity_slack_tokens * [p is the session's]:
                  the session's worker, holding its prompt prefix, wins while its queue is at
                  most affinity_slack_tokens longer than the shortest
Ties go to the session's worker, then to the earlier worker in the snapshot.

Route.reason is the decode reason ("round_robin", "least_loaded", "session"), plus
"+local_prefill" when prefill is None, or "+prefix" when prefill is the session's worker.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cluster.config import ConfigError


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


@dataclass(frozen=True)
class PrefillLoad:
    worker: str
    epoch: str
    queued_tokens: int  # prompt tokens queued or being prefilled, not yet computed


@dataclass(frozen=True)
class Snapshot:
    """Loads of the live workers only, in a stable order (ties go to the earlier one)."""

    decode: tuple[DecodeLoad, ...]
    prefill: tuple[PrefillLoad, ...]


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
    affinity_slack_tokens: int = 2048  # extra queued prefill a prefix-holding worker may have

    def __post_init__(self) -> None:
        if not isinstance(self.name, PolicyName):
            names = tuple(p.value for p in PolicyName)
            raise ConfigError(f"name: must be one of {names}, got {self.name!r}")
        for field in ("local_prefill_tokens", "affinity_slack_tokens"):
            value = getattr(self, field)
            if not (_is_int(value) and value >= 0):
                raise ConfigError(f"{field}: must be an integer >= 0, got {value!r}")


def route(config: PolicyConfig, snapshot: Snapshot, request: RouteRequest) -> Route:
    """Pick the decode worker, and the prefill worker unless the decode worker prefills itself.

    Raises NoWorkerError when the snapshot has no decode worker.
    """
    if not snapshot.decode:
        raise NoWorkerError("no live decode worker to route the request to")
    hint = request.session if config.name is PolicyName.CACHE_AWARE else None
    decode, reason = _pick_decode(config.name, snapshot.decode, request, hint)
    if _uncached(decode, request, hint) <= config.local_prefill_tokens or not snapshot.prefill:
        return Route(decode.worker, None, f"{reason}+local_prefill")
    prefill, affinity = _pick_prefill(config, snapshot.prefill, request.turn, hint)
    return Route(decode.worker, prefill.worker, f"{reason}+prefix" if affinity else reason)


def _holds_session(w: DecodeLoad, hint: SessionHint | None) -> bool:
    return hint is not None and (w.worker, w.epoch) == (hint.decode_worker, hint.decode_epoch)


def _uncached(w: DecodeLoad, request: RouteRequest, hint: SessionHint | None) -> int:
    cached = hint.cached_tokens if hint is not None and _holds_session(w, hint) else 0
    return max(request.num_prompt_tokens - cached, 0)


def _pages(w: DecodeLoad, request: RouteRequest, hint: SessionHint | None) -> int:
    return -(-(_uncached(w, request, hint) + request.max_tokens) // w.page_size)


def _pick_decode(
    name: PolicyName,
    workers: tuple[DecodeLoad, ...],
    request: RouteRequest,
    hint: SessionHint | None,
) -> tuple[DecodeLoad, str]:
    if name is PolicyName.ROUND_ROBIN:
        return workers[request.turn % len(workers)], "round_robin"
    for w in workers:
        if _holds_session(w, hint) and _pages(w, request, hint) <= w.free_pages:
            return w, "session"
    least = min(
        workers,
        key=lambda w: (
            _pages(w, request, hint) > w.free_pages,
            w.running + w.waiting,
            -w.free_pages,
        ),
    )
    return least, "least_loaded"


def _pick_prefill(
    config: PolicyConfig,
    workers: tuple[PrefillLoad, ...],
    turn: int,
    hint: SessionHint | None,
) -> tuple[PrefillLoad, bool]:
    """The prefill worker, and whether it is the session's (holds the prompt prefix)."""
    if config.name is PolicyName.ROUND_ROBIN:
        return workers[turn % len(workers)], False
    holder = hint.prefill_worker if hint is not None else None
    slack = config.affinity_slack_tokens

    def cost(p: PrefillLoad) -> tuple[int, bool]:
        held = p.worker == holder
        return p.queued_tokens - (slack if held else 0), not held

    best = min(workers, key=cost)
    return best, best.worker == holder
