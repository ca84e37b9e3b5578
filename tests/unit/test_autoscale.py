"""Autoscaling decisions: pressure, hysteresis, cooldown and bounds, tick by tick."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, ScalingConfig
from splitserve.autoscale import (
    DecodeSignals,
    PrefillSignals,
    ScalerState,
    decide,
    pressure,
)

CFG = ScalingConfig(min_replicas=1, max_replicas=3, up_ticks=2, down_ticks=3, cooldown_s=10)


def prefill(replicas: int, queued: int, ttft: float | None = None) -> PrefillSignals:
    return PrefillSignals(replicas, queued, ttft)


def run(signals: list[PrefillSignals | DecodeSignals], config: ScalingConfig = CFG) -> list[int]:
    """Feed one signal per second, the pool following each decision; the replica counts."""
    state, replicas, out = ScalerState(), signals[0].replicas, []
    for t, s in enumerate(signals):
        s = type(s)(replicas, *[getattr(s, f) for f in s.__dataclass_fields__][1:])
        d = decide(config, s, state, float(t))
        state, replicas = d.state, d.replicas
        out.append(replicas)
    return out


@pytest.mark.parametrize(
    "signals, expected",
    [
        (prefill(1, 0), 0.0),
        (prefill(1, 4096), 1.0),
        (prefill(2, 4096), 0.5),
        (prefill(1, 0, ttft=4.0), 2.0),  # TTFT twice the SLO
        (DecodeSignals(1, 0.85, 0, None), 1.0),
        (DecodeSignals(2, 0.1, 32, None), 2.0),  # 16 waiting per replica, target 8
        (DecodeSignals(1, 0.1, 0, 0.5), 2.0),  # TPOT twice the SLO
    ],
)
def test_pressure_is_the_worst_signal_relative_to_its_target(
    signals: PrefillSignals | DecodeSignals, expected: float
) -> None:
    assert pressure(CFG, signals) == pytest.approx(expected)


@pytest.mark.parametrize(
    "queued, expected",
    [
        # sustained overload: up after up_ticks, then cooldown, then up again to max
        ([9000] * 14, [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3]),
        # a noisy signal crossing the target every other tick never scales
        ([9000, 100, 9000, 100, 9000, 100, 9000, 100], [1] * 8),
        # inside the band (between down_below and target) nothing moves
        ([3000] * 12, [1] * 12),
        # idle at the minimum stays there
        ([0] * 6, [1] * 6),
    ],
)
def test_prefill_scaling_tick_by_tick(queued: list[int], expected: list[int]) -> None:
    assert run([prefill(1, q) for q in queued]) == expected


def test_idleness_scales_down_one_at_a_time_after_the_cooldown() -> None:
    # down after down_ticks (t=2); the 10 s cooldown holds until t=12; never below min
    assert run([prefill(3, 0)] * 20) == [3, 3] + [2] * 10 + [1] * 8


def test_a_noisy_idle_signal_does_not_flap_down_and_up() -> None:
    noisy = [0, 5000, 0, 5000, 0, 5000, 0, 5000, 0, 5000]  # pressure 0, 0.6 (inside the band)
    assert run([prefill(2, q) for q in noisy]) == [2] * 10


def test_below_min_is_restored_at_once_even_in_cooldown() -> None:
    state = ScalerState(changed_at=0.0)
    d = decide(ScalingConfig(min_replicas=2, max_replicas=4), prefill(1, 0), state, 1.0)
    assert (d.replicas, d.reason) == (2, "below min")


def test_at_max_the_decision_says_so_and_holds() -> None:
    config = ScalingConfig(min_replicas=1, max_replicas=1, up_ticks=1)
    d = decide(config, prefill(1, 50_000), ScalerState(), 0.0)
    assert (d.replicas, d.reason) == (1, "at max")


def test_decode_scales_on_kv_usage_and_tpot() -> None:
    assert run([DecodeSignals(1, 0.95, 0, None)] * 3)[-1] == 2
    assert run([DecodeSignals(1, 0.1, 0, 0.6)] * 3)[-1] == 2
    assert run([DecodeSignals(1, 0.5, 2, 0.1)] * 3)[-1] == 1


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"min_replicas": -1}, "min_replicas: must be an integer >= 0"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas: must be >= min_replicas"),
        ({"cooldown_s": -1}, "cooldown_s: must be a number > 0"),
        ({"down_below": 1.5}, "down_below: must be below 1"),
        ({"target_kv_usage": 0}, "target_kv_usage: must be a number > 0"),
        ({"up_ticks": 1.5}, "up_ticks: must be an integer >= 1"),
    ],
)
def test_bad_config_is_refused_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ScalingConfig(**fields)  # type: ignore[arg-type]
