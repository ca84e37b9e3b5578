"""The thread a worker actor's engine runs on, and how async actor methods reach it.

An actor's asyncio methods never touch the engine: they hand a function to `call`,
which runs it on the engine thread between two steps and returns its result. The engine
is built on that thread too (`call_blocking`), before `start`: torch's parallel work must
all start from one thread, as a second OpenMP team in the process (weights loaded on one
thread, steps run on another) measured every op ~40% slower on a 2-core host (libgomp
throttles its spin-wait once its threads outnumber the cores). A method
that waits longer (for a reservation, a first token) awaits a future of its own, which
the engine thread resolves with `settle` or `fail`. The thread loops `tick` (one engine
step plus transfer bookkeeping); tick says how long it may sleep before the next round,
and a call wakes it earlier.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from cluster.engine.model.tensor_parallel import GroupLost

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerLoop:
    def __init__(self, name: str) -> None:
        """Runs calls only, until `start` gives it its rounds of work."""
        self._tick: Callable[[], float] = lambda: 0.05
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def start(self, tick: Callable[[], float]) -> None:
        """`tick()` does one round of work and returns the seconds it may sleep (0: busy)."""
        self._tick = tick

    async def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread; its result or its exception comes back here."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                result = fn()
            except Exception as e:
                fail(done, e)
            else:
                settle(done, result)

        self._calls.put(run)
        return await done

    def call_blocking(self, fn: Callable[[], T], timeout_s: float | None) -> T:
        """`call` for a thread outside the actor's event loop (the constructor, a /metrics
        scrape): blocks it until fn has run on the engine thread, at most timeout_s (then
        TimeoutError; None: no limit)."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as e:  # a split model's GroupLost at start-up too
                done.set_exception(e)

        self._calls.put(run)
        return done.result(timeout_s)

    def _run(self) -> None:
        wait = 0.0
        while True:
            try:
                fn = self._calls.get(timeout=wait)
            except queue.Empty:
                pass
            else:
                fn()
                while not self._calls.empty():
                    self._calls.get()()
            try:
                wait = self._tick()
            except GroupLost:  # a rank of its model is gone: the pool replaces the worker
                log.critical(
                    "a rank of this worker's model is lost; the worker ends", exc_info=True
                )
                os._exit(70)
            except Exception:  # a bug in one round must not stop the worker for good
                log.exception("worker loop round failed")
                wait = 0.01


def settle(done: asyncio.Future[T], result: T) -> None:
    """From any thread: `done` gets `result`, unless it is done already (cancelled)."""
    done.get_loop().call_soon_threadsafe(_set, done, result, None)


def fail(done: asyncio.Future[Any], error: BaseException) -> None:
    """From any thread: `done` raises `error`, unless it is done already (cancelled)."""
    done.get_loop().call_soon_threadsafe(_set, done, None, error)


def _set(done: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(result)
    else:
        done.set_exception(error)
