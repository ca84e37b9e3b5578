"""Autoscaling decisions per phase: observations in, a replica count out. No I/O, no
clock of its own, no Ray: the adapter that drives the pools, a replay and the tests all
call `decide` with the same inputs and get the same answer.

One pressure number per phase, where 1.0 means "at target":

    prefill  max(queued_tokens / (replicas * target_queued_tokens), ttft_p90 / ttft_slo)
    decode   max(kv_usage / target_kv_usage, waiting / (replicas * target_waiting),
                 tpot_p90 / tpot_slo)

Above 1.0 for `up_ticks` ticks in a row: one more replica. Below `down_below` for
`down_ticks` ticks in a row: one fewer. Between the two, nothing: that band is the
hysteresis, and the tick counts keep a noisy signal from flapping. After a change, no
other change for `cooldown_s`. Replicas stay within [min_replicas, max_replicas].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cluster.config import ScalingConfig


@dataclass(frozen=True)
class PrefillSignals:
    replicas: int
    queued_tokens: int  # over the whole pool
    ttft_p90_s: float | None  # None: no request finished since the last tick


@dataclass(frozen=True)
class DecodeSignals:
    replicas: int
    kv_usage: float  # mean fraction of KV pages in use over the pool
    waiting: int  # admitted, not yet running, over the pool
    tpot_p90_s: float | None


@dataclass(frozen=True)
class ScalerState:
    """What a phase's scaler remembers between ticks."""

    over: int = 0  # consecutive ticks over target
    under: int = 0  # consecutive ticks under down_below
    changed_at: float | None = None  # when the replica count last changed


@dataclass(frozen=True)
class Decision:
    replicas: int  # what the pool should have
    pressure: float
    reason: str  # "up", "down", "hold", "cooldown", "at max", "at min", "below min"
    state: ScalerState


def pressure(config: ScalingConfig, signals: PrefillSignals | DecodeSignals) -> float:
    """The phase's load relative to its target (see the module docstring)."""
    n = max(signals.replicas, 1)
    if isinstance(signals, PrefillSignals):
        terms = [signals.queued_tokens / (n * config.target_queued_tokens)]
        latency, slo = signals.ttft_p90_s, config.ttft_slo_s
    else:
        terms = [
            signals.kv_usage / config.target_kv_usage,
            signals.waiting / (n * config.target_waiting),
        ]
        latency, slo = signals.tpot_p90_s, config.tpot_slo_s
    if latency is not None:
        terms.append(latency / slo)
    return max(terms)


def decide(
    config: ScalingConfig,
    signals: PrefillSignals | DecodeSignals,
    state: ScalerState,
    now: float,
) -> Decision:
    """One tick of one phase's scaler."""
    n = signals.replicas
    p = pressure(config, signals)
    if n < config.min_replicas:  # a worker died: back to the minimum at once
        return Decision(config.min_replicas, p, "below min", ScalerState(0, 0, now))
    over = state.over + 1 if p > 1.0 else 0
    under = state.under + 1 if p < config.down_below else 0
    state = dataclasses.replace(state, over=over, under=under)
    want = n + 1 if over >= config.up_ticks else n - 1 if under >= config.down_ticks else n
    if want == n:
        return Decision(n, p, "hold", state)
    if want > config.max_replicas:
        return Decision(n, p, "at max", state)
    if want < config.min_replicas:
        return Decision(n, p, "at min", state)
    if state.changed_at is not None and now - state.changed_at < config.cooldown_s:
        return Decision(n, p, "cooldown", state)
    return Decision(want, p, "up" if want > n else "down", ScalerState(0, 0, now))
