"""A starting worker's weights' loading, from its engine to the bars in `serve`'s
terminal: the worker actor reports every tensor read into Ray's key-value store (its
constructor is still running: no actor method can answer), the pool draws what it reads
there while it awaits the worker, then clears the line and forgets the report."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace
from typing import Any

import ray

from cluster import role_worker
from cluster.config import PoolConfig, TransferConfig
from cluster.engine.model.checkpoint import open_gguf
from cluster.engine.model.model_files import bundled_model_path
from splitserve import pool as pool_module
from splitserve.load_bars import LoadBars


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_worker_reports_every_tensor_of_its_checkpoint_as_read(workers: Any) -> None:
    handle = workers.decode("colocated")
    ray.get(handle.info.remote())  # built
    tensors = len(open_gguf(bundled_model_path()).tensors)
    assert role_worker.loaded("colocated") == (tensors, tensors)


def test_reports_come_at_most_ten_a_second_and_the_last_always(ray_workers: Any) -> None:
    now = [100.0]
    report = role_worker.load_reporter("throttled", clock=lambda: now[0])
    report(1, 10)
    now[0] += 0.05
    report(2, 10)  # within 0.1 s of the last write: dropped
    assert role_worker.loaded("throttled") == (1, 10)
    now[0] += 0.06
    report(3, 10)
    assert role_worker.loaded("throttled") == (3, 10)
    report(10, 10)  # the last, at once
    assert role_worker.loaded("throttled") == (10, 10)
    role_worker.forget_load("throttled")
    assert role_worker.loaded("throttled") is None


def test_the_pool_draws_a_starting_workers_loading_then_clears_and_forgets_it(
    ray_workers: Any, monkeypatch: Any
) -> None:
    """The pool's wait for one worker (its actor replaced by a handle whose info the test
    answers): the bar follows the reports, and the worker's ready line gets a clean line."""
    terminal = Terminal()
    monkeypatch.setattr(pool_module, "BARS", LoadBars(terminal, columns=200))
    pool = pool_module.WorkerPool(pool_module.DECODE, PoolConfig(), TransferConfig(), "bars-")
    name = "bars-decode-0"
    report = role_worker.load_reporter(name)

    async def scenario() -> None:
        info: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        stats = asyncio.get_running_loop().create_future()
        stats.set_result(SimpleNamespace(num_pages=10))
        handle = SimpleNamespace(
            info=SimpleNamespace(remote=lambda: info), stats=SimpleNamespace(remote=lambda: stats)
        )
        ready = asyncio.ensure_future(pool._ready(name, handle))

        async def drawn(share: str) -> bool:
            for _ in range(400):  # the pool reads the reports four times a second
                if terminal.getvalue().endswith(share):
                    return True
                await asyncio.sleep(0.05)
            return False

        report(3, 10)
        assert await drawn(f"{name} [======              ]  30%")
        report(10, 10)
        assert await drawn(f"{name} [====================] 100%")
        info.set_result(SimpleNamespace(name="smol", max_model_len=64, page_size=16))
        await ready

    asyncio.run(scenario())
    assert terminal.getvalue().endswith("\r\x1b[K")  # cleared for the ready line
    assert role_worker.loaded(name) is None  # forgotten
