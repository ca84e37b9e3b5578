"""What a dead peer's errors turn into: a WRITE to a peer that went away fails that
WRITE (NIXL's own error must not escape: in a chaos run it failed every poll of the
prefill worker's loop, which then served nothing), and a prefill worker Ray reports
dead is reported once to the router, which tells the decode workers waiting on its KV;
one that is merely unreachable is not (its pages are only safe once it is dead)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from cluster.transfer.endpoint import KVEndpoint, TransferError, Write
from router.workers import WorkerRegistry


class _Agent:
    def __init__(self, state: str | Exception) -> None:
        self.state = state
        self.released: list[object] = []

    def check_xfer_state(self, handle: object) -> str:
        if isinstance(self.state, Exception):
            raise self.state
        return self.state

    def release_xfer_handle(self, handle: object) -> None:
        self.released.append(handle)


def _endpoint(agent: _Agent) -> KVEndpoint:
    endpoint = KVEndpoint.__new__(KVEndpoint)  # only the agent is used by finished()
    endpoint._agent = agent
    return endpoint


def test_a_write_to_a_disconnected_peer_fails_that_write_and_releases_it() -> None:
    class NixlRemoteDisconnectError(Exception):  # what NIXL raises, by its own name
        pass

    agent = _Agent(NixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"))
    with pytest.raises(TransferError, match="NIXL_ERR_REMOTE_DISCONNECT"):
        _endpoint(agent).finished(Write("handle", 64))
    assert agent.released == ["handle"]


@pytest.mark.parametrize(("state", "done"), [("PROC", False), ("DONE", True)])
def test_a_write_in_flight_or_done(state: str, done: bool) -> None:
    agent = _Agent(state)
    assert _endpoint(agent).finished(Write("handle", 64)) is done
    assert agent.released == ([] if state == "PROC" else ["handle"])


class _Failing:
    """A prefill actor handle whose every call fails with `error`."""

    def __init__(self, error: Exception) -> None:
        async def fail(*args: Any) -> Any:
            raise error

        method = type("Method", (), {"remote": staticmethod(fail)})
        self.stats = self.kv_events = method


@pytest.mark.parametrize(
    ("error", "reported"),
    [(ActorDiedError(), True), (ActorUnavailableError("restarting", b"a" * 16), False)],
    ids=["died", "unreachable"],
)
def test_only_a_prefill_worker_ray_reports_dead_is_reported(
    error: Exception, reported: bool
) -> None:
    handle = _Failing(error)
    registry = WorkerRegistry({"p0": handle}, {}, page_size=16)  # type: ignore[dict-item]
    heard: list[tuple[object, str]] = []
    registry.on_prefill_died = lambda h, why: heard.append((h, why))
    asyncio.run(registry.refresh())
    assert registry.names("prefill") == []  # not routed to either way
    assert [h for h, _ in heard] == ([handle] if reported else [])
    asyncio.run(registry.refresh())
    assert len(heard) == int(reported)  # once
