"""The autoscaler's latency window: p90 of what came in since the last look, then empty."""

from __future__ import annotations

from router.metrics import Window


def test_take_p90_returns_the_90th_percentile_and_empties_the_window() -> None:
    window = Window()
    for ms in range(1, 101):  # 1..100 ms
        window.add(ms / 1000)
    assert abs((window.take_p90() or 0) - 0.0901) < 1e-9  # numpy's linear interpolation
    assert window.take_p90() is None


def test_the_window_keeps_only_the_newest_samples() -> None:
    window = Window(size=3)
    for seconds in (9.0, 9.0, 1.0, 1.0, 1.0):
        window.add(seconds)
    assert window.take_p90() == 1.0
