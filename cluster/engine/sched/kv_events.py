"""The prefix cache's change log: which block hashes a page pool (and the second tier behind
it, tier_index.py) stored and evicted, in order.

Routers keep a global prefix index (router/prefix_index.py) from these events. The
contract for a reader:
- Every STORED or REMOVED hash is one event with the next sequence number, from 0 when
  the pool starts. The log keeps the last `capacity` events (a bounded buffer).
- `read(after)` gives the events numbered `after` and on, in order, as runs of one kind.
  A reader that asks from before the oldest event kept (it fell behind, or it is new and
  asks from -1), or from past the newest (it read another log: a restarted worker), gets
  a snapshot instead: every hash held now, as one STORED run (the pool's) and one
  TIER_STORED run (the tier's), to replace what it had.
- Either way the reply says where to ask from next (`next_seq`), so a reader that applies
  each reply in turn holds exactly the hashes the pool holds as of that reply.
Plain Python over hashes; the pool calls `stored` / `removed` on its own thread, and the
worker reads on that thread too.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection

from cluster.protocol import KVEvent, KVEventKind, KVEvents
from cluster.types import BlockHash


class KVEventLog:
    def __init__(self, capacity: int) -> None:
        """Keep the last `capacity` events. The pool's default, 16,384, is 256k tokens of
        churn at 16-token pages between two reads (routers read every 0.1 s), ~2 MB full."""
        assert capacity >= 1
        self._log: deque[tuple[KVEventKind, BlockHash]] = deque(maxlen=capacity)
        self.next_seq = 0  # the number the next event gets

    @property
    def first_seq(self) -> int:
        """The number of the oldest event kept."""
        return self.next_seq - len(self._log)

    def stored(self, h: BlockHash) -> None:
        self._append(KVEventKind.STORED, h)

    def removed(self, h: BlockHash) -> None:
        self._append(KVEventKind.REMOVED, h)

    def tier_stored(self, h: BlockHash) -> None:
        self._append(KVEventKind.TIER_STORED, h)

    def tier_removed(self, h: BlockHash) -> None:
        self._append(KVEventKind.TIER_REMOVED, h)

    def read(
        self,
        epoch: str,
        after: int,
        held: Collection[BlockHash],
        tier_held: Collection[BlockHash] = (),
    ) -> KVEvents:
        """The events numbered `after` and on, or a snapshot of `held` and `tier_held` (every
        hash the pool and the tier hold now) if the log no longer has them all or never had
        them (see the module docstring)."""
        if not self.first_seq <= after <= self.next_seq:
            snapshot = [KVEvent(KVEventKind.STORED, tuple(held))]
            if tier_held:
                snapshot.append(KVEvent(KVEventKind.TIER_STORED, tuple(tier_held)))
            return KVEvents(epoch, True, tuple(snapshot), self.next_seq)
        runs = itertools.groupby(
            itertools.islice(self._log, after - self.first_seq, None), key=lambda e: e[0]
        )
        events = tuple(KVEvent(kind, tuple(h for _, h in run)) for kind, run in runs)
        return KVEvents(epoch, False, events, self.next_seq)

    def _append(self, kind: KVEventKind, h: BlockHash) -> None:
        self._log.append((kind, h))
        self.next_seq += 1
