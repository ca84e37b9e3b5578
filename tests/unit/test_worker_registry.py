"""The router's WorkerRegistry reads each worker's page size from its own stats: its
prefix hits are counted in its pages, and its load carries its size."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from cluster.protocol import DecodeStats, KVEvent, KVEventKind, KVEvents
from router.prefix_index import prompt_hashes
from router.workers import WorkerRegistry
from tests.unit.worker_stats import _value, decode_stats

PROMPT = list(range(100, 165))  # 65 tokens: 4 pages of 16 or 2 of 32 before the last token


def holding(stats: DecodeStats, prompt: list[int]) -> Any:
    """A worker handle whose prefix cache holds `prompt`'s full pages at its page size."""
    stored = KVEvent(KVEventKind.STORED, tuple(prompt_hashes(prompt, stats.page_size)))
    events = KVEvents(stats.epoch, True, (stored,), 1)
    return SimpleNamespace(
        stats=SimpleNamespace(remote=lambda: _value(stats)),
        kv_events=SimpleNamespace(remote=lambda epoch, after: _value(events)),
    )


def test_each_workers_prefix_is_hashed_and_counted_at_its_own_page_size() -> None:
    small, large = decode_stats(page_size=16), decode_stats(page_size=32)
    registry = WorkerRegistry(
        {}, {"d16": holding(small, PROMPT), "d32": holding(large, PROMPT[:40])}
    )
    asyncio.run(registry.refresh())
    # d16 holds 4 pages of 16 of the prompt; d32 one page of 32 (its second is not full).
    assert registry.cached_tokens(PROMPT) == {64: frozenset({"d16"}), 32: frozenset({"d32"})}
    loads = {load.worker: load.page_size for load in registry.snapshot().decode}
    assert loads == {"d16": 16, "d32": 32}
