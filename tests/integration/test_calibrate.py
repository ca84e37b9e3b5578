"""`splitserve plan calibrate` on the real bundled model: every grid point is timed alone,
prefills and decodes in turn, the fit predicts what it was fitted to, and the run stops at
its budget (time driven by a fake clock) with what it has."""

from __future__ import annotations

import itertools

import pytest

from cluster.config import ConfigError, EngineConfig
from splitserve import calibrate

ENGINE = EngineConfig(dtype="float32", threads=1, kv_cache_gb=0.25)


@pytest.fixture
def small_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate, "DECODE_GRID", ((1, 32), (8, 64)))
    monkeypatch.setattr(calibrate, "PREFILL_GRID", (16, 128))


def test_calibrate_times_each_point_and_fits_them(small_grid: None) -> None:
    run = calibrate.measure(ENGINE, budget_s=float("inf"), repeats=2)
    assert run.points == 4
    assert [(c, p) for c, p, _ in run.samples] == [
        ([], [(16, 0)]),
        ([33], []),
        ([], [(128, 0)]),
        ([65] * 8, []),
    ]
    assert all(s > 0 for _, _, s in run.samples)
    cost = calibrate.fit(run.samples, "test")
    assert cost.seconds([], [(128, 0)]) > cost.seconds([], [(16, 0)]) > 0


def test_calibrate_starts_no_point_past_its_budget(small_grid: None) -> None:
    # Every clock read is a second on: the start, then per point a check and one timed
    # step (two reads). Points start at 1 s and 4 s; the third's check reads 7 s > 5 s.
    ticks = itertools.count()
    run = calibrate.measure(ENGINE, budget_s=5, repeats=1, clock=lambda: float(next(ticks)))
    assert [(c, p) for c, p, _ in run.samples] == [([], [(16, 0)]), ([33], [])]
    assert run.points == 4 and run.seconds == 8


def test_a_budget_too_short_for_two_points_is_a_clear_error(small_grid: None) -> None:
    with pytest.raises(ConfigError, match="budget_s: 0 s ran out after 0 timed steps"):
        calibrate.calibrate(ENGINE, budget_s=0)
