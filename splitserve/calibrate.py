"""`splitserve plan calibrate`: time the real engine's steps on this machine and fit the
simulator's `Linear` step cost to them (splitserve/step_cost.py), within a time budget."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cluster.config import ConfigError, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import RequestStatus, SamplingParams
from splitserve.step_cost import Linear, Sample, fit

# What is timed: decode batches (rows, context) and one-prompt prefills (tokens).
DECODE_GRID = ((1, 128), (1, 1024), (4, 256), (16, 256), (16, 1024), (64, 128), (64, 512))
PREFILL_GRID = (16, 64, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class Calibration:
    modes: str  # the engine's dtype and weights, as it resolved them
    samples: list[Sample]
    points: int  # of the whole grid; fewer samples: the budget ran out first
    seconds: float  # spent, the engine's start included


def measure(
    config: EngineConfig,
    budget_s: float,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> Calibration:
    """Best-of-`repeats` seconds of each grid point's step, on an engine built from
    `config` with chunked prefill off (each prompt is one step). Points run cheapest first,
    prefills and decodes in turn, so a partial run still spans both; no point starts once
    `budget_s` (on `clock`, from the call) is spent."""
    start = clock()
    # All of a decode point's prompts are admitted in one step, so all its rows decode
    # together from the next.
    batched = max(rows * context for rows, context in DECODE_GRID)
    engine = LLMEngine(
        dataclasses.replace(
            config,
            chunked_prefill=False,
            prefix_caching=False,
            max_num_seqs=max(rows for rows, _ in DECODE_GRID),
            max_num_batched_tokens=max(batched, *PREFILL_GRID),
        )
    )
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, engine.spec.vocab_size, n)]

    def timed_step() -> float:
        began = clock()
        engine.step()
        return clock() - began

    def prefill(n: int) -> Sample:
        times = []
        for _ in range(repeats):
            engine.add_request(prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
            times.append(timed_step())
        return ([], [(n, 0)], min(times))

    def decode(rows: int, context: int) -> Sample:
        params = SamplingParams(max_tokens=repeats + 2, ignore_eos=True)
        rids = [engine.add_request(prompt(context), params) for _ in range(rows)]
        engine.step()
        assert all(engine.status(r) is RequestStatus.RUNNING for r in rids), "not all admitted"
        took = min(timed_step() for _ in range(repeats))
        for r in rids:
            engine.abort_request(r)
        return ([context + 1] * rows, [], took)

    plan: list[Callable[[], Sample]] = []
    for i in range(max(len(PREFILL_GRID), len(DECODE_GRID))):
        if i < len(PREFILL_GRID):
            plan.append(functools.partial(prefill, PREFILL_GRID[i]))
        if i < len(DECODE_GRID):
            plan.append(functools.partial(decode, *DECODE_GRID[i]))
    samples: list[Sample] = []
    for point in plan:
        if clock() - start >= budget_s:
            break
        samples.append(point())
    return Calibration(f"{engine.dtype} {engine.quantization}", samples, len(plan), clock() - start)


def calibrate(
    config: EngineConfig, budget_s: float, repeats: int = 3
) -> tuple[Linear, Calibration]:
    """The fitted step cost and what it was fitted to."""
    run = measure(config, budget_s, repeats)
    source = f"{config.model or 'bundled'} {run.modes}, {config.threads} threads"
    if len(run.samples) < 2:
        raise ConfigError(
            f"budget_s: {budget_s:g} s ran out after {len(run.samples)} timed steps (the "
            f"engine took part of it to start); a fit needs a prefill and a decode point"
        )
    if len(run.samples) < run.points:
        source += f", {len(run.samples)} of {run.points} points within {budget_s:g} s"
    return fit(run.samples, source), run
