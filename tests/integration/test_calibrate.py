"""`splitserve plan calibrate` on the real bundled model: every grid point is timed (none
waits behind another), and the fit predicts what it was fitted to."""

from __future__ import annotations

import pytest

from cluster.config import EngineConfig
from splitserve import calibrate


def test_calibrate_times_each_point_and_fits_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate, "DECODE_GRID", ((1, 32), (8, 64)))
    monkeypatch.setattr(calibrate, "PREFILL_GRID", (16, 128))
    samples = calibrate.measure(EngineConfig(dtype="bfloat16", threads=1), repeats=2)
    assert [(len(c), p) for c, p, _ in samples] == [
        (0, [(16, 0)]),
        (0, [(128, 0)]),
        (1, []),
        (8, []),
    ]
    assert [c for c, _, _ in samples][2:] == [[33], [65] * 8]
    assert all(0 < s < 10 for _, _, s in samples)
    cost = calibrate.fit(samples, "test")
    assert cost.seconds([], [(128, 0)]) > cost.seconds([], [(16, 0)]) > 0
