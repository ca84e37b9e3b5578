"""Routing policy: round robin, least loaded, session and prefix affinity, local prefill.

Every case is a snapshot of worker loads, a request and the route it must get. Pages are
16 tokens; the default request (1000 prompt + 64 max tokens) needs 67 pages anywhere, and
11 pages on the worker that holds 900 of its prompt tokens. A sequence on a decode worker
costs 64 prompt tokens (seq_cost_tokens), so d2 of BUSY_D2 (10 sequences) is worth 640
cached tokens less than d1.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from cluster.config import ConfigError
from router.policy import (
    RECOMPUTE_WASTE,
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


def req(
    prompt: int = 1000,
    session: SessionHint | None = None,
    turn: int = 0,
    cached: dict[str, int] | None = None,
) -> RouteRequest:
    return RouteRequest(prompt, 64, session, turn, groups(cached or {}))


def groups(cached: dict[str, int]) -> dict[int, frozenset[str]]:
    """Prompt tokens held per worker, as the prefix index answers: grouped by tokens."""
    return {t: frozenset(w for w, n in cached.items() if n == t) for t in set(cached.values())}


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
     req(session=hint()), Route("d2", None, "session+local_prefill")),
    ("ca session pages fit exactly", CA, (dw("d1"), dw("d2", 11, 10)), PREFILL,
     req(session=hint()), Route("d2", None, "session+local_prefill")),
    ("ca session out of pages falls back", CA, (dw("d1"), dw("d2", 10, 10)), PREFILL,
     req(session=hint()), Route("d1", "p1", "least_loaded")),
    ("ca stale epoch ignored", CA, BUSY_D2, PREFILL,
     req(session=hint(epoch="e0")), Route("d1", "p1", "least_loaded")),
    ("ca dead session worker ignored", CA, BUSY_D2, PREFILL,
     req(session=hint(decode="d9")), Route("d1", "p1", "least_loaded")),
    ("ca no session: least loaded", CA, BUSY_D2, (pw("p1", 9), pw("p2")),
     req(), Route("d1", "p2", "least_loaded")),
    ("ca prefix affinity at the slack", CA, BUSY_D2, (pw("p1"), pw("p2", 2048)),
     req(session=hint(epoch="e0", prefill="p2")), Route("d1", "p2", "least_loaded+prefix")),
    ("ca prefix affinity beyond the slack", CA, BUSY_D2, (pw("p1"), pw("p2", 2049)),
     req(session=hint(epoch="e0", prefill="p2")), Route("d1", "p1", "least_loaded")),
    ("ca prefix affinity survives a stale decode epoch", CA, BUSY_D2, (pw("p1"), pw("p2", 99)),
     req(session=hint(epoch="e0", prefill="p2")), Route("d1", "p2", "least_loaded+prefix")),
    ("ca dead prefix worker ignored", CA, BUSY_D2, (pw("p1", 5), pw("p2")),
     req(session=hint(epoch="e0", prefill="p9")), Route("d1", "p2", "least_loaded")),
    ("ca session uncached at the threshold prefills locally", CA, BUSY_D2, PREFILL,
     req(session=hint(cached=968)), Route("d2", None, "session+local_prefill")),
    ("ca session uncached above the threshold uses the prefill worker holding as much",
     CA, BUSY_D2, PREFILL, req(session=hint(cached=967), cached={"p2": 967}),
     Route("d2", "p2", "session+prefix")),
    # p would recompute held tokens: a quarter or more of what is new to the decode worker
    ("ca a session's reply is not recomputed: local prefill", CA, IDLE, PREFILL,
     req(session=hint(cached=900), cached={"p1": 400, "p2": 400}),
     Route("d2", None, "session+local_prefill")),
    ("ca a long new part goes to the prefill worker, recomputing a little", CA, IDLE, PREFILL,
     req(prompt=2000, session=hint(cached=600), cached={"p1": 400, "p2": 400}),
     Route("d2", "p1", "session+prefix")),
    ("ca a fresh prefill worker still gets prompts the decode worker holds a page of", CA,
     IDLE, (pw("p1"),), req(prompt=2000, cached={"d1": 16}), Route("d1", "p1", "cached")),
    ("ca a prefill worker holding all the decode worker holds prefills", CA, IDLE, PREFILL,
     req(session=hint(cached=600), cached={"p1": 400, "p2": 608}),
     Route("d2", "p2", "session+prefix")),
    ("ca cached beyond the prompt prefills locally", CA, BUSY_D2, PREFILL,
     req(session=hint(cached=2000)), Route("d2", None, "session+local_prefill")),
    ("ca fallback worker lacks the cache: prefill", CA, (dw("d1"), dw("d2", 0)), PREFILL,
     req(session=hint(cached=990)), Route("d1", "p1", "least_loaded")),
    ("ca no prefill worker prefills locally", CA, BUSY_D2, (),
     req(), Route("d1", None, "least_loaded+local_prefill")),
    # the prefix index: cached prompt tokens per worker, from the workers' KV events
    ("ca cached prefix wins over an idler worker", CA, BUSY_D2, PREFILL,
     req(cached={"d2": 960}), Route("d2", None, "cached+local_prefill")),
    ("ca cached prefix loses to a much idler worker", CA, BUSY_D2, PREFILL,
     req(cached={"d2": 352}), Route("d1", "p1", "least_loaded")),
    ("ca cached uncached at the threshold prefills locally", CA, BUSY_D2, PREFILL,
     req(cached={"d2": 968}), Route("d2", None, "cached+local_prefill")),
    ("ca the longer cached prefix wins", CA, IDLE, PREFILL,
     req(cached={"d1": 320, "d2": 640, "p1": 640}), Route("d2", "p1", "cached+prefix")),
    ("ca cached worker without pages falls back", CA, (dw("d1"), dw("d2", 2)), PREFILL,
     req(cached={"d2": 960}), Route("d1", "p1", "least_loaded")),
    ("ca a worker not in the snapshot is ignored", CA, BUSY_D2, PREFILL,
     req(cached={"d9": 999, "p9": 999}), Route("d1", "p1", "least_loaded")),
    ("ca the index outweighs a shorter session hint", CA, IDLE, PREFILL,
     req(session=hint(cached=100), cached={"d1": 900}), Route("d1", None, "cached+local_prefill")),
    ("ca a session worker counts the larger of hint and index", CA, BUSY_D2, PREFILL,
     req(session=hint(cached=100), cached={"d2": 960}), Route("d2", None, "session+local_prefill")),
    ("ca equal costs: the session's worker", CA, IDLE, PREFILL,
     req(session=hint(cached=320), cached={"d1": 320, "p1": 320}),
     Route("d2", "p1", "session+prefix")),
    ("ca prefill worker holding the prompt wins within what it saves", CA, BUSY_D2,
     (pw("p1"), pw("p2", 799)), req(cached={"p2": 800}), Route("d1", "p2", "least_loaded+prefix")),
    ("ca prefill worker holding the prompt loses past what it saves", CA, BUSY_D2,
     (pw("p1"), pw("p2", 801)), req(cached={"p2": 800}), Route("d1", "p1", "least_loaded")),
    ("ca prefill index outweighs the session's slack", CA, IDLE, (pw("p1", 3000), pw("p2", 1900)),
     req(session=hint(prefill="p1"), cached={"p2": 1000}), Route("d2", "p2", "session+prefix")),
    ("ca ... which wins without the index", CA, IDLE, (pw("p1", 3000), pw("p2", 1900)),
     req(session=hint(epoch="e0", prefill="p1")), Route("d1", "p1", "least_loaded+prefix")),
    ("ll ignores the index", LL, BUSY_D2, PREFILL,
     req(cached={"d2": 990, "p2": 990}), Route("d1", "p1", "least_loaded")),
    ("rr ignores the index", RR, IDLE, PREFILL,
     req(cached={"d2": 990}, turn=1), Route("d2", "p2", "round_robin")),
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
    assert route(config, snapshot, req(session=hint(epoch="e0", prefill="p2"))).prefill == prefill


@pytest.mark.parametrize("seq_cost, decode", [(1, "d2"), (59, "d2"), (60, "d1"), (1000, "d1")])
def test_seq_cost_tokens_is_the_knob(seq_cost: int, decode: str) -> None:
    """d2 holds 600 of the prompt and runs 10 more sequences than d1: it wins while
    10 * seq_cost_tokens < 600 (at equal cost, the earlier worker)."""
    config = PolicyConfig(seq_cost_tokens=seq_cost)
    assert route(config, Snapshot(BUSY_D2, PREFILL), req(cached={"d2": 600})).decode == decode


def _formula(
    config: PolicyConfig, snapshot: Snapshot, r: RouteRequest, index: dict[str, int]
) -> Route:
    """The cache_aware formula of router/policy.py's docstring, over every worker; `index`:
    the prompt tokens each worker holds (r.cached, per worker)."""
    h = r.session

    def cached(w: DecodeLoad) -> tuple[int, bool]:
        session = h is not None and (w.worker, w.epoch) == (h.decode_worker, h.decode_epoch)
        return max(index.get(w.worker, 0), h.cached_tokens if h and session else 0), session

    def decode_key(i: int) -> tuple[bool, int, bool, int, int]:
        w = snapshot.decode[i]
        held, session = cached(w)
        uncached = max(r.num_prompt_tokens - held, 0)
        fits = -(-(uncached + r.max_tokens) // w.page_size) <= w.free_pages
        cost = uncached + config.seq_cost_tokens * (w.running + w.waiting)
        return not fits, cost, not session, -w.free_pages, i

    d = snapshot.decode[min(range(len(snapshot.decode)), key=decode_key)]
    held, session = cached(d)
    reason = "session" if session else ("cached" if held else "least_loaded")
    if r.num_prompt_tokens - held <= config.local_prefill_tokens or not snapshot.prefill:
        return Route(d.worker, None, reason + "+local_prefill")
    holder = h.prefill_worker if h else None

    def credit(p: PrefillLoad) -> int:
        slack = config.affinity_slack_tokens if p.worker == holder else 0
        return max(index.get(p.worker, 0), slack)

    def prefill_key(i: int) -> tuple[int, bool, int]:
        p = snapshot.prefill[i]
        return p.queued_tokens - credit(p), p.worker != holder, i

    p = snapshot.prefill[min(range(len(snapshot.prefill)), key=prefill_key)]
    recompute = held - index.get(p.worker, 0)
    if recompute > 0 and recompute * RECOMPUTE_WASTE >= r.num_prompt_tokens - held:
        return Route(d.worker, None, reason + "+local_prefill")
    return Route(d.worker, p.worker, reason + "+prefix" if credit(p) else reason)


def test_route_picks_what_the_formula_picks_over_every_worker() -> None:
    """route() prices one contender per group of workers holding as much of the prompt;
    on random snapshots (groups small and large, common prefixes held by most workers)
    it must agree with the formula applied to every worker."""
    rng = random.Random(5)
    config = PolicyConfig(seq_cost_tokens=32)
    for _ in range(3000):
        n, m = rng.randint(1, 24), rng.randint(0, 12)
        decode = tuple(
            dw(f"d{i}", rng.randint(0, 90), rng.randint(0, 4), rng.randint(0, 2), rng.choice("ab"))
            for i in range(n)
        )
        prefill = tuple(pw(f"p{i}", rng.choice((0, 500, 1000, 2000))) for i in range(m))
        names = [w.worker for w in decode + prefill] + ["d99"]
        holding = rng.sample(names, rng.randint(0, len(names)))
        sizes = [rng.randrange(16, 1100, 16) for _ in range(rng.randint(1, 3))]
        index = {w: rng.choice(sizes) for w in holding}
        session = rng.choice((None, hint(f"d{rng.randrange(n)}", rng.choice("ab"), "p1", 300)))
        r = RouteRequest(rng.choice((20, 600, 1000)), 64, session, 0, groups(index))
        snapshot = Snapshot(decode, prefill)
        assert route(config, snapshot, r) == _formula(config, snapshot, r, index), (snapshot, r)


@pytest.mark.parametrize("local, prefill", [(0, "p1"), (1, None)])
def test_local_prefill_tokens_is_the_threshold(local: int, prefill: str | None) -> None:
    config = PolicyConfig(local_prefill_tokens=local)
    assert route(config, Snapshot(IDLE, PREFILL), req(prompt=1)).prefill == prefill


# Measured costs: d1 takes 1 ms per token, p1 0.5 ms, pushing a token 0.1 ms. The default
# request (1000 uncached tokens): 1 s here, 0.6 s there plus 0.5 ms per token queued there.
MEASURED_D1 = DecodeLoad("d1", "e1", 100, 100, 16, 0, 0, 1e-3)


@pytest.mark.parametrize(
    "sequences, queued, by_cost, prefill, reason",
    [
        (0, 0, True, "p1", "least_loaded"),
        (0, 801, True, None, "least_loaded+local_prefill_cost"),
        (0, 801, False, "p1", "least_loaded"),  # the threshold alone decides
        (2, 801, True, "p1", "least_loaded"),  # 3 s here: it stalls two sequences
        (2, 5000, True, None, "least_loaded+local_prefill_cost"),
    ],
)
def test_local_prefill_when_the_measured_costs_say_so(
    sequences: int, queued: int, by_cost: bool, prefill: str | None, reason: str
) -> None:
    d1 = dataclasses.replace(MEASURED_D1, running=sequences)
    p1 = PrefillLoad("p1", "e1", queued, 5e-4, 1e-4)
    config = PolicyConfig(prefill_by_cost=by_cost)
    assert route(config, Snapshot((d1,), (p1,)), req()) == Route("d1", prefill, reason)


def test_unmeasured_costs_prefill_remotely() -> None:
    """A worker that has not run steps of different sizes (or pushed nothing) has no cost
    yet: the request goes to the prefill worker, however long its queue."""
    config = PolicyConfig(prefill_by_cost=True)
    p1 = PrefillLoad("p1", "e1", 10**6, 5e-4, None)
    assert route(config, Snapshot((MEASURED_D1,), (p1,)), req()).prefill == "p1"
    p1 = PrefillLoad("p1", "e1", 10**6, 5e-4, 1e-4)
    assert route(config, Snapshot((dw("d1"),), (p1,)), req()).prefill == "p1"


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
        ("seq_cost_tokens", 0),
        ("seq_cost_tokens", 1.0),
        ("prefill_by_cost", 1),
    ],
)
def test_a_bad_config_value_is_refused_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        PolicyConfig(**{field: value})
    assert str(info.value).startswith(f"{field}:")
