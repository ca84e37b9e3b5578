"""What the unit tests of `splitserve serve`'s start-up share. The cluster is imported where a
fixture needs it: the kernel tests collect on a GPU image without Ray, Redis or gRPC
(scripts/gpu-first-run)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What reached the start of Redis, Ray and the workers (a refused start: nothing)."""
    import splitserve.launch

    calls: list[Any] = []

    async def _serve(config: Any) -> None:
        calls.append(config)

    monkeypatch.setattr(splitserve.launch, "_serve", _serve)
    return calls
