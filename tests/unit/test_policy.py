"""Routing policy: round robin, least loaded, session and prefix affinity, local prefill.

Every case is a snapshot of worker loads, a request and the route it must get. Pages are
16 tokens; the default request (1000 prompt + 64 max tokens) needs 67 pages anywhere, and
11 pages on the worker that holds 900 of its prompt tokens.
"""

from __future__ import annotations

from typing import Any

import pytest

from cluster.config import ConfigError
from router.policy import (
    DecodeLoad,
    NoWorkerError,
    PolicyConfig,
    PolicyName,
    PrefillLoad,
    Route,
    RouteRequest,
    SessionHint,
    Snapshot,
    route,
)

RR, LL, CA = PolicyName.ROUND_ROBIN, PolicyName.LEAST_LOADED, PolicyName.CACHE_AWARE


def dw(
    name: str, free: int = 100, running: int = 0, waiting: int = 0, epoch: str = "e1"
) -> DecodeLoad:
    return DecodeLoad(name, epoch, free, 100, 16, running, waiting)


def pw(name: str, queued: int = 0) -> PrefillLoad:
    return PrefillLoad(name, "e1", queued)


def hint(
    decode: str = "d2", epoch: str = "e1", prefill: str | None = None, cached: int = 900
) -> SessionHint:
    return SessionHint(decode, epoch, prefill, cached)


def req(prompt: int = 1000, session: SessionHint | None = None, turn: int = 0) -> RouteRequest:
    return RouteRequest(prompt, 64, session, turn)


IDLE = (dw("d1"), dw("d2"))
BUSY_D2 = (dw("d1"), dw("d2", running=10))
PREFILL = (pw("p1"), pw("p2"))

# fmt: off
CASES = [
    # name, policy, decode loads, prefill loads, request, expected route
    ("rr ignores loads and sessions", RR, BUSY_D2, PREFILL,
     req(session=hint(prefill="p2"), turn=2), Route("d1", "p1", "round_robin")),
    ("rr knows no cache: a cached prompt still prefills", RR, IDLE, PREFILL,
     req(session=hint(cached=990)), Route("d1", "p1", "round_robin")),
    ("rr short prompt prefills locally", RR, IDLE, PREFILL,
     req(prompt=32), Route("d1", None, "round_robin+local_prefill")),
    ("ll fewest sequences", LL, (dw("d1", running=3), dw("d2", running=1, waiting=1)), PREFILL,
     req(), Route("d2", "p1", "least_loaded")),
    ("ll equal sequences: most free pages", LL, (dw("d1", 80, 2), dw("d2", 90, 1, 1)), PREFILL,
     req(), Route("d2", "p1", "least_loaded")),
    ("ll one that fits beats an idler one", LL, (dw("d1", 66), dw("d2", 67, 9)), PREFILL,
     req(), Route("d2", "p1", "least_loaded")),
    ("ll none fits: fewest sequences", LL, (dw("d1", 10, 3), dw("d2", 5, 1)), PREFILL,
     req(), Route("d2", "p1", "least_loaded")),
    ("ll tie: first in snapshot", LL, IDLE, PREFILL, req(), Route("d1", "p1", "least_loaded")),
    ("ll least queued prefill", LL, IDLE, (pw("p1", 500), pw("p2", 100)),
     req(), Route("d1", "p2", "least_loaded")),
    ("ll ignores sessions", LL, BUSY_D2, (pw("p1", 1), pw("p2")),
     req(session=hint(prefill="p1")), Route("d1", "p2", "least_loaded")),
    ("ca session wins over an idler worker", CA, BUSY_D2, PREFILL,
     req(session=hint()), Route("d2", "p1", "session")),
    ("ca session pages fit exactly", CA, (dw("d1"), dw("d2", 11, 10)), PREFILL,
     req(session=hint()), Route("d2", "p1", "session")),
    ("ca session out of pages falls back", CA, (dw("d1"), dw("d2", 10, 10)), PREFILL,
     req(session=hint()), Route("d1", "p1", "least_loaded")),
    ("ca stale epoch ignored", CA, BUSY_D2, PREFILL,
     req(session=hint(epoch="e0")), Route("d1", "p1", "least_loaded")),
    ("ca dead session worker ignored", CA, BUSY_D2, PREFILL,
     req(session=hint(decode="d9")), Route("d1", "p1", "least_loaded")),
    ("ca no session: least loaded", CA, BUSY_D2, (pw("p1", 9), pw("p2")),
     req(), Route("d1", "p2", "least_loaded")),
    ("ca prefix affinity at the slack", CA, BUSY_D2, (pw("p1"), pw("p2", 2048)),
     req(session=hint(prefill="p2")), Route("d2", "p2", "session+prefix")),
    ("ca prefix affinity beyond the slack", CA, BUSY_D2, (pw("p1"), pw("p2", 2049)),
     req(session=hint(prefill="p2")), Route("d2", "p1", "session")),
    ("ca prefix affinity survives a stale decode epoch", CA, BUSY_D2, (pw("p1"), pw("p2", 99)),
     req(session=hint(epoch="e0", prefill="p2")), Route("d1", "p2", "least_loaded+prefix")),
    ("ca dead prefix worker ignored", CA, BUSY_D2, (pw("p1", 5), pw("p2")),
     req(session=hint(prefill="p9")), Route("d2", "p2", "session")),
    ("ca session uncached at the threshold prefills locally", CA, BUSY_D2, PREFILL,
     req(session=hint(cached=968)), Route("d2", None, "session+local_prefill")),
    ("ca session uncached above the threshold uses prefill", CA, BUSY_D2, PREFILL,
     req(session=hint(cached=967)), Route("d2", "p1", "session")),
    ("ca cached beyond the prompt prefills locally", CA, BUSY_D2, PREFILL,
     req(session=hint(cached=2000)), Route("d2", None, "session+local_prefill")),
    ("ca fallback worker lacks the cache: prefill", CA, (dw("d1"), dw("d2", 0)), PREFILL,
     req(session=hint(cached=990)), Route("d1", "p1", "least_loaded")),
    ("ca no prefill worker prefills locally", CA, BUSY_D2, (),
     req(), Route("d1", None, "least_loaded+local_prefill")),
]
# fmt: on


