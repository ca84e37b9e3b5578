"""What the roles say to each other across processes: each worker's stats, and the
typed handles its callers hold.

The workers build the stats (decode_worker, prefill_worker) and the router and the
control plane read them, so they live on the floor all of them stand on: reading a
worker's load imports neither its actor nor the engine. The per-request values that
cross processes (Submission, KVTarget, FirstToken, TokenDelta, ModelInfo) are in
cluster/types.py.
Plain frozen dataclasses, carried by Ray's own serialization.

`DecodeHandle` and `PrefillHandle` type the Ray actor handles: each lists its actor's
remote methods with the actor method's own signature (tests/unit/test_handles.py holds
them equal), and each worker module's `spawn()` returns its handle as one.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

from cluster.types import (
    BlockHash,
    FirstToken,
    KVTarget,
    ModelInfo,
    RequestId,
    RequestStatus,
    Submission,
    TokenDelta,
)

if TYPE_CHECKING:
    from ray import ObjectRef

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class TierCounts:
    """What an engine's KV tier (cluster/engine/kv_tier.py) holds, and has moved since the
    engine started; vLLM counts hits and queries of a connector's cache as its
    external_prefix_cache_hits and _queries."""

    bytes_held: int
    queries: int  # tokens admitted requests looked up in the tier
    hits: int  # ... and found there
    spilled_bytes: int
    restored_bytes: int
    dropped: int  # entries that failed a write or their checksum (recomputed)


@dataclass(frozen=True)
class EngineCounts:
    """What a worker's engine has done since it started, as vLLM counts it (its counters
    prompt_tokens, generation_tokens, prefix_cache_queries and _hits, num_preemptions).
    A prompt counts once, whole, where its prefill finishes; a token counts where it was
    sampled (a remote prefill's first token on its prefill worker)."""

    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # ... and found there
    preemptions: int
    tier: TierCounts | None = None  # the KV tier behind the pool; None: no tier


@dataclass(frozen=True)
class DecodeStats:
    epoch: str  # new each time the worker starts: its prefix cache is gone with the old one
    free_pages: int
    num_pages: int
    page_size: int  # tokens a page of this worker's holds (its prefix hashes' block size)
    running: int
    waiting: int  # queued, or restoring a prefix from the KV tier
    transferring: int
    admitting: int
    queued_tokens: int  # prompt tokens of waiting requests, not yet computed
    counts: EngineCounts
    pages_received: int
    bytes_received: int
    transfer_failures: int  # transfers that ended without their KV (then recomputed or failed)
    s_per_token: float | None  # what a token adds to a step here (StepRate); None: not measured
    metrics_url: str | None  # this worker's own /metrics (EngineConfig.metrics_port); None: off

    @property
    def in_flight(self) -> int:
        """Requests here in any state: a drained worker waits for this to reach 0."""
        return self.running + self.waiting + self.transferring + self.admitting


@dataclass
class SendStats:
    """A prefill worker's KV pushes since it started, as its sender's `stats` (a copy)
    gives them to `PrefillStats`."""

    writes: int = 0  # posted, as each push's machine counts them (cluster/transfer/push.py)
    pages: int = 0  # distinct pages sent (all their layers)
    bytes: int = 0
    lease_misses: int = 0
    post_s: float = 0.0  # time spent posting WRITEs (on one host, cma copies while posting)


@dataclass(frozen=True)
class PrefillStats:
    epoch: str  # new each time the worker starts: its prefix cache is gone with the old one
    free_pages: int
    num_pages: int
    page_size: int  # tokens a page of this worker's holds
    queued_requests: int  # waiting or prefilling
    prefilling: int  # ... of them, in the engine's running batch
    queued_tokens: int  # prompt tokens queued or prefilling, not yet computed
    transferring: int  # requests whose KV is still being pushed
    sent: SendStats
    # Prompt tokens computed here that the request's decode worker already held (its
    # KVTarget.num_cached_tokens past this worker's own prefix-cache hit), since the start:
    # compute a local prefill there would have skipped, e.g. a conversation's last reply.
    recomputed_tokens: int
    counts: EngineCounts
    s_per_token: float | None  # what a token adds to a step here (StepRate); None: not measured
    metrics_url: str | None  # this worker's own /metrics (EngineConfig.metrics_port); None: off

    @property
    def in_flight(self) -> int:
        """Requests here in any state: a drained worker waits for this to reach 0."""
        return self.queued_requests + self.transferring


class KVEventKind(enum.Enum):
    STORED = "stored"  # a full page of these tokens is now in the worker's prefix cache
    REMOVED = "removed"  # ... and is no longer (its page was evicted for reuse)
    TIER_STORED = "tier_stored"  # a copy of that page is now in the worker's second tier
    TIER_REMOVED = "tier_removed"  # ... and is no longer (evicted LRU, or failed its checksum)


@dataclass(frozen=True)
class KVEvent:
    """A run of hashes with the same kind, in the order the pool changed them."""

    kind: KVEventKind
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class KVEvents:
    """A worker's prefix-cache changes for one reader (cluster/engine/sched/kv_events.py): the
    events since the reader's cursor, or, when `snapshot`, one STORED run of every hash
    the worker's pool holds (and a TIER_STORED run of those its tier holds), to replace
    all the reader had for it. Ask from `next_seq` next,
    with this `epoch` (a new epoch: the worker restarted, its cache is another)."""

    epoch: str
    snapshot: bool
    events: tuple[KVEvent, ...]
    next_seq: int


class Remote(Protocol[P, R]):
    """One remote method of an actor handle: `.remote(...)` takes the method's arguments,
    starts the call and returns its ObjectRef; awaiting that gives the method's result
    (or raises what the call raised, or Ray's error for a dead or unreachable actor)."""

    def remote(self, *args: P.args, **kwargs: P.kwargs) -> ObjectRef[R]: ...


def remote(method: Callable[Concatenate[Any, P], Awaitable[R]]) -> Remote[P, R]:
    """Declares a handle's remote method by writing the actor method's signature (a
    typing device: at run time the attribute is the declared function itself)."""
    return cast("Remote[P, R]", method)


class DecodeHandle(Protocol):
    """A DecodeWorker actor (decode_worker/worker.py, whose docstrings give the contracts)."""

    @remote
    async def submit(self, submission: Submission) -> KVTarget | None: ...

    @remote
    async def transfer_failed(self, request_id: RequestId, why: str) -> bool: ...

    @remote
    async def abort(self, request_id: RequestId) -> RequestStatus | None: ...

    @remote
    async def evict_all(self, why: str) -> int: ...

    @remote
    async def outputs(
        self, reader: str, after: int, timeout_s: float
    ) -> tuple[int, list[TokenDelta]]: ...

    @remote
    async def info(self) -> ModelInfo: ...

    @remote
    async def kv_events(self, epoch: str, after: int) -> KVEvents: ...

    @remote
    async def stats(self) -> DecodeStats: ...


class PrefillHandle(Protocol):
    """A PrefillWorker actor (prefill_worker/worker.py, whose docstrings give the contracts)."""

    @remote
    async def prefill(self, submission: Submission, decode: DecodeHandle) -> FirstToken | None: ...

    @remote
    async def abort(self, request_id: RequestId) -> None: ...

    @remote
    async def abort_all(self) -> int: ...

    @remote
    async def status(self, request_id: RequestId) -> RequestStatus | None: ...

    @remote
    async def info(self) -> ModelInfo: ...

    @remote
    async def kv_events(self, epoch: str, after: int) -> KVEvents: ...

    @remote
    async def stats(self) -> PrefillStats: ...
