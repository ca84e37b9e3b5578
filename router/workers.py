"""The router's view of the worker pools: Ray handles by worker id, and their loads.

A background task reads every worker's stats each `interval_s` and builds the Snapshot
the routing policy decides on. Between two reads, the requests this router sent count
too (`routed` ... `finished`), so that a burst does not all go to the worker that
looked idlest at the last read. A worker whose call fails (its actor died) leaves the
snapshot at once and is not routed to again; `on_change` hears when the set of live
decode workers changes (the health service follows it).

Each read also brings the worker's KV events (what its prefix cache stored and evicted
since the last read) into `index`, the prefix index: `cached_tokens` says how much of a
prompt each worker holds. A worker that leaves the registry leaves the index.

The pools (splitserve/pool.py) change the set while serving: `add_decode` or
`add_prefill` a worker once it is ready, `cordon` one to stop routing to it while its
requests finish, `remove` it last.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ray.exceptions import ActorDiedError

from cluster.protocol import (
    DecodeHandle,
    DecodeStats,
    KVEvents,
    PrefillHandle,
    PrefillStats,
)
from router.policy import DecodeLoad, PrefillLoad, Snapshot
from router.prefix_index import PrefixIndex, credited_tokens, prompt_hashes

log = logging.getLogger(__name__)

H = TypeVar("H", DecodeHandle, PrefillHandle)


@dataclass
class _Worker(Generic[H]):
    handle: H
    stats: DecodeStats | PrefillStats | None = None


_AnyWorker = _Worker[DecodeHandle] | _Worker[PrefillHandle]


class WorkerRegistry:
    def __init__(
        self,
        prefill: dict[str, PrefillHandle],
        decode: dict[str, DecodeHandle],
        interval_s: float = 0.1,
    ) -> None:
        self.interval_s = interval_s
        self._prefill = {w: _Worker(h) for w, h in prefill.items()}
        self._decode = {w: _Worker(h) for w, h in decode.items()}
        self._cordoned: set[str] = set()  # still polled, no longer routed to
        self._snapshot = Snapshot((), ())
        self.index = PrefixIndex()
        self._sequences: Counter[str] = Counter()  # this router's requests per decode worker
        self._prompt_tokens: Counter[str] = Counter()  # ... and its tokens per prefill worker
        self._task: asyncio.Task[None] | None = None
        self.on_change: Callable[[int], None] = lambda num_decode: None
        # Ray says a prefill worker is dead (not merely unreachable): no WRITE of it can land.
        self.on_prefill_died: Callable[[PrefillHandle, str], None] = lambda handle, why: None

    async def start(self) -> None:
        """Read every worker's stats once, then keep reading them in the background."""
        await self.refresh()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def decode_handle(self, worker: str) -> DecodeHandle:
        return self._decode[worker].handle

    def prefill_handle(self, worker: str) -> PrefillHandle:
        return self._prefill[worker].handle

    def stats(self) -> dict[str, DecodeStats | PrefillStats]:
        """The last stats read from each live worker. Safe from another thread (a metrics
        scrape): the pools are copied in one step before they are read."""
        return {name: w.stats for name, w in self._workers() if w.stats is not None}

    def names(self, phase: str) -> list[str]:
        """The live workers of a phase ("prefill" or "decode"), cordoned ones included."""
        return list(self._decode if phase == "decode" else self._prefill)

    def cached_tokens(self, prompt_ids: list[int]) -> dict[int, frozenset[str]]:
        """Leading prompt tokens held in a prefix cache, a KV tier's at their cost
        (credited_tokens) -> the workers that hold that many, as of the last read (workers
        holding none are in no group). Each worker's pages are hashed at its own page size
        (its stats say which): a chain of one size matches no other size's blocks."""
        cached: dict[int, frozenset[str]] = {}
        sizes = {s.page_size for _, w in self._workers() if (s := w.stats) is not None}
        for page_size in sorted(sizes):
            chain = prompt_hashes(prompt_ids, page_size)
            for (pool, tier), workers in self.index.overlaps(chain).items():
                tokens = credited_tokens(pool, tier, page_size)
                cached[tokens] = cached.get(tokens, frozenset()) | workers
        return cached

    def in_flight(self, worker: str) -> int:
        """This router's requests on the worker: streams (decode), prompt tokens (prefill)."""
        return self._sequences[worker] + self._prompt_tokens[worker]

    async def add_decode(self, worker: str, handle: DecodeHandle) -> None:
        """Route to a new decode worker from now on (its loads are read first)."""
        await self._add(self._decode, worker, handle)

    async def add_prefill(self, worker: str, handle: PrefillHandle) -> None:
        """Route to a new prefill worker from now on (its loads are read first)."""
        await self._add(self._prefill, worker, handle)

    async def _add(self, pool: dict[str, _Worker[H]], worker: str, handle: H) -> None:
        pool[worker] = _Worker(handle, await handle.stats.remote())
        self._rebuild()

    def cordon(self, worker: str) -> None:
        """Route nothing new to the worker; its requests in flight go on."""
        self._cordoned.add(worker)
        self._rebuild()

    def remove(self, worker: str) -> None:
        """Forget the worker (after a cordon, once it is idle)."""
        self._decode.pop(worker, None)
        self._prefill.pop(worker, None)
        self._cordoned.discard(worker)
        self.index.remove(worker)
        self._rebuild()

    def routed(self, decode: str, prefill: str | None, prompt_tokens: int) -> None:
        """This router sent a request to these workers."""
        self._sequences[decode] += 1
        if prefill is not None:
            self._prompt_tokens[prefill] += prompt_tokens
        self._rebuild()

    def prefilled(self, prefill: str, prompt_tokens: int) -> None:
        """The request's prefill is done (its first token came back)."""
        self._prompt_tokens[prefill] -= prompt_tokens
        self._rebuild()

    def finished(self, decode: str) -> None:
        self._sequences[decode] -= 1
        self._rebuild()

    def mark_dead(self, worker: str, why: str) -> None:
        """Stop routing to `worker` now (a call to it failed)."""
        self._cordoned.discard(worker)
        for pool in (self._decode, self._prefill):
            if pool.pop(worker, None) is not None:
                log.error("worker %s is gone (%s); no longer routing to it", worker, why)
                self.index.remove(worker)
                self._rebuild()

    async def refresh(self) -> None:
        workers = self._workers()
        results = await asyncio.gather(
            *(self._read(name, w) for name, w in workers), return_exceptions=True
        )
        for (name, w), result in zip(workers, results, strict=True):
            if isinstance(result, BaseException):
                prefill = self._prefill.get(name)
                if prefill is w and isinstance(result, ActorDiedError):
                    self.on_prefill_died(prefill.handle, f"prefill worker {name} died: {result}")
                self.mark_dead(name, f"reading its stats failed: {result}")
            elif self._prefill.get(name) is w or self._decode.get(name) is w:  # not removed since
                w.stats, events = result
                self.index.apply(name, events)
        self._rebuild()

    def _workers(self) -> list[tuple[str, _AnyWorker]]:
        """Both pools' workers, copied in one step."""
        return [*self._prefill.items(), *self._decode.items()]

    async def _read(self, name: str, w: _AnyWorker) -> tuple[DecodeStats | PrefillStats, KVEvents]:
        """The worker's stats and its KV events since this registry's last read of them."""
        stats: Awaitable[DecodeStats | PrefillStats] = w.handle.stats.remote()
        return await asyncio.gather(stats, w.handle.kv_events.remote(*self.index.cursor(name)))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # never let the loads go stale silently
                log.exception("reading worker loads failed")

    def _rebuild(self) -> None:
        before = len(self._snapshot.decode)
        decode = tuple(
            DecodeLoad(
                name,
                s.epoch,
                s.free_pages,
                s.num_pages,
                s.page_size,
                s.running,
                max(s.waiting + s.transferring + s.admitting, self._sequences[name] - s.running),
                s.s_per_token,
            )
            for name, w in self._decode.items()
            if isinstance(s := w.stats, DecodeStats) and name not in self._cordoned
        )
        prefill = tuple(
            PrefillLoad(
                name,
                s.epoch,
                max(s.queued_tokens, self._prompt_tokens[name]),
                s.s_per_token,
                s.sent.post_s / (s.sent.pages * s.page_size) if s.sent.pages else None,
            )
            for name, w in self._prefill.items()
            if isinstance(s := w.stats, PrefillStats) and name not in self._cordoned
        )
        self._snapshot = Snapshot(decode, prefill)
        if len(decode) != before:
            self.on_change(len(decode))
