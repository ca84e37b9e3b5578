"""Shared test helpers: the leak check every engine test ends with."""

from __future__ import annotations

from cluster.engine import LLMEngine


def assert_no_leak(engine: LLMEngine) -> None:
    """Every page is free again and no request is left in the engine."""
    assert not engine.has_unfinished()
    sched = engine.scheduler
    assert not sched.running and not sched.waiting and not sched.transferring
    assert engine.num_free_pages == engine.pool.num_pages, (
        f"{engine.pool.num_pages - engine.num_free_pages} pages still referenced"
    )
