"""A tensor-parallel rank > 0's KV endpoint: peers WRITE its heads into its cache, and it
WRITEs its heads of rank 0's pages into peers' on rank 0's word (cluster/role_worker.py:
RankKV). Its rank only follows rank 0's steps: notices go to rank 0, and nothing else
polls this endpoint, so `progress` keeps UCX moving for it while the rank follows.

Threads: `progress` runs on one thread for the rank's life and `write` on another; the
lock keeps them out of the endpoint at the same time (NIXL's agent is not thread-safe).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cluster.engine.kernels.kv_cache import KVCache
from cluster.transfer.endpoint import KVEndpoint, TransferError
from cluster.transfer.wire import RankPages
from cluster.types import PageId

log = logging.getLogger(__name__)
PROGRESS_NAP_S = 0.002  # between two UCX polls of a rank whose pages peers WRITE into
WRITE_NAP_S = 0.0002  # between two looks at a WRITE of this rank's in flight


class RankEndpoint:
    def __init__(
        self, name: str, cache: KVCache, heads: range, compat: bytes, devices: str, transports: str
    ) -> None:
        """The endpoint `name` over the rank's `cache`, which holds the model's KV `heads`
        (cluster.transfer.endpoint.KVEndpoint, without a progress thread)."""
        self.kv = KVEndpoint(name, cache, compat, devices, transports, False, heads)
        self.lock = threading.Lock()

    @property
    def pages(self) -> RankPages:
        """Where this rank's pages lie, for rank 0's handshake."""
        return self.kv.memory()

    def progress(self, following: Callable[[], bool]) -> None:
        """Poll UCX, with a nap between, while the rank is `following` (a peer's first WRITE
        into it, or its own connection to a peer, waits for this side to answer); NIXL's
        own progress thread would spin a core. A notice that comes here is dropped."""
        while following():
            with self.lock:
                stray = self.kv.notices()
            for notice in stray:
                log.warning("%s: a %s notice for a rank > 0: dropped", self.kv.name, notice.kind)
            time.sleep(PROGRESS_NAP_S)

    def write(self, handshake: bytes, layers: range, src: list[PageId], dst: list[PageId]) -> str:
        """WRITE this rank's heads of pages `src` into the peer's `dst` for `layers`; ""
        once every part has landed, else why not (nothing of it in flight any more)."""
        try:
            with self.lock:
                write = self.kv.write(self.kv.connect(handshake), layers, src, dst, None)
            while True:
                with self.lock:
                    if self.kv.finished(write):
                        return ""
                time.sleep(WRITE_NAP_S)
        except (TransferError, ConnectionError, ValueError) as e:
            return str(e)
