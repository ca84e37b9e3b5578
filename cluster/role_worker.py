"""What the two role workers (decode_worker/worker.py, prefill_worker/worker.py) build the
same way: the Ray actor that hosts one, and the KV transfer endpoint over its engine's
cache. Their engine thread, and how results come back from it, is cluster/worker_loop.py's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar, cast

import ray
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put
from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.actor_options import actor_options, rank_bundles
from cluster.config import EngineConfig, TransferConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.model.checkpoint import Progress
from cluster.transfer.endpoint import KVEndpoint, Pending, TransferError
from cluster.transfer.wire import RankPages, compat_hash
from cluster.types import PageId

H = TypeVar("H")
LOADING = "splitserve-loading"  # the namespace of Ray's key-value store the reports go to


def spawn(
    worker: type,  # DecodeWorker or PrefillWorker: built as worker(name, engine, transfer)
    handle: Callable[..., H],  # its handle Protocol (cluster.protocol): the result's type
    name: str,
    engine: EngineConfig,
    transfer: TransferConfig,
    num_cpus: float = 1,
    num_gpus: float | None = None,  # None: one GPU if the engine runs on CUDA (actor_options)
    resources: dict[str, float] | None = None,
) -> H:
    """Start a `worker` actor named `name`; returns its Ray actor handle."""
    actor: Any = ray.remote(worker)
    gpus = ray.cluster_resources().get("GPU", 0.0)
    options = actor_options(name, num_cpus, num_gpus, engine.device, resources or {}, gpus)
    if engine.tensor_parallel_size > 1:  # the worker and its other ranks, on one node
        bundles = rank_bundles(options, engine.tensor_parallel_size)
        group = placement_group(bundles, strategy="STRICT_PACK", name=ranks_group(name))
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, 0)
    return cast(H, actor.options(**options).remote(name, engine, transfer))


def ranks_group(name: str) -> str:
    """The placement group of worker `name`'s ranks (tensor parallelism)."""
    return f"{name}-ranks"


def kill(name: str, handle: Any, tensor_parallel_size: int) -> None:
    """End worker `name`'s actor, and its other ranks' with their placement group."""
    ray.kill(handle)
    if tensor_parallel_size > 1:
        remove_placement_group(get_placement_group(ranks_group(name)))


def endpoint(name: str, engine: LLMEngine, transfer: TransferConfig) -> KVEndpoint:
    """The KV endpoint named `name` over the engine's cache; peers whose engine differs in
    model, dtype, page size or quantization are refused (compat_hash). With tensor
    parallelism it is rank 0's, and each other rank opens its own (`name`-rank1, ...),
    through which its heads' KV is written (a prefill worker's) or written into (a
    decode worker's)."""
    compat = compat_hash(
        engine.spec,
        engine.dtype,
        engine.config.kv_cache_dtype,
        engine.pool.page_size,
        engine.quantization,
    )
    devices, transports = transfer.ucx_devices, transfer.ucx_transports
    ep = KVEndpoint(
        name, engine.cache, compat, devices, transports, transfer.progress_thread, engine.kv_heads
    )
    if engine.ranks is not None:
        actors = engine.ranks.actors
        opened = [
            a.open_kv.remote(f"{name}-rank{r}", compat, devices, transports).future()
            for r, a in enumerate(actors, 1)
        ]  # futures: waited on here, off the actor's event loop, without ray.get's warning
        ep.followers = [RankKV(a, f.result()) for a, f in zip(actors, opened, strict=True)]
        for a in actors:
            a.progress_kv.remote()  # returns once the rank stops following
    return ep


class RankKV:
    """Rank 0's hold on another rank's KV endpoint (a tensor_parallel.TensorRank's), as
    the endpoint's RankWriter: that rank posts its heads' WRITEs."""

    def __init__(self, actor: Any, memory: RankPages) -> None:
        self.actor = actor
        self.memory = memory

    def post(
        self, handshake: bytes, layers: range, src: Sequence[PageId], dst: Sequence[PageId]
    ) -> Pending:
        ref = self.actor.write_kv.remote(handshake, layers, list(src), list(dst))
        return _Posted(ref.future())


class _Posted:
    def __init__(self, future: Future[str]) -> None:
        self.future = future

    def done(self) -> bool:
        if not self.future.done():
            return False
        try:
            why = self.future.result()
        except Exception as e:  # the rank died: its WRITEs went with it
            raise TransferError(f"a rank's WRITE: {e}") from e
        if why:
            raise TransferError(why)
        return True


def load_reporter(name: str, clock: Callable[[], float] = time.monotonic) -> Progress:
    """How worker `name`'s engine reports its weights' loading while its actor is still
    being built (no actor method can answer then): tensors read and in all, into Ray's
    key-value store, at most ten times a second and always the last; `loaded` reads it."""
    last = -math.inf

    def report(done: int, total: int) -> None:
        nonlocal last
        if done < total and clock() - last < 0.1:
            return
        last = clock()
        _internal_kv_put(name, f"{done}/{total}", namespace=LOADING)

    return report


def loaded(name: str) -> tuple[int, int] | None:
    """(tensors read, in all) as worker `name` last reported; None before its first report."""
    raw = _internal_kv_get(name, namespace=LOADING)
    if not raw:
        return None
    done, total = raw.decode().split("/")
    return int(done), int(total)


def forget_load(name: str) -> None:
    _internal_kv_del(name, namespace=LOADING)
