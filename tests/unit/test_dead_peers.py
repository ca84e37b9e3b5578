"""What a dead peer's errors turn into: a WRITE to a peer that went away fails that
WRITE (NIXL's own error must not escape: in a chaos run it failed every poll of the
prefill worker's loop, which then served nothing), and a prefill worker Ray reports
dead is reported once to the router, which tells the decode workers waiting on its KV;
one that is merely unreachable is not (its pages are only safe once it is dead). A WRITE
in parts (tensor parallelism: a part per pair of ranks) fails only once none of its
parts is in flight, and its notice goes only once all have landed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from cluster.transfer.endpoint import KVEndpoint, Peer, TransferError, Write
from cluster.transfer.wire import Notice, NoticeKind
from cluster.types import RequestId
from router.workers import WorkerRegistry


class _Agent:
    def __init__(self, state: str | Exception, **states: str) -> None:
        self.state = state  # every handle's, unless `states` names it
        self.states = states
        self.released: list[object] = []
        self.notified: list[tuple[str, bytes]] = []

    def check_xfer_state(self, handle: str) -> str:
        if handle in self.states:
            return self.states[handle]
        if isinstance(self.state, Exception):
            raise self.state
        return self.state

    def release_xfer_handle(self, handle: object) -> None:
        self.released.append(handle)

    def send_notif(self, agent: str, message: bytes) -> None:
        self.notified.append((agent, message))


PEER = Peer("decode-0", None, b"", ())  # type: ignore[arg-type]  # finished() reads its name only


def _endpoint(agent: _Agent) -> KVEndpoint:
    endpoint = KVEndpoint.__new__(KVEndpoint)  # only the agent is used by finished()
    endpoint._agent = agent
    return endpoint


def test_a_write_to_a_disconnected_peer_fails_that_write_and_releases_it() -> None:
    class NixlRemoteDisconnectError(Exception):  # what NIXL raises, by its own name
        pass

    agent = _Agent(NixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT"))
    with pytest.raises(TransferError, match="NIXL_ERR_REMOTE_DISCONNECT"):
        _endpoint(agent).finished(Write(["handle"], 64, PEER))
    assert agent.released == ["handle"]


@pytest.mark.parametrize(("state", "done"), [("PROC", False), ("DONE", True)])
def test_a_write_in_flight_or_done(state: str, done: bool) -> None:
    agent = _Agent(state)
    assert _endpoint(agent).finished(Write(["handle"], 64, PEER)) is done
    assert agent.released == ([] if state == "PROC" else ["handle"])


@dataclass
class _Rank:
    """Another rank's part of a WRITE, as rank 0 polls it."""

    outcome: str = "PROC"  # PROC, DONE, or why it failed

    def done(self) -> bool:
        if self.outcome not in ("PROC", "DONE"):
            raise TransferError(self.outcome)
        return self.outcome == "DONE"


def test_a_write_in_parts_ends_when_every_part_has_and_then_its_notice_goes() -> None:
    agent, rank = _Agent("PROC", a="DONE"), _Rank()
    notice = Notice(NoticeKind.LAYERS, RequestId("r"), 0, 1)
    write = Write(["a", "b"], 64, PEER, notice, [rank])
    endpoint = _endpoint(agent)
    assert not endpoint.finished(write) and agent.released == ["a"] and not agent.notified
    agent.states["b"] = "DONE"
    assert not endpoint.finished(write) and not agent.notified  # the other rank's part flies
    rank.outcome = "DONE"
    assert endpoint.finished(write)
    assert agent.notified == [("decode-0", notice.encode())]


def test_a_failed_part_fails_the_write_only_once_no_part_is_in_flight() -> None:
    # Failing at once would free the source pages (and, with CANCEL, the peer's) while
    # another part still reads or writes them.
    agent, rank = _Agent("PROC", a="ERR"), _Rank()
    write = Write(["a"], 64, PEER, Notice(NoticeKind.LAYERS, RequestId("r")), [rank])
    endpoint = _endpoint(agent)
    assert not endpoint.finished(write)
    rank.outcome = "rank 1: WRITE to decode-0 failed"
    with pytest.raises(TransferError, match="WRITE failed in flight: ERR"):
        endpoint.finished(write)
    assert not agent.notified


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
    registry = WorkerRegistry({"p0": handle}, {})  # type: ignore[dict-item]
    heard: list[tuple[object, str]] = []
    registry.on_prefill_died = lambda h, why: heard.append((h, why))
    asyncio.run(registry.refresh())
    assert registry.names("prefill") == []  # not routed to either way
    assert [h for h, _ in heard] == ([handle] if reported else [])
    asyncio.run(registry.refresh())
    assert len(heard) == int(reported)  # once
