"""Workers' stats as plain objects, and a router's metrics over them, for the tests of
what is built from stats (metrics) without Ray."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

from cluster.protocol import DecodeStats, EngineCounts, KVEvents, PrefillStats, SendStats
from cluster.types import ModelInfo
from router.metrics import RouterMetrics
from router.workers import WorkerRegistry

IDLE_DECODE = DecodeStats(
    epoch="e",
    free_pages=100,
    num_pages=100,
    page_size=16,
    running=0,
    waiting=0,
    transferring=0,
    admitting=0,
    queued_tokens=0,
    counts=EngineCounts(0, 0, 0, 0, 0),
    pages_received=0,
    bytes_received=0,
    transfer_failures=0,
    s_per_token=None,
    metrics_url=None,
)


IDLE_PREFILL = PrefillStats(
    epoch="e",
    free_pages=100,
    num_pages=100,
    page_size=16,
    queued_requests=0,
    prefilling=0,
    queued_tokens=0,
    transferring=0,
    sent=SendStats(),
    recomputed_tokens=0,
    counts=EngineCounts(0, 0, 0, 0, 0),
    s_per_token=None,
    metrics_url=None,
)


def decode_stats(**fields: Any) -> DecodeStats:
    """An idle decode worker's stats, with `fields` changed."""
    return dataclasses.replace(IDLE_DECODE, **fields)


def prefill_stats(**fields: Any) -> PrefillStats:
    """An idle prefill worker's stats, with `fields` changed."""
    return dataclasses.replace(IDLE_PREFILL, **fields)


MODEL = ModelInfo("served-smol", 2048, 49152, 16)


async def _value(value: Any) -> Any:
    return value


def stub(stats: DecodeStats | PrefillStats) -> Any:
    """A worker handle that answers its stats and no KV events, as Ray's would."""
    events = KVEvents(stats.epoch, True, (), 0)
    return SimpleNamespace(
        stats=SimpleNamespace(remote=lambda: _value(stats)),
        kv_events=SimpleNamespace(remote=lambda epoch, after: _value(events)),
    )


def router_metrics(
    prefill: dict[str, PrefillStats], decode: dict[str, DecodeStats]
) -> RouterMetrics:
    registry = WorkerRegistry(
        {w: stub(s) for w, s in prefill.items()}, {w: stub(s) for w, s in decode.items()}
    )
    asyncio.run(registry.refresh())
    return RouterMetrics(registry, MODEL)
