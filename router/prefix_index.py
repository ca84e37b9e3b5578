"""Which worker holds which prefix: a global index of block hashes, fed by KV events.

Each worker's page pool logs the hashes of the full pages it stores and evicts
(cluster/engine/sched/kv_events.py); the WorkerRegistry reads each worker's log every poll and
`apply`s the reply here. A worker that restarted (new epoch) or whose log dropped events
this reader had not read answers with a snapshot, which replaces all the index had for
it; a worker that is gone is `remove`d. The index is a function of the replies alone, so
routers that read the same workers hold the same index, whenever each one started.

`overlaps(chain)` answers, for a request's hash chain (`prompt_hashes`: its full pages,
hashed as the engine hashes them), how many leading pages each worker holds in its pool
and how many more in its KV tier (TIER_STORED events; cluster/engine/kv_tier.py): the
prefix that worker would not recompute. A run stops at the first page a worker lacks, as
the engine's own lookup does: the pool's run first, then the tier's from where it ended.
The answer groups the workers by those counts: with a system prompt every worker holds,
it is a group or two whatever the number of workers, and the groups (sets of names, one
per distinct set of worker slots) are built once and reused. `credited_tokens` prices a
tier page at its measured cost against a recomputed one.

Memory: one dict entry per distinct hash (the hash, and its holders as a bitmask over
worker slots) plus one set entry per (worker, hash); bounded by what the workers hold,
at most the sum of their pages. Measured with tracemalloc (16-byte hashes, the hash
objects included): 125 MB per million blocks over 2 workers, 191 MB over 128 (wider
masks); a block held by two workers costs 158 bytes, not 125.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.engine.sched.page_pool import hash_pages
from cluster.protocol import KVEventKind, KVEvents
from cluster.types import BlockHash

# What restoring a token from a KV tier costs, as a share of computing it: 0.002-0.02
# measured on a 2-core CPU (the bundled model: 2-3 us to copy a token's KV back and 11-20
# us to check its crc32, against 1-10 ms to prefill it; `splitserve bench kv-tier`), the
# upper end rounded up.
TIER_TOKEN_COST = 1 / 32


def credited_tokens(pool_pages: int, tier_pages: int, page_size: int) -> int:
    """The prompt tokens a worker holding this many leading pages in its pool, then in its
    tier, is credited with: a tier token saves all but its restore's cost. (The policy's
    fit counts credited tokens as held, so it undercounts the pool pages a restore takes;
    a worker short of them holds the request waiting, as after any misjudged fit.)"""
    return int((pool_pages + tier_pages * (1 - TIER_TOKEN_COST)) * page_size)


def prompt_hashes(prompt_ids: Sequence[int], page_size: int) -> list[BlockHash]:
    """The chain of the prompt's pages a worker could reuse: its full pages but for the
    last token, whose KV the engine always computes (Scheduler.cached_prefix)."""
    return hash_pages(prompt_ids[: len(prompt_ids) - 1], page_size)


@dataclass
class _Held:
    slot: int  # the worker's bit in the holder masks
    epoch: str = ""  # "": nothing read yet
    next_seq: int = -1
    hashes: set[BlockHash] = field(default_factory=set)
    tier: set[BlockHash] = field(default_factory=set)  # those its KV tier holds


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, int] = {}  # hash -> mask of the slots holding it
        self._tier_holders: dict[BlockHash, int] = {}  # ... in their KV tier
        self._held: dict[str, _Held] = {}
        self._names: dict[int, str] = {}  # slot -> worker
        self._slots = 0  # mask of the slots taken
        self._groups: dict[int, frozenset[str]] = {}  # mask of slots -> their workers

    def __len__(self) -> int:
        """Distinct hashes held by any worker."""
        return len(self._holders)

    def cursor(self, worker: str) -> tuple[str, int]:
        """(epoch, after) to ask the worker's kv_events with; a worker not read yet gets a
        snapshot."""
        held = self._held.get(worker)
        return ("", -1) if held is None else (held.epoch, held.next_seq)

    def held(self, worker: str) -> int:
        """How many hashes the index has for the worker."""
        held = self._held.get(worker)
        return 0 if held is None else len(held.hashes)

    def apply(self, worker: str, reply: KVEvents) -> None:
        """The worker's answer to kv_events(*cursor(worker)): from now on the index holds
        for it what the worker held when it answered."""
        held = self._held.get(worker) or self._add(worker)
        assert reply.snapshot or reply.epoch == held.epoch, (
            f"{worker}: events of epoch {reply.epoch} applied over epoch {held.epoch!r}"
        )
        if reply.snapshot:
            for tier, kind in ((False, KVEventKind.STORED), (True, KVEventKind.TIER_STORED)):
                now = {h for e in reply.events if e.kind is kind for h in e.hashes}
                had = held.tier if tier else held.hashes
                self._drop(held, had - now, tier)
                self._store(held, now - had, tier)
        else:
            for event in reply.events:
                tier = event.kind in (KVEventKind.TIER_STORED, KVEventKind.TIER_REMOVED)
                if event.kind in (KVEventKind.STORED, KVEventKind.TIER_STORED):
                    self._store(held, event.hashes, tier)
                else:
                    self._drop(held, event.hashes, tier)
        held.epoch, held.next_seq = reply.epoch, reply.next_seq

    def remove(self, worker: str) -> None:
        """Forget the worker and everything it held (it is gone)."""
        held = self._held.pop(worker, None)
        if held is not None:
            self._drop(held, set(held.hashes), False)
            self._drop(held, set(held.tier), True)
            del self._names[held.slot]
            self._slots &= ~(1 << held.slot)
            self._groups.clear()  # the slot may go to another worker

    def overlaps(self, chain: Sequence[BlockHash]) -> dict[tuple[int, int], frozenset[str]]:
        """(leading pages of `chain` held in the pool, pages after them held in the tier)
        -> the workers that hold exactly that many (the workers that hold none are in no
        group)."""
        found: dict[tuple[int, int], frozenset[str]] = {}
        holders = self._holders.get
        alive = self._slots
        depth = 0
        while alive and depth < len(chain):
            still = alive & holders(chain[depth], 0)
            if still != alive:
                self._tier_run(found, chain, alive & ~still, depth)
                alive = still
            depth += 1
        self._record(found, alive, (depth, 0))
        return found

    def _tier_run(
        self,
        found: dict[tuple[int, int], frozenset[str]],
        chain: Sequence[BlockHash],
        slots: int,
        start: int,
    ) -> None:
        """Record the workers of `slots`, whose pool run ends at `start`, by their tier's
        run from there."""
        holders = self._tier_holders.get
        depth = start
        while slots and depth < len(chain) and self._tier_holders:
            still = slots & holders(chain[depth], 0)
            if still != slots:
                self._record(found, slots & ~still, (start, depth - start))
                slots = still
            depth += 1
        self._record(found, slots, (start, depth - start))

    def _record(
        self, found: dict[tuple[int, int], frozenset[str]], slots: int, depth: tuple[int, int]
    ) -> None:
        if slots and depth != (0, 0):
            found[depth] = self._group(slots)

    def _group(self, slots: int) -> frozenset[str]:
        """The workers in a mask of slots, built once per mask while the slots keep their
        workers (a handful of masks recur: who holds the common prefixes)."""
        group = self._groups.get(slots)
        if group is None:
            if len(self._groups) >= 4096:
                self._groups.clear()
            group = self._groups[slots] = frozenset(
                self._names[i] for i in range(slots.bit_length()) if slots >> i & 1
            )
        return group

    def _add(self, worker: str) -> _Held:
        slot = next(i for i in range(len(self._names) + 1) if i not in self._names)
        self._names[slot] = worker
        self._slots |= 1 << slot
        held = self._held[worker] = _Held(slot)
        return held

    def _store(
        self, held: _Held, hashes: Sequence[BlockHash] | set[BlockHash], tier: bool = False
    ) -> None:
        bit = 1 << held.slot
        holders = self._tier_holders if tier else self._holders
        mine = held.tier if tier else held.hashes
        for h in hashes:
            if h not in mine:
                mine.add(h)
                holders[h] = holders.get(h, 0) | bit

    def _drop(
        self, held: _Held, hashes: Sequence[BlockHash] | set[BlockHash], tier: bool = False
    ) -> None:
        bit = 1 << held.slot
        holders = self._tier_holders if tier else self._holders
        mine = held.tier if tier else held.hashes
        for h in hashes:
            if h in mine:
                mine.discard(h)
                mask = holders[h] & ~bit
                if mask:
                    holders[h] = mask
                else:
                    del holders[h]
