"""How long one engine step takes, for the cluster simulator (splitserve/sim.py).

A step runs some decode rows (one new token each, attending over its context) and some
prefill chunks (n new tokens after `done` tokens already in the cache). Two models:

- `Roofline`: a step cannot beat the hardware. Bytes read = the weights once + the KV of
  every token attended to; FLOPs = 2 x parameters per new token + the attention's
  4 x layers x heads x head dim per (query, key) pair. Time = max(bytes / bandwidth,
  FLOPs / peak) / efficiency: the memory wall for decode, the compute roof for prefill.
- `Linear`: fitted to the real engine's own step times (`calibrate`), for machines whose
  engine is far from its roofline (this CPU): seconds = base + per_row x decode rows +
  per_context x decode context tokens + per_prefill x prefill tokens + per_pair x prefill
  attention pairs.

Both also time a run of k pure-decode steps whose every row grows by one token a step
(`decode_run`), which the simulator uses to jump over steps that change nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from cluster.engine.model.checkpoint import ModelSpec
from splitserve.capacity import allreduce_s, kv_bytes_per_token, num_params, weight_bytes
from splitserve.hardware import Hardware, cache_path

Prefill = tuple[int, int]  # (new tokens, tokens already cached before them)


def attention_pairs(prefills: Sequence[Prefill]) -> int:
    """(query, key) pairs of causal attention over the prefill chunks."""
    return sum(n * done + n * (n + 1) // 2 for n, done in prefills)


class StepCost(Protocol):
    def seconds(self, contexts: Sequence[int], prefills: Sequence[Prefill]) -> float:
        """One step: decode rows at these contexts (tokens attended), and prefill chunks."""
        ...

    def decode_run(self, rows: int, context_sum: int, k: int) -> np.ndarray:
        """k pure-decode steps of `rows` rows whose contexts sum to context_sum at the first
        step and grow by `rows` a step: each step's seconds."""
        ...


@dataclass(frozen=True)
class Roofline:
    spec: ModelSpec
    hw: Hardware
    weight_bits: float = 16
    kv_dtype: str = "bfloat16"
    efficiency: float = 1.0  # the fraction of the roofline the engine reaches
    tp: int = 1  # devices a worker's model is split over (capacity.py: tensor parallelism)
    link_gb_s: float = 0.0  # with tp > 1: each device's link, each way

    def _time(self, new_tokens: np.ndarray, kv_tokens: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        s, tp = self.spec, self.tp
        per_token = kv_bytes_per_token(s, self.kv_dtype, tp)
        read = weight_bytes(s, self.weight_bits, tp) + kv_tokens * per_token
        flops = 2 * num_params(s) * new_tokens + 4 * s.num_layers * s.num_heads * s.head_dim * pairs
        memory = read / (self.hw.bandwidth_gb_s * 1e9)
        compute = flops / tp / (self.hw.tflops * 1e12)
        steps = np.maximum(memory, compute) / self.efficiency
        return steps + allreduce_s(s, new_tokens, tp, self.link_gb_s)

    def seconds(self, contexts: Sequence[int], prefills: Sequence[Prefill]) -> float:
        new = len(contexts) + sum(n for n, _ in prefills)
        kv = sum(contexts) + sum(n + done for n, done in prefills)
        pairs = sum(contexts) + attention_pairs(prefills)
        return float(self._time(np.array([new]), np.array([kv]), np.array([pairs]))[0])

    def decode_run(self, rows: int, context_sum: int, k: int) -> np.ndarray:
        contexts = context_sum + rows * np.arange(k, dtype=np.float64)
        return self._time(np.full(k, float(rows)), contexts, contexts)


@dataclass(frozen=True)
class Linear:
    base_s: float
    per_row_s: float
    per_context_s: float
    per_prefill_s: float
    per_pair_s: float
    source: str = ""  # what it was fitted to

    def seconds(self, contexts: Sequence[int], prefills: Sequence[Prefill]) -> float:
        return (
            self.base_s
            + self.per_row_s * len(contexts)
            + self.per_context_s * sum(contexts)
            + self.per_prefill_s * sum(n for n, _ in prefills)
            + self.per_pair_s * attention_pairs(prefills)
        )

    def decode_run(self, rows: int, context_sum: int, k: int) -> np.ndarray:
        contexts = context_sum + rows * np.arange(k, dtype=np.float64)
        return self.base_s + self.per_row_s * rows + self.per_context_s * contexts

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> Linear:
        return cls(**json.loads(path.read_text()))


Sample = tuple[list[int], list[Prefill], float]  # (decode contexts, prefill chunks, seconds)


def fit(samples: Sequence[Sample], source: str) -> Linear:
    """Least squares over the samples, each coefficient kept >= 0 (an active set: a
    coefficient that comes out negative is fixed at 0 and the rest refitted)."""
    x = np.array(
        [[1.0, len(c), sum(c), sum(n for n, _ in p), attention_pairs(p)] for c, p, _ in samples]
    )
    y = np.array([s for _, _, s in samples])
    free = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        # Relative errors count alike for a 20 ms decode and a 2 s prefill.
        w = 1 / y
        coef[free] = np.linalg.lstsq(x[:, free] * w[:, None], y * w, rcond=None)[0]
        negative = [i for i in free if coef[i] < 0]
        if not negative:
            base, row, context, prefill, pair = (float(c) for c in coef)
            return Linear(base, row, context, prefill, pair, source)
        free.remove(min(negative, key=lambda i: coef[i]))


def default_path() -> Path:
    """Where `splitserve plan calibrate` writes and `plan cluster` looks by default."""
    return cache_path().parent / "step-cost.json"
