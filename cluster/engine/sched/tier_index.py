"""Which block hashes the second KV tier holds, in which slot, least recently used first.

Plain Python over hashes and slot numbers, no bytes (cluster/engine/kv_tier.py moves
those). The tier is a cache behind the page pool (DESIGN.md: tiers are caches, never the
truth): an entry is a copy of one full page's KV, K and V of every layer, that can always
be recomputed. Contract:
- `add(h)` gives a new entry a slot, evicting the least recently used entry when all
  slots are taken; the caller then writes the slot. The entry's checksum is None until
  the write is done (set by the writer): an entry without one is not served.
- `take(hashes)` is a prefix hit: the leading run of `hashes` held, each made the most
  recently used. `count_prefix` counts that run without touching the order.
- `drop(entry)` forgets an entry that failed (its write, or its checksum on a read) if it
  is still the one held for its hash; its slot is free again.
A slot is reused only by `add`, on the engine's thread; whoever moves the bytes does so in
the order the calls were made (one copy thread), so a read queued before the write that
reuses its slot reads the old bytes.
Every entry added or removed is an event in the pool's log (kv_events.py) as
TIER_STORED / TIER_REMOVED, which routers read to count tier hits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from cluster.engine.sched.kv_events import KVEventLog
from cluster.types import BlockHash


@dataclass(eq=False)
class TierEntry:
    hash: BlockHash  # the page's BlockHash: its tokens and its parent's
    slot: int
    checksum: int | None = None  # of the hash and the slot's bytes; None: not written yet


class TierIndex:
    def __init__(self, num_slots: int, events: KVEventLog) -> None:
        assert num_slots >= 1
        self.num_slots = num_slots
        self._entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self._events = events
        self.queries = 0  # tokens admitted requests looked up here (the pool lacked them)
        self.hits = 0  # of those, tokens found here

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, h: BlockHash) -> bool:
        return h in self._entries

    @property
    def held(self) -> Collection[BlockHash]:
        return self._entries.keys()

    def count_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading `hashes` the tier holds, touching nothing."""
        n = 0
        while n < len(hashes) and hashes[n] in self._entries:
            n += 1
        return n

    def take(self, hashes: Sequence[BlockHash]) -> list[TierEntry]:
        """The entries of the leading run of `hashes` held, each now the most recently used."""
        taken = []
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None:
                break
            self._entries.move_to_end(h)
            taken.append(entry)
        return taken

    def count_lookup(self, num_looked_up: int, num_found: int) -> None:
        """Record one admitted request's lookup here, in tokens, for the hit rate."""
        self.queries += num_looked_up
        self.hits += num_found

    def add(self, h: BlockHash) -> TierEntry:
        """A new entry for `h` (not held) in a free slot, or in the least recently used one's."""
        assert h not in self._entries, "a held hash is added again"
        if not self._free:
            _, lru = self._entries.popitem(last=False)
            self._events.tier_removed(lru.hash)
            self._free.append(lru.slot)
        entry = self._entries[h] = TierEntry(h, self._free.pop())
        self._events.tier_stored(h)
        return entry

    def drop(self, entry: TierEntry) -> bool:
        """Forget a failed entry if it is still the one held for its hash; True if it was."""
        if self._entries.get(entry.hash) is not entry:
            return False
        del self._entries[entry.hash]
        self._free.append(entry.slot)
        self._events.tier_removed(entry.hash)
        return True
