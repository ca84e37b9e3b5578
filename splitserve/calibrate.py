"""`splitserve plan calibrate`: time the real engine's steps on this machine and fit the
simulator's `Linear` step cost to them (splitserve/step_cost.py)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import RequestStatus, SamplingParams
from splitserve.step_cost import Linear, Sample, fit

# What is timed: decode batches (rows, context) and one-prompt prefills (tokens).
DECODE_GRID = ((1, 128), (1, 1024), (4, 256), (16, 256), (16, 1024), (64, 128), (64, 512))
PREFILL_GRID = (16, 64, 256, 512, 1024, 2048)


def measure(config: EngineConfig, repeats: int = 3) -> list[Sample]:
    """Best-of-`repeats` seconds of each grid point's step, on an engine built from
    `config` with chunked prefill off (each prompt is one step)."""
    # All of a decode point's prompts are admitted in one step, so all its rows decode
    # together from the next.
    budget = max(rows * context for rows, context in DECODE_GRID)
    engine = LLMEngine(
        dataclasses.replace(
            config,
            chunked_prefill=False,
            prefix_caching=False,
            max_num_seqs=max(rows for rows, _ in DECODE_GRID),
            max_num_batched_tokens=budget,
        )
    )
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, engine.spec.vocab_size, n)]

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    samples: list[Sample] = []
    for n in PREFILL_GRID:
        times = []
        for _ in range(repeats):
            engine.add_request(prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
            times.append(timed_step())
        samples.append(([], [(n, 0)], min(times)))
    for rows, context in DECODE_GRID:
        params = SamplingParams(max_tokens=repeats + 2, ignore_eos=True)
        rids = [engine.add_request(prompt(context), params) for _ in range(rows)]
        engine.step()
        assert all(engine.status(r) is RequestStatus.RUNNING for r in rids), "not all admitted"
        samples.append(([context + 1] * rows, [], min(timed_step() for _ in range(repeats))))
        for r in rids:
            engine.abort_request(r)
    return samples


def calibrate(config: EngineConfig, repeats: int = 3) -> Linear:
    model = config.model or "bundled"
    source = f"{model} {config.dtype} {config.quantization}, {config.threads} threads"
    return fit(measure(config, repeats), source)
