"""StepRate: the slope of step seconds over step tokens, fitted online."""

from __future__ import annotations

import pytest

from cluster.engine.sched.step_rate import StepRate


def test_the_slope_of_steps_on_a_line() -> None:
    rate = StepRate()
    for n in (1, 8, 64, 256, 3, 128) * 5:
        rate.observe(0.020 + 0.001 * n, n)
    assert rate.per_token == pytest.approx(0.001)


def test_steps_all_alike_say_nothing() -> None:
    rate = StepRate()
    assert rate.per_token is None
    for _ in range(50):
        rate.observe(0.05, 16)
    assert rate.per_token is None


def test_a_falling_line_reads_as_free() -> None:
    rate = StepRate()
    for n in (10, 100) * 10:
        rate.observe(1.0 - 0.001 * n, n)
    assert rate.per_token == 0.0


def test_old_steps_are_forgotten() -> None:
    """After the engine gets 4x slower per token, the fit follows within a few hundred steps
    (a memory of about 1 / (1 - decay) = 100 steps)."""
    rate = StepRate(decay=0.99)
    sizes = (1, 32, 256, 64)
    for n in sizes * 100:
        rate.observe(0.01 + 0.001 * n, n)
    for n in sizes * 200:
        rate.observe(0.01 + 0.004 * n, n)
    assert rate.per_token == pytest.approx(0.004, rel=0.01)
