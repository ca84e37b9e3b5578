"""Send offsets: Poisson and gamma arrivals from a seed, and everything at once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from splitserve.arrivals import send_offsets


def gaps(offsets: list[float]) -> np.ndarray:
    return np.diff(offsets)


def test_poisson_gaps_average_one_over_the_rate() -> None:
    offsets = send_offsets(20_000, rate=4.0, seed=0)
    assert offsets[0] == 0.0
    assert np.all(gaps(offsets) >= 0)
    assert gaps(offsets).mean() == pytest.approx(0.25, rel=0.03)
    assert gaps(offsets).std() / gaps(offsets).mean() == pytest.approx(1.0, rel=0.05)


def test_the_same_seed_gives_the_same_offsets() -> None:
    assert send_offsets(50, 2.0, seed=7) == send_offsets(50, 2.0, seed=7)
    assert send_offsets(50, 2.0, seed=7) != send_offsets(50, 2.0, seed=8)


def test_a_higher_rate_stretches_the_same_pattern() -> None:
    slow, fast = send_offsets(100, 1.0, seed=3), send_offsets(100, 4.0, seed=3)
    assert fast == pytest.approx([t / 4 for t in slow])


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_mean_and_changes_the_variance(burstiness: float) -> None:
    g = gaps(send_offsets(20_000, rate=2.0, seed=1, burstiness=burstiness))
    assert g.mean() == pytest.approx(0.5, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_an_infinite_rate_sends_everything_at_once() -> None:
    assert send_offsets(5, math.inf, seed=0) == [0.0] * 5
    assert send_offsets(0, 1.0, seed=0) == []


@pytest.mark.parametrize(
    "n, rate, burstiness, field",
    [(-1, 1.0, 1.0, "n"), (3, 0.0, 1.0, "rate"), (3, 1.0, 0.0, "burstiness")],
)
def test_bad_arguments_are_named(n: int, rate: float, burstiness: float, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        send_offsets(n, rate, 0, burstiness)
