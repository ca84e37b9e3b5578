"""WorkerLoop: the engine is built and stepped on one thread (torch's parallel work must
start from one thread: a second OpenMP team slows every op), and no round runs before
`start`."""

from __future__ import annotations

import threading

from cluster.worker_loop import WorkerLoop
from tests.helpers import wait_until


def test_what_is_built_before_start_and_every_round_run_on_the_same_thread() -> None:
    loop = WorkerLoop(name="engine-thread")
    rounds: list[str] = []
    built = loop.call_blocking(lambda: threading.current_thread().name, None)
    assert built == "engine-thread" and rounds == []

    def tick() -> float:
        rounds.append(threading.current_thread().name)
        return 0.001

    loop.start(tick)
    wait_until(lambda: len(rounds) >= 3, "three rounds", 10)
    assert set(rounds) == {built}
