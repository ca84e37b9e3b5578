"""The page allocator and the prefix cache: plain Python over page ids, no tensors.

Ownership: a page is referenced by every sequence whose page table holds it. A page
with zero references is *free*; a free page may still hold a cached full page of
tokens (its hash is registered) and is reused by a later request with the same
prefix, or evicted, least recently freed first, when someone needs a page.
Callers free exactly the pages they allocated or matched, once.
Every hash registered or evicted is also an event in its change log
(cluster/engine/sched/kv_events.py), which routers read to know what each worker holds.

With a second tier (`offload_slots` > 0, tier_index.py) every page registered with a hash
the tier lacks gets a tier entry and is put in `spills` for the engine to copy there; the
pool keeps one reference on it for that copy until the engine frees it (KVTier), so an
evicted page is already in the tier. Copying at registration rather than at eviction
keeps the copy out of the allocation that needs the page (which runs inside a step).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from cluster.engine.sched.kv_events import KVEventLog
from cluster.engine.sched.tier_index import TierEntry, TierIndex
from cluster.protocol import KVEvents
from cluster.types import BlockHash, PageId


def pages_for(num_tokens: int, page_size: int) -> int:
    """How many pages hold num_tokens tokens."""
    return -(-num_tokens // page_size)


def hash_pages(
    token_ids: Sequence[int], page_size: int, parent: BlockHash | None = None
) -> list[BlockHash]:
    """Hash chain over the full pages of `token_ids`: each hash covers its tokens and its parent."""
    hashes: list[BlockHash] = []
    arr = np.asarray(token_ids, dtype=np.int64)
    for start in range(0, len(arr) - page_size + 1, page_size):
        h = hashlib.blake2b(digest_size=16)
        if parent is not None:
            h.update(parent)
        h.update(arr[start : start + page_size].tobytes())
        parent = BlockHash(h.digest())
        hashes.append(parent)
    return hashes


class PagePool:
    """Reference-counted pages with an LRU of free pages and a hash -> page prefix index."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        prefix_caching: bool = True,
        event_capacity: int = 16384,  # events kept for readers (KVEventLog)
        offload_slots: int = 0,  # pages the second tier holds; 0: no tier
    ) -> None:
        assert num_pages >= 1 and page_size >= 1
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_pages
        self._free: OrderedDict[PageId, None] = OrderedDict(
            (PageId(i), None) for i in range(num_pages)
        )
        self._page_of_hash: dict[BlockHash, PageId] = {}
        self._hash_of_page: dict[PageId, BlockHash] = {}
        self._events = KVEventLog(event_capacity)
        self.tier = TierIndex(offload_slots, self._events) if offload_slots else None
        self.spills: list[tuple[PageId, TierEntry]] = []  # to copy to the tier, page held
        self.prefix_queries = 0  # tokens looked up by admitted requests
        self.prefix_hits = 0  # of those, tokens found cached

    @property
    def num_free(self) -> int:
        """Pages nobody references (some may hold evictable cached prefixes)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._page_of_hash)

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[PageId]:
        """Take a reference on the longest run of cached pages matching `hashes`."""
        pages: list[PageId] = []
        if self.prefix_caching:
            for h in hashes:
                page = self._page_of_hash.get(h)
                if page is None:
                    break
                pages.append(page)
        for page in pages:
            self._take(page)
        return pages

    def cached_page(self, h: BlockHash) -> PageId | None:
        """The page holding the full page of tokens hashed `h`, if cached."""
        return self._page_of_hash.get(h)

    def count_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading pages of `hashes` are cached, taking no reference."""
        n = 0
        if self.prefix_caching:
            while n < len(hashes) and hashes[n] in self._page_of_hash:
                n += 1
        return n

    def retain(self, pages: Sequence[PageId]) -> None:
        """One more reference on pages someone already references (e.g. a WRITE in flight)."""
        for page in pages:
            assert self._refs[page] > 0, f"page {page} retained while free"
            self._refs[page] += 1

    def count_lookup(self, num_looked_up: int, num_found: int) -> None:
        """Record one admitted request's prefix lookup, in pages, for the hit rate."""
        self.prefix_queries += num_looked_up * self.page_size
        self.prefix_hits += num_found * self.page_size

    def allocate(self, n: int) -> list[PageId] | None:
        """n fresh pages with one reference each, evicting cached ones LRU; None if too few free."""
        if n > len(self._free):
            return None
        pages = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            cached = self._hash_of_page.pop(page, None)
            if cached is not None:
                del self._page_of_hash[cached]
                self._events.removed(cached)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def register(self, page: PageId, h: BlockHash) -> None:
        """Record that `page` now holds the full page of tokens hashed `h`."""
        assert self._refs[page] > 0, "only a referenced page can be registered"
        if not self.prefix_caching or h in self._page_of_hash or page in self._hash_of_page:
            return
        self._page_of_hash[h] = page
        self._hash_of_page[page] = h
        self._events.stored(h)
        if self.tier is not None:
            if h in self.tier:
                self.tier.take([h])  # recomputed or restored: the most recent use
            else:
                self._refs[page] += 1  # the copy's, freed when it is done
                self.spills.append((page, self.tier.add(h)))

    def kv_events(self, epoch: str, reader_epoch: str, after: int) -> KVEvents:
        """The hashes stored and evicted here and in the tier from event `after` on, or a
        snapshot of all held (KVEventLog.read). `epoch` names this pool's life; a reader
        that saw another (`reader_epoch`: a new reader's is "") gets the snapshot."""
        after = after if reader_epoch == epoch else -1
        tier = () if self.tier is None else self.tier.held
        return self._events.read(epoch, after, self._page_of_hash.keys(), tier)

    def free(self, pages: Sequence[PageId]) -> None:
        """Drop one reference on each page; tail pages first so prefixes outlive suffixes."""
        for page in reversed(pages):
            assert self._refs[page] > 0, f"page {page} freed twice"
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None
                if page not in self._hash_of_page:
                    # Holds nothing reusable: hand it out before any cached page.
                    self._free.move_to_end(page, last=False)

    def _take(self, page: PageId) -> None:
        if self._refs[page] == 0:
            del self._free[page]
        self._refs[page] += 1
