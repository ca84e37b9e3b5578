"""API keys as every listener checks them: `Authorization: Bearer <key>`, compared in
constant time, and a key read from a file (a mounted Kubernetes Secret, say). The router's
front doors (router/auth.py) and a worker's own /metrics (cluster/worker_metrics.py) use
these."""

from __future__ import annotations

import hmac
from pathlib import Path

from cluster.config import ConfigError


def authorized(header: str | None, keys: tuple[str, ...]) -> bool:
    """Whether an `authorization` value carries one of these keys (each compared, in
    constant time)."""
    scheme, _, presented = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        presented = ""
    given = presented.strip().encode()
    return any([hmac.compare_digest(given, key.encode()) for key in keys])


def read_key(path: str, field: str) -> str:
    """The key in the file at `path` (stripped); ConfigError naming `field` if it cannot be
    read or is empty."""
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"{field}: cannot read {path}: {e}") from e
    if not key:
        raise ConfigError(f"{field}: {path} is empty")
    return key
