"""Each actor handle's Protocol (cluster/protocol.py) lists exactly its actor's remote
methods, each with the actor method's signature: the same parameters (names, kinds,
defaults, types) and result. So code typed against a handle calls what the actor has,
and a change to an actor's API fails here until its handle says the same."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, Protocol

import pytest
import ray

from cluster.protocol import DecodeHandle, PrefillHandle, remote
from cluster.types import RequestId
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker


def methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The public methods a class defines itself: an actor's remote API."""
    return {name: f for name, f in vars(cls).items() if inspect.isfunction(f) and name[0] != "_"}


def signature(f: Callable[..., Any]) -> inspect.Signature:
    """f's own signature, types resolved. Once `ray.remote` has been applied to an actor
    class in this process (any earlier test that spawned one), Ray's tracing has wrapped
    its methods and given each an extra keyword `_ray_trace_ctx`: not part of the API."""
    f = inspect.unwrap(f)
    hints = typing.get_type_hints(f)
    sig = inspect.signature(f)
    params = [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in sig.parameters.values()
        if p.name != "_ray_trace_ctx"
    ]
    return sig.replace(
        parameters=params, return_annotation=hints.get("return", sig.return_annotation)
    )


def differences(handle: type, actor: type) -> list[str]:
    """How the handle's declared methods differ from the actor's (empty: none)."""
    declared, actual = methods(handle), methods(actor)
    found = [f"{name}: not on the actor" for name in declared.keys() - actual.keys()]
    found += [f"{name}: not on the handle" for name in actual.keys() - declared.keys()]
    for name in declared.keys() & actual.keys():
        said, has = signature(declared[name]), signature(actual[name])
        if said != has:
            found.append(f"{name}: the handle says {said}, the actor has {has}")
    return sorted(found)


@pytest.mark.parametrize(
    ("handle", "actor"), [(DecodeHandle, DecodeWorker), (PrefillHandle, PrefillWorker)]
)
def test_a_handle_declares_its_actors_remote_methods_as_the_actor_has_them(
    handle: type, actor: type
) -> None:
    assert methods(handle), handle
    assert differences(handle, actor) == []
    ray.remote(actor)  # as spawning one does: Ray's tracing then wraps the class's methods
    assert differences(handle, actor) == []


class _Actor:
    async def submit(self, request_id: RequestId, resumed: int = 0) -> int:
        return resumed

    async def stats(self) -> int:
        return 0

    async def evict_all(self, why: str) -> int:
        return 0

    def _tick(self) -> None:  # private: not part of the API
        pass


class _Drifted(Protocol):
    @remote
    async def submit(self, request_id: RequestId, resumed: int = 1) -> int: ...

    @remote
    async def stats(self) -> str: ...

    @remote
    async def status(self) -> int: ...


def test_the_check_catches_a_missing_an_extra_and_a_changed_method() -> None:
    found = differences(_Drifted, _Actor)
    assert [line.split(":")[0] for line in found] == ["evict_all", "stats", "status", "submit"]
    assert found[0] == "evict_all: not on the handle"
    assert found[2] == "status: not on the actor"
    assert "resumed: int = 1" in found[3] and "resumed: int = 0" in found[3]
