"""What `splitserve lab`'s live view reads from a serving router: GET /lab/live on the
HTTP API (the key guards it as it guards /v1/), one JSON object of what the router
already holds: each live worker's last stats (KV pages in use, running and waiting
requests, prefill queue, KV transfers in flight), the requests in flight with the
workers they are on, and the migrations so far. The page itself and its capacity
explorer are splitserve/lab.py's."""

from __future__ import annotations

import dataclasses
from typing import Any

from cluster.protocol import DecodeStats
from router.metrics import RouterMetrics
from router.router import Router


def live(router: Router, metrics: RouterMetrics) -> dict[str, Any]:
    workers = []
    for name, s in sorted(router.workers.stats().items()):
        row: dict[str, Any] = {
            "name": name,
            "kv_used": s.num_pages - s.free_pages,
            "kv_pages": s.num_pages,
            "transferring": s.transferring,
            "queued_tokens": s.queued_tokens,
        }
        if isinstance(s, DecodeStats):
            row |= {"phase": "decode", "running": s.running, "waiting": s.waiting}
        else:
            row |= {"phase": "prefill", "running": s.prefilling, "waiting": s.queued_requests}
        workers.append(row)
    migrations = metrics.registry.get_sample_value("splitserve_request_migrations_total")
    return {
        "workers": workers,
        "requests": [dataclasses.asdict(r) for r in router.dispatcher.in_flight()],
        "migrations": int(migrations or 0),
    }