@pytest.mark.parametrize(
    "policy, decode, prefill, request_, expected",
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_route(
    policy: PolicyName,
    decode: tuple[DecodeLoad, ...],
    prefill: tuple[PrefillLoad, ...],
    request_: RouteRequest,
    expected: Route,
) -> None:
    assert route(PolicyConfig(name=policy), Snapshot(decode, prefill), request_) == expected


@pytest.mark.parametrize(
    "turn, decode, prefill",
    [(0, "d1", "p1"), (1, "d2", "p2"), (2, "d3", "p1"), (3, "d1", "p2"), (7, "d2", "p2")],
)
def test_round_robin_cycles_through_both_pools(turn: int, decode: str, prefill: str) -> None:
    snapshot = Snapshot((dw("d1"), dw("d2"), dw("d3")), PREFILL)
    assert route(PolicyConfig(name=RR), snapshot, req(turn=turn)) == Route(
        decode, prefill, "round_robin"
    )


@pytest.mark.parametrize("slack, prefill", [(0, "p1"), (99, "p1"), (100, "p2")])
def test_affinity_slack_is_the_knob(slack: int, prefill: str) -> None:
    config = PolicyConfig(affinity_slack_tokens=slack)
    snapshot = Snapshot(IDLE, (pw("p1", 100), pw("p2", 200)))
    assert route(config, snapshot, req(session=hint(prefill="p2"))).prefill == prefill


@pytest.mark.parametrize("local, prefill", [(0, "p1"), (1, None)])
def test_local_prefill_tokens_is_the_threshold(local: int, prefill: str | None) -> None:
    config = PolicyConfig(local_prefill_tokens=local)
    assert route(config, Snapshot(IDLE, PREFILL), req(prompt=1)).prefill == prefill


@pytest.mark.parametrize("policy", list(PolicyName))
def test_no_decode_worker_is_an_error(policy: PolicyName) -> None:
    with pytest.raises(NoWorkerError, match="no live decode worker"):
        route(PolicyConfig(name=policy), Snapshot((), PREFILL), req())


@pytest.mark.parametrize(
    "field, value",
    [
        ("name", "cache_aware"),
        ("local_prefill_tokens", -1),
        ("local_prefill_tokens", 1.5),
        ("local_prefill_tokens", True),
        ("affinity_slack_tokens", -1),
        ("affinity_slack_tokens", "2048"),
    ],
)
def test_a_bad_config_value_is_refused_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        PolicyConfig(**{field: value})
    assert str(info.value).startswith(f"{field}:")
