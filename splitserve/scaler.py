"""The autoscaler's adapter: every tick, one phase's observations in, `decide`
(splitserve/autoscale.py), the pool resized.

Observations: the loads the router last read from the phase's workers (queued prompt
tokens per prefill worker; KV usage and waiting requests per decode worker) and the p90
latency of the requests that finished since the last tick (time to first token for
prefill, time per output token for decode). Workers the router found dead leave the pool
first, so a pool below its minimum is restored on that same tick. One change runs at a
time: a new worker takes seconds to start (minutes if Ray must add a node) and a drain
as long as its requests; the ticks in between only reap. Scaling down drains the idlest
worker, the newest among equals.

Every decision is logged with its inputs (INFO when it changes the pool, DEBUG when it
holds) and counted in `splitserve_autoscaler_decisions_total{phase,decision}`.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.metrics import Window
from router.workers import WorkerRegistry
from splitserve.autoscale import Decision, DecodeSignals, PrefillSignals, ScalerState, decide
from splitserve.pool import AnyPool

log = logging.getLogger(__name__)


class ScalerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "splitserve_autoscaler_decisions",
            "Autoscaler ticks by phase and outcome (up, down, hold, cooldown, at_max, at_min, "
            "below_min)",
            ["phase", "decision"],
            registry=registry,
        )
        self.pressure = Gauge(
            "splitserve_autoscaler_pressure",
            "The phase's load relative to its target at the last tick (1: at target)",
            ["phase"],
            registry=registry,
        )
        self.target = Gauge(
            "splitserve_pool_target_replicas",
            "Workers the autoscaler wants per phase",
            ["phase"],
            registry=registry,
        )
        self.lost = Counter(
            "splitserve_workers_lost", "Workers found dead per phase", ["phase"], registry=registry
        )


class PhaseScaler:
    def __init__(
        self,
        pool: AnyPool,
        registry: WorkerRegistry,
        latencies: Window,
        metrics: ScalerMetrics,
    ) -> None:
        """`latencies`: the router's recent TTFTs (prefill) or TPOTs (decode)."""
        self.pool = pool
        self.registry = registry
        self.latencies = latencies
        self.metrics = metrics
        self.config = pool.config.scaling
        self.state = ScalerState()
        self._change: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._change) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def tick(self, now: float) -> Decision | None:
        """Reap the dead, then decide and start the change; None while one is running."""
        phase = self.pool.phase
        for name in self.pool.reap(self.registry):
            log.error("%s: dead; removed from the %s pool", name, phase)
            self.metrics.lost.labels(phase).inc()
        if self._change is not None and not self._change.done():
            return None
        signals = self._signals()
        decision = decide(self.config, signals, self.state, now)
        self.state = decision.state
        self.metrics.decisions.labels(phase, decision.reason.replace(" ", "_")).inc()
        self.metrics.pressure.labels(phase).set(decision.pressure)
        self.metrics.target.labels(phase).set(decision.replicas)
        n = signals.replicas
        level = logging.DEBUG if decision.replicas == n else logging.INFO
        log.log(
            level,
            "autoscale %s: %s, %d -> %d replicas (pressure %.2f; %s)",
            phase,
            decision.reason,
            n,
            decision.replicas,
            decision.pressure,
            signals,
        )
        if decision.replicas > n:
            self._change = asyncio.create_task(self._grow(decision.replicas - n))
        elif decision.replicas < n:
            self._change = asyncio.create_task(self.pool.drain(self.registry, self._idlest()))
        return decision

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.tick(time.monotonic())
            except Exception:  # one bad tick must not stop scaling for good
                log.exception("autoscale %s: tick failed", self.pool.phase)

    async def _grow(self, count: int) -> None:
        results = await asyncio.gather(
            *(self.pool.grow(self.registry) for _ in range(count)), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                log.error("autoscale %s: a new worker failed to start: %s", self.pool.phase, result)

    def _signals(self) -> PrefillSignals | DecodeSignals:
        snapshot = self.registry.snapshot()
        replicas = len(self.pool.serving)
        p90 = self.latencies.take_p90()
        if self.pool.phase == "prefill":
            return PrefillSignals(replicas, sum(p.queued_tokens for p in snapshot.prefill), p90)
        usage = [1 - d.free_pages / d.num_pages for d in snapshot.decode]
        return DecodeSignals(
            replicas,
            statistics.fmean(usage) if usage else 0.0,
            sum(d.waiting for d in snapshot.decode),
            p90,
        )

    def _idlest(self) -> str:
        snapshot = self.registry.snapshot()
        load = {p.worker: p.queued_tokens for p in snapshot.prefill}
        load |= {d.worker: d.running + d.waiting for d in snapshot.decode}
        newest_first = self.pool.serving[::-1]
        return min(newest_first, key=lambda w: load.get(w, 0))
