"""`splitserve bench router`'s token path in small: the engine alone and served over HTTP,
both rows reported with a ratio."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from splitserve.bench.router import report_token_path, token_path


def test_the_token_path_times_the_engine_and_the_served_stream(ray_workers: Any) -> None:
    result = asyncio.run(token_path(streams=2, tokens=4, threads=1))
    assert [row["streams"] for row in result["rows"]] == [1, 2] and result["threads"] == 1
    for row in result["rows"]:
        assert row["engine_ms"] > 0 and row["served_ms"] > 0
        assert row["ratio"] == pytest.approx(row["served_ms"] / row["engine_ms"], rel=1e-12)
    lines = report_token_path(result)
    assert lines[-2].startswith("target: served / engine at 1 streams <= 1.15: ")
    assert lines[-1].startswith("target: served / engine at 2 streams <= 1.15: ")
