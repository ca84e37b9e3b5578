"""What the unit tests of `splitserve serve`'s start-up share."""

from __future__ import annotations

from typing import Any

import pytest

import splitserve.launch


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What reached the start of Redis, Ray and the workers (a refused start: nothing)."""
    calls: list[Any] = []

    async def _serve(config: Any) -> None:
        calls.append(config)

    monkeypatch.setattr(splitserve.launch, "_serve", _serve)
    return calls
