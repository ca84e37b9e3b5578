"""Outboxes: each reader's deltas, numbered, until the reader acknowledges them.

A reader (one Dispatcher: one router process) submits requests; the decode worker knows
whose each request is, and its engine thread publishes each delta into that reader's
box; the reader long-polls its own box from the actor's event loop. Readers never see,
or drop, each other's deltas. A box whose reader stopped asking and that has no live
request (claimed, and not yet finished or forgotten) is removed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.types import TokenDelta


@dataclass
class _Box:
    last_read: float  # on the Outboxes' clock
    deltas: list[TokenDelta] = field(default_factory=list)  # not yet acknowledged
    base: int = 0  # the number of deltas[0]
    live: int = 0  # requests claimed and not finished
    fresh: bool = True  # not read yet: numbered from wherever its reader's cursor is
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Outboxes:
    def __init__(self, idle_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s  # on `clock`, seconds
        self._clock = clock
        self._boxes: dict[str, _Box] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def claim(self, reader: str) -> None:
        """`reader` submitted a request: its box stays until the request's last delta."""
        with self._lock:
            self._box(reader).live += 1

    def forget(self, reader: str) -> None:
        """A claim that will get no delta (its request was refused)."""
        with self._lock:
            self._boxes[reader].live -= 1

    def publish(self, deltas: list[tuple[str, TokenDelta]]) -> None:
        """From any thread: file each delta with its reader (one that claimed its request;
        a finishing delta ends the claim) and wake the reader."""
        woken: list[_Box] = []
        with self._lock:
            for reader, delta in deltas:
                box = self._boxes[reader]
                box.deltas.append(delta)
                if delta.finish_reason is not None:
                    box.live -= 1
                woken.append(box)
        if self._loop is not None:
            for box in woken:
                self._loop.call_soon_threadsafe(box.wake.set)

    async def read(self, reader: str, after: int, timeout_s: float) -> tuple[int, list[TokenDelta]]:
        """`reader`'s deltas numbered `after` and on (waiting up to timeout_s for one), and
        the number to ask from next. Asking from `after` acknowledges the ones before it."""
        self._loop = asyncio.get_running_loop()
        with self._lock:
            self._sweep()
            box = self._box(reader)
            if box.fresh:  # also a box swept while its reader was away: carry on numbering
                box.base, box.fresh = after, False
        while box.base + len(box.deltas) <= after:
            box.wake.clear()
            try:
                await asyncio.wait_for(box.wake.wait(), timeout_s)
            except TimeoutError:
                break
        with self._lock:
            box.last_read = self._clock()
            drop = min(max(0, after - box.base), len(box.deltas))
            del box.deltas[:drop]
            box.base += drop
            return box.base + len(box.deltas), list(box.deltas)

    def _box(self, reader: str) -> _Box:
        if reader not in self._boxes:
            self._boxes[reader] = _Box(self._clock())
        return self._boxes[reader]

    def _sweep(self) -> None:
        idle = self._clock() - self.idle_s
        for reader, box in list(self._boxes.items()):
            if box.live == 0 and box.last_read < idle:
                del self._boxes[reader]
