"""The router's tokenization pool: a few threads, and a queue that serves the shortest
input first, so a short prompt never waits behind long ones.

`run(size, fn)` queues `fn` (a request's checks and tokenization) by `size` (its input's
bytes; ties in arrival order) and returns its result once a thread has run it. At most
`threads` run at once; with `max_queued` already waiting, `run` refuses at once
(Overloaded). A caller that goes away before its job starts takes the job with it.
Used from one event loop.

The threads run at NICENESS 19, below Ray's workers (15): the router's own process runs
at 0, which outweighs a niceness-15 engine 28 to 1 on a shared core, so at the router's
niceness a flood of long inputs took the engines' CPU on the router's machine; at 19 it
gets what they leave (measured by `bench chaos --scenario flood`: a normal request during
the flood 1.35-1.45x its idle latency at 19, 1.56-1.62x at 15, two runs each).
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from router.errors import Overloaded

T = TypeVar("T")
NICENESS = 19  # the lowest; Ray's workers run at 15 (RAY_worker_niceness)


@dataclass(order=True)
class _Job:
    size: int
    arrival: int
    fn: Callable[[], Any] = field(compare=False)
    done: asyncio.Future[Any] = field(compare=False)


class TokenizePool:
    def __init__(self, threads: int, max_queued: int) -> None:
        self.threads = threads
        self.max_queued = max_queued
        self._executor = ThreadPoolExecutor(
            threads, thread_name_prefix="tokenize", initializer=_lower_priority
        )
        self._waiting: list[_Job] = []  # a heap: shortest input first
        self._arrivals = itertools.count()
        self._running = 0

    @property
    def queued(self) -> int:
        return len(self._waiting)

    async def run(self, size: int, fn: Callable[[], T]) -> T:
        if len(self._waiting) >= self.max_queued:
            raise Overloaded(
                "max_tokenize_queue",
                f"max_tokenize_queue: {self.max_queued} long inputs wait to be tokenized",
            )
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        job = _Job(size, next(self._arrivals), fn, done)
        heapq.heappush(self._waiting, job)
        self._start()
        try:
            return await done
        finally:
            if job in self._waiting:  # its caller left before it started
                self._waiting.remove(job)
                heapq.heapify(self._waiting)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _start(self) -> None:
        while self._running < self.threads and self._waiting:
            job = heapq.heappop(self._waiting)
            if job.done.cancelled():
                continue
            self._running += 1
            ran = asyncio.wrap_future(self._executor.submit(job.fn))
            ran.add_done_callback(functools.partial(self._finished, job))

    def _finished(self, job: _Job, ran: asyncio.Future[Any]) -> None:
        self._running -= 1
        if not job.done.cancelled():
            if (e := ran.exception()) is not None:
                job.done.set_exception(e)
            else:
                job.done.set_result(ran.result())
        self._start()


def _lower_priority() -> None:
    """Run the calling thread at NICENESS at least (on Linux a niceness is per thread;
    elsewhere it is the process's, and is left alone)."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, max(NICENESS, os.getpriority(os.PRIO_PROCESS, tid)))
