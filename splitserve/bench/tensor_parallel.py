"""Tensor parallelism against one rank on this machine: `splitserve bench offline
--tensor-parallel-size N`.

The same host's cores either way: one engine with N torch threads (TP=1), or N ranks of
one thread each (TP=N, Ray actors talking gloo on a CPU, NCCL on CUDA). For each: batch-1
decode, a 1,024-token prefill and a continuous batch of requests, in tokens a second;
for TP=N also the collectives rank 0 ran per decode step and the time it spent in them
(waiting for the slower rank included). On a CPU host a slowdown is expected (the ranks
share one memory bus, and each step adds its collectives' round trips); on a GPU node,
the same command is the one to run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from splitserve import workload
from splitserve.bench.modes import DECODE_PROMPT, PREFILL_TOKENS
from splitserve.workload import Request


@dataclass(frozen=True)
class TPResult:
    ranks: int
    threads: int  # torch threads per rank
    decode_tok_s: float  # batch 1
    prefill_tok_s: float
    batch_tok_s: float  # output tokens a second, the requests together
    collectives_per_step: float  # rank 0's, batch-1 decode; 0 for one rank
    collective_ms_per_step: float

    @property
    def name(self) -> str:
        return f"TP={self.ranks} ({self.ranks} x {self.threads} thread{'s' * (self.threads > 1)})"


def measure(
    config: EngineConfig, steps: int, seed: int, requests: list[Request], threads: int
) -> TPResult:
    """One configuration's figures; its engine (and ranks) closed after."""
    engine = LLMEngine(config)
    try:
        rng = np.random.default_rng(seed)
        vocab = engine.spec.vocab_size
        long = workload.random_prompt(rng, PREFILL_TOKENS, vocab)
        engine.generate([long[:64]], SamplingParams(max_tokens=4))  # warm-up
        started = time.perf_counter()
        engine.generate([long], SamplingParams(max_tokens=1))
        prefill = PREFILL_TOKENS / (time.perf_counter() - started)
        decode, collectives, collective_ms = _decode(engine, rng, steps)
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
        started = time.perf_counter()
        engine.generate([r.prompt for r in requests], params)
        batch = sum(r.output_len for r in requests) / (time.perf_counter() - started)
    finally:
        engine.close()
    ranks = config.tensor_parallel_size
    return TPResult(ranks, threads, decode, prefill, batch, collectives, collective_ms)


def _decode(engine: LLMEngine, rng: np.random.Generator, steps: int) -> tuple[float, float, float]:
    """Batch-1 decode tokens a second, and rank 0's collectives and their ms per step."""
    prompt = workload.random_prompt(rng, DECODE_PROMPT, engine.spec.vocab_size)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    group = engine.model.group
    try:
        for _ in range(4):  # the prefill and warm-up decodes
            engine.step()
        count, spent = (group.collectives, group.collective_s) if group else (0, 0.0)
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        seconds = time.perf_counter() - started
        if group is not None:
            count, spent = group.collectives - count, group.collective_s - spent
    finally:
        engine.abort_request(rid)
    return steps / seconds, count / steps, 1000 * spent / steps


def compare(
    size: int, dtype: str, quantization: str, steps: int, seed: int, requests: list[Request]
) -> list[TPResult]:
    """TP=1 with `size` threads, then TP=`size` with one thread a rank."""
    base = EngineConfig(dtype=dtype, quantization=quantization, device="cpu", kv_cache_gb=0.5)
    one = EngineConfig(**{**vars(base), "threads": size})
    split = EngineConfig(**{**vars(base), "threads": 1, "tensor_parallel_size": size})
    return [measure(one, steps, seed, requests, size), measure(split, steps, seed, requests, 1)]


def table(results: list[TPResult]) -> str:
    base = results[0]
    lines = [
        f"{'':24} {'decode tok/s':>13} {'prefill tok/s':>14} {'batch tok/s':>12} "
        f"{'collectives/step':>17} {'ms in them/step':>16}"
    ]
    for r in results:
        lines.append(
            f"{r.name:24} {r.decode_tok_s:13.1f} {r.prefill_tok_s:14.1f} {r.batch_tok_s:12.1f} "
            f"{r.collectives_per_step:17.1f} {r.collective_ms_per_step:16.2f}"
        )
    for r in results[1:]:
        lines.append(
            f"{r.name} / {base.name}: decode {r.decode_tok_s / base.decode_tok_s:.2f}x, "
            f"prefill {r.prefill_tok_s / base.prefill_tok_s:.2f}x, "
            f"batch {r.batch_tok_s / base.batch_tok_s:.2f}x"
        )
    return "\n".join(lines)
