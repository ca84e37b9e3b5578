"""Router.in_flight: the admission check. `max_pending` slots in all, `max_pending_per_client`
of them per client; a refusal names the limit, and a slot is given back however its
request ends."""

from __future__ import annotations

import contextlib

import pytest

from router.errors import Overloaded
from router.policy import PolicyConfig
from router.router import Router
from router.workers import WorkerRegistry


def _router(max_pending: int, per_client: int | None) -> Router:
    workers = WorkerRegistry({}, {})
    return Router(PolicyConfig(), workers, None, max_pending, max_pending_per_client=per_client)


def _refused(router: Router, client: str) -> str:
    with pytest.raises(Overloaded) as refused, router.in_flight(client):
        pass
    return refused.value.limit


def test_a_client_past_its_own_limit_is_refused_while_others_get_in() -> None:
    router = _router(max_pending=4, per_client=2)
    with contextlib.ExitStack() as held:
        held.enter_context(router.in_flight("key flood"))
        held.enter_context(router.in_flight("key flood"))
        assert _refused(router, "key flood") == "max_pending_per_client"
        held.enter_context(router.in_flight("peer 10.0.0.7"))
        held.enter_context(router.in_flight("key normal"))
        assert router.pending == 4
        assert _refused(router, "key normal") == "max_pending"  # the whole router is full
    assert router.pending == 0 and not router.clients


def test_a_slot_comes_back_when_its_request_fails() -> None:
    router = _router(max_pending=4, per_client=1)
    with pytest.raises(RuntimeError), router.in_flight("key a"):
        raise RuntimeError("the request failed")
    with router.in_flight("key a"):
        assert router.clients == {"key a": 1}


def test_without_a_per_client_limit_one_client_may_take_every_slot() -> None:
    router = _router(max_pending=3, per_client=None)
    with contextlib.ExitStack() as held:
        for _ in range(3):
            held.enter_context(router.in_flight("key only"))
        assert _refused(router, "key only") == "max_pending"
