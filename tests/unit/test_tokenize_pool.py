"""router/tokenize_pool.py: the shortest input waiting goes first, a full queue refuses at
once, and a job whose caller left never runs."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading

import pytest

from router.errors import Overloaded
from router.tokenize_pool import NICENESS, TokenizePool
from tests.helpers import until


async def _wait_for(pool: TokenizePool, queued: int) -> None:
    async def probe() -> bool:
        return pool.queued == queued

    await until(probe, f"{queued} jobs waiting")


def test_the_shortest_waiting_input_runs_first() -> None:
    ran: list[int] = []
    release = threading.Event()

    async def go() -> None:
        pool = TokenizePool(threads=1, max_queued=8)
        blocker = asyncio.ensure_future(pool.run(10**9, release.wait))  # holds the thread
        jobs = [asyncio.ensure_future(pool.run(n, functools.partial(ran.append, n)))
                for n in (5000, 40, 900, 40, 7)]  # fmt: skip
        await _wait_for(pool, 5)
        release.set()
        await asyncio.gather(blocker, *jobs)
        pool.close()

    asyncio.run(go())
    assert ran == [7, 40, 40, 900, 5000]


def test_a_full_queue_refuses_at_once_naming_the_limit() -> None:
    release = threading.Event()

    async def go() -> None:
        pool = TokenizePool(threads=1, max_queued=2)
        held = [asyncio.ensure_future(pool.run(1, release.wait)) for _ in range(3)]
        await _wait_for(pool, 2)  # one runs, two wait
        with pytest.raises(Overloaded) as refused:
            await pool.run(1, lambda: None)
        assert refused.value.limit == "max_tokenize_queue"
        release.set()
        assert await asyncio.gather(*held) == [True, True, True]
        pool.close()

    asyncio.run(go())


def test_a_job_whose_caller_left_leaves_the_queue_and_never_runs() -> None:
    ran: list[str] = []
    release = threading.Event()

    async def go() -> None:
        pool = TokenizePool(threads=1, max_queued=4)
        blocker = asyncio.ensure_future(pool.run(1, release.wait))
        left = asyncio.ensure_future(pool.run(2, lambda: ran.append("left")))
        stays = asyncio.ensure_future(pool.run(3, lambda: ran.append("stays")))
        await _wait_for(pool, 2)
        left.cancel()
        await _wait_for(pool, 1)
        release.set()
        await asyncio.gather(blocker, stays)
        pool.close()

    asyncio.run(go())
    assert ran == ["stays"]


def test_an_error_in_a_job_reaches_its_caller_and_the_pool_goes_on() -> None:
    def bad() -> None:
        raise ValueError("bad input")

    async def go() -> int:
        pool = TokenizePool(threads=1, max_queued=4)
        with pytest.raises(ValueError, match="bad input"):
            await pool.run(1, bad)
        result = await pool.run(1, lambda: 7)
        pool.close()
        return result

    assert asyncio.run(go()) == 7


@pytest.mark.skipif(sys.platform != "linux", reason="a niceness is per thread on Linux only")
def test_jobs_run_at_the_engines_niceness_and_the_router_thread_keeps_its_own() -> None:
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def go() -> int:
        pool = TokenizePool(threads=1, max_queued=4)
        seen = await pool.run(1, niceness)
        pool.close()
        return seen

    mine = niceness()
    assert asyncio.run(go()) == max(NICENESS, mine)
    assert niceness() == mine
