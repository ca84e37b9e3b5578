"""The second KV tier's bytes: pages copied out of the KV cache and back, beside the steps.

The pool decides what the tier holds (sched/tier_index.py: which hash in which slot, LRU)
and which pages to copy out (PagePool.spills); the scheduler decides what to copy back
(Step.restores). This module moves the bytes, on one copy thread, in the order the copies
were asked for, so a slot is never overwritten before an earlier read of it is done.

Life of a copy:
1. `spill` (a page the pool registered, held by the pool for this copy) and `restore` (the
   fresh pages of a RESTORING request, held here for the copy) queue jobs; the engine
   calls them between its steps, spills before restores.
2. The copy thread moves each page's K and V of every layer, as stored: the per-layer
   slice `cache.k[:, page]` is opaque here (its dtype and layout are the cache's). A spill
   then sets the entry's checksum; a restore first checks it, and copies nothing from an
   entry that fails it.
3. `settle` (engine thread, before each schedule) frees the pages the finished copies
   held, drops the entries that failed (a counted warning) and says how many leading
   pages of each restore came back whole; the request recomputes the rest.

Storage, chosen by measurement (`splitserve bench kv-tier`, docs/benchmarks.md: the
bundled model's bfloat16 KV, 63 pages): host memory copies at 11 GB/s out and 12 back; a
memory-mapped file on local disk as fast through the page cache (13 / 11), which is the
same RAM with the file's faults on top, and 0.14 GB/s out once msync'd to the disk; zlib
level 1 at 0.02 GB/s for a ratio of 1.23. So one host-memory buffer of slots, pinned on a
GPU (copied on a side CUDA stream that waits for the steps that used the pages). The
checksum is zlib.crc32 over the page's BlockHash (its tokens and its parent's) then its
bytes: 1.3-2.3 GB/s against blake2b's 0.4-0.9, so 11-18 us a token, and a restore costs
well under 1/32 of prefilling the token again (1-10 ms a token on this 2-core CPU).
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from dataclasses import dataclass

import torch

from cluster.engine.kernels.kv_cache import KVCache
from cluster.engine.sched.page_pool import PagePool
from cluster.engine.sched.scheduler import Restore
from cluster.engine.sched.sequence import Sequence
from cluster.engine.sched.tier_index import TierEntry
from cluster.protocol import TierCounts
from cluster.types import PageId

log = logging.getLogger(__name__)


@dataclass
class _Spill:
    page: PageId
    entry: TierEntry
    ready: torch.cuda.Event | None  # the step that wrote the page, on a GPU
    ok: bool = False


@dataclass
class _Restore:
    job: Restore
    ready: torch.cuda.Event | None  # the steps that last used the pages, on a GPU
    whole: int = 0  # leading entries copied back whole


def checksum(h: bytes, page: torch.Tensor) -> int:
    """crc32 of a page's BlockHash, then of its bytes (a host tensor)."""
    return zlib.crc32(page.numpy().data, zlib.crc32(h))


class KVTier:
    def __init__(self, pool: PagePool, cache: KVCache) -> None:
        assert pool.tier is not None
        self.pool, self.index, self.cache = pool, pool.tier, cache
        self.page_shape = cache.k[:, 0].shape  # one page of every layer, K or V
        half = cache.k[:, 0].numel() * cache.k.element_size()
        gpu = cache.k.device.type == "cuda"
        self.slots = torch.empty(self.index.num_slots, 2 * half, dtype=torch.uint8, pin_memory=gpu)
        self.bytes_per_entry = 2 * half
        self._stream = torch.cuda.Stream(cache.k.device) if gpu else None
        self._jobs: queue.SimpleQueue[_Spill | _Restore | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Spill | _Restore] = queue.SimpleQueue()
        self._in_flight = 0
        self.spilled_bytes = self.restored_bytes = self.dropped = 0
        self._thread = threading.Thread(target=self._copy_loop, name="kv-tier", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Copies queued or running whose pages are still held."""
        return self._in_flight > 0

    @property
    def counts(self) -> TierCounts:
        index = self.index
        return TierCounts(
            len(index) * self.bytes_per_entry,
            index.queries,
            index.hits,
            self.spilled_bytes,
            self.restored_bytes,
            self.dropped,
        )

    def spill(self) -> None:
        """Queue a copy of each page the pool registered for the tier."""
        spills, self.pool.spills = self.pool.spills, []
        for page, entry in spills:
            self._queue(_Spill(page, entry, self._ready()))

    def restore(self, restores: list[Restore]) -> None:
        """Queue the copies back of a step's restores, after every spill asked for so far."""
        self.spill()
        for job in restores:
            self.pool.retain(job.pages)  # the copy's: the request may end before it is done
            self._queue(_Restore(job, self._ready()))

    def settle(self, wait: bool = False) -> list[tuple[Sequence, int]]:
        """Settle the copies done: free their pages, drop failed entries; each restore's
        request and how many of its leading pages came back whole. `wait`: block until
        one is done if none is and some are in flight."""
        done: list[_Spill | _Restore] = []
        if wait and self._in_flight:
            done.append(self._done.get())
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        restored = []
        for job in done:
            self._in_flight -= 1
            if isinstance(job, _Spill):
                self.pool.free([job.page])
                if not job.ok:
                    self._drop(job.entry, "its copy out failed")
            else:
                restored.append((job.job.seq, job.whole))
                self.pool.free(job.job.pages)
                if job.whole < len(job.job.entries):
                    self._drop(job.job.entries[job.whole], "it failed its checksum")
        return restored

    def close(self) -> None:
        """Stop the copy thread once the copies queued are done."""
        self._jobs.put(None)
        self._thread.join()

    # --- the copy thread ------------------------------------------------------------------

    def _queue(self, job: _Spill | _Restore) -> None:
        self._in_flight += 1
        self._jobs.put(job)

    def _ready(self) -> torch.cuda.Event | None:
        """On a GPU, an event after the work queued so far on the engine's stream."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _copy_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        self._copy(job)
                else:
                    self._copy(job)
            except Exception:  # a tier is a cache: a failed copy costs a recompute
                log.exception("KV tier copy failed")
            self._done.put(job)

    def _copy(self, job: _Spill | _Restore) -> None:
        if job.ready is not None and self._stream is not None:
            self._stream.wait_event(job.ready)
        if isinstance(job, _Spill):
            slot = self.slots[job.entry.slot]
            k, v = self._halves(slot)
            k.copy_(self.cache.k[:, job.page], non_blocking=True)
            v.copy_(self.cache.v[:, job.page], non_blocking=True)
            self._sync()
            job.entry.checksum = checksum(job.entry.hash, slot)
            job.ok = True
            self.spilled_bytes += self.bytes_per_entry
            return
        for entry, page in zip(job.job.entries, job.job.pages, strict=True):
            slot = self.slots[entry.slot]
            if entry.checksum is None or checksum(entry.hash, slot) != entry.checksum:
                break
            k, v = self._halves(slot)
            self.cache.k[:, page].copy_(k, non_blocking=True)
            self.cache.v[:, page].copy_(v, non_blocking=True)
            job.whole += 1
        self._sync()
        self.restored_bytes += job.whole * self.bytes_per_entry

    def _halves(self, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's bytes as the K and the V of one page of every layer."""
        both = slot.view(self.cache.k.dtype).view(2, *self.page_shape)
        return both[0], both[1]

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _drop(self, entry: TierEntry, why: str) -> None:
        self.dropped += 1
        if self.index.drop(entry):
            log.warning("KV tier: dropped the entry in slot %d (%s); recomputing", entry.slot, why)
