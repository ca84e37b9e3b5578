"""Collectives of one node's CPU ranks through shared memory, where gloo's are too slow.

A gloo all-reduce of one decode row costs ~1 ms on a 2-core host (its TCP round trips;
bench offline --tensor-parallel-size): 64 collectives a step made TP=2 decode 0.4x TP=1.
Here each rank writes its tensor into its slot of a shared segment, raises its flag to
the call's number, waits (spinning) until every flag has reached it, and reads every
slot. Slots come in two sets used in turn: a rank can only overwrite a set after every
rank has entered the next call, so after each has read it. Every rank sums the slots in
rank order, so all hold the same bits.

The segment is a file in /dev/shm that rank 0 creates once the ranks have met and removes
as soon as all have mapped it (2 x ranks x 8 MiB; with no room for it, every collective goes
through gloo); a tensor larger than a slot goes through gloo too (every rank sees the
same shapes, so all choose alike). A rank waiting long checks its peers'
processes: a dead one, or engine.collective_timeout_s passed, is GroupLost.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

SLOT_BYTES = 8 << 20  # a decode batch of 64 rows of a 24,576-wide vocabulary slice fits
SHM = Path("/dev/shm")
SPIN_S = 0.02  # then waits sleep, longer and longer up to MAX_NAP_S (an idle follower)
MAX_NAP_S = 0.001
PROBE_S = 1.0  # how often a long wait checks that its peers are alive


class PeerLost(RuntimeError):
    """A rank's process is gone, or did not reach the call in time."""


class SharedExchange:
    def __init__(self, path: Path, rank: int, size: int, timeout_s: float) -> None:
        """Map the segment at `path` (rank 0 `create`s it first); a call inside a step
        waits `timeout_s` at most for the other ranks."""
        self.path, self.rank, self.size, self.timeout_s = path, rank, size, timeout_s
        header = 2 * size * 8  # flags, then pids
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), header + 2 * size * SLOT_BYTES)
        self._flags = np.frombuffer(self._map, np.int64, size, 0)
        self._pids = np.frombuffer(self._map, np.int64, size, size * 8)
        self._pids[rank] = os.getpid()
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=header)
        self._calls = 0

    @staticmethod
    def create(path: Path, size: int) -> bool:
        """Rank 0: the segment, its memory taken now (a full /dev/shm, Docker's 64 MB by
        default, would otherwise fault a write later); False if there is no room."""
        try:
            with open(path, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, 2 * size * 8 + 2 * size * SLOT_BYTES)
        except OSError:
            path.unlink(missing_ok=True)
            return False
        return True

    @staticmethod
    def fits(t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= SLOT_BYTES

    def exchange(self, t: torch.Tensor, patient: bool = False) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype on all), as views of the segment: read
        them before this rank's next call. `patient`: no time limit, only live peers."""
        self._calls += 1
        n = self._calls
        views = [self._slot(n % 2, r, t) for r in range(self.size)]
        views[self.rank].copy_(t)
        self._flags[self.rank] = n
        self._wait(n, patient)
        return views

    def all_reduce(self, x: torch.Tensor) -> None:
        """x summed over the ranks in rank order, in place."""
        parts = self.exchange(x)
        x.copy_(parts[0])
        for p in parts[1:]:
            x.add_(p)

    def close(self) -> None:
        del self._flags, self._pids, self._slots
        with contextlib.suppress(BufferError):  # a view is still held: unmapped with it
            self._map.close()

    def _slot(self, which: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        start = (which * self.size + rank) * SLOT_BYTES
        raw = self._slots[start : start + like.numel() * like.element_size()]
        return raw.view(like.dtype).view(like.shape)

    def _wait(self, n: int, patient: bool) -> None:
        flags = self._flags
        if flags.min() >= n:
            return
        started = time.monotonic()
        probed, nap = started, 0.0
        while flags.min() < n:
            now = time.monotonic()
            if now - started > SPIN_S:
                nap = min(MAX_NAP_S, nap + 1e-5)
                time.sleep(nap)
            if now - probed > PROBE_S:
                probed = now
                self._probe(now - started, patient)

    def _probe(self, waited_s: float, patient: bool) -> None:
        for r, pid in enumerate(self._pids.tolist()):
            if r != self.rank and not _alive(pid):
                raise PeerLost(f"rank {r} (pid {pid}) is gone")
        if not patient and waited_s > self.timeout_s:
            raise PeerLost(f"no rank answered within {self.timeout_s:g} s")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True
