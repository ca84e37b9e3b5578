"""What a decode step costs against what it must cost: the memory wall, and reading pages.

A decode step at batch 1 must read every weight once (the tied embedding once, as the
lm_head; the embedding lookup reads one row) and the KV of its context. At the machine's
read bandwidth that is a floor on the step time; efficiency = floor / measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.engine.engine import LLMEngine
from cluster.engine.kernels import attention_cpu
from cluster.engine.kernels.attention_cpu import CpuBackend
from cluster.engine.kernels.kv_cache import KVCache, KVLayout
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.sched.page_pool import pages_for
from cluster.types import SamplingParams


def read_bandwidths(gib: float = 1.0, buffers: int = 3, repeats: int = 4) -> list[float]:
    """Bytes/s `torch.sum` streams through each of a few fresh buffers far larger than any
    cache, best of `repeats` each. On a VM they differ with how the host backs each buffer."""
    found = []
    for _ in range(buffers):
        buf = torch.arange(int(gib * 2**30) // 4, dtype=torch.float32)  # no two pages alike
        found.append(buf.numel() * 4 / min(timed(buf.sum) for _ in range(repeats)))
        del buf
    return found


@dataclass(frozen=True)
class DecodeEfficiency:
    weight_bytes: int
    weights_sum_s: float  # the weights read alone by torch.sum, best of a few
    kv_bytes: int  # at the mean context of the timed steps
    context_len: float
    bandwidths: list[float]  # bytes/s, one per buffer measured; the wall uses the best
    step_times: list[float]  # seconds, one per timed engine.step()

    @property
    def wall_s(self) -> float:
        return self.wall_at(max(self.bandwidths))

    def wall_at(self, bandwidth: float) -> float:
        return (self.weight_bytes + self.kv_bytes) / bandwidth

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_times)

    @property
    def efficiency(self) -> float:
        """Memory-wall time / the median measured step time."""
        return self.wall_s / self.median_s


def weights(engine: LLMEngine) -> list[torch.Tensor]:
    """The weights one token's forward pass reads whole: a tied embedding once, as the
    lm_head; an untied one not at all (its lookup reads a row)."""
    model = engine.model
    per_layer = [t for layer in model.layers for t in layer.tensors]
    return [*model.lm_head.tensors, model.norm, *per_layer]


def weights_sum_s(tensors: list[torch.Tensor], repeats: int = 5) -> float:
    """Best time to `torch.sum` every tensor once: reading the weights with no math."""

    def read() -> None:
        for t in tensors:
            t.sum()

    read()
    return min(timed(read) for _ in range(repeats))


def batch1_decode(
    engine: LLMEngine, prompt: list[int], steps: int, warmup: int, bandwidths: list[float]
) -> DecodeEfficiency:
    """Time `steps` engine steps of one lone request after its prefill and `warmup` steps."""
    assert not engine.has_unfinished(), "the engine must be idle"
    rid = engine.add_request(prompt, SamplingParams(max_tokens=warmup + steps + 2, ignore_eos=True))
    try:
        for _ in range(1 + warmup):  # the prefill (one chunk) and the warm-up decodes
            engine.step()
        times = [timed(engine.step) for _ in range(steps)]
    finally:
        engine.abort_request(rid)
    # Timed step i attends to prompt + 1 + warmup + i + 1 tokens, its own included.
    context = len(prompt) + warmup + 2 + (steps - 1) / 2
    kv = int(engine.layout.bytes_per_token * context)
    tensors = weights(engine)
    size = sum(t.numel() * t.element_size() for t in tensors)
    return DecodeEfficiency(size, weights_sum_s(tensors), kv, context, bandwidths, times)


@dataclass(frozen=True)
class GatherCost:
    """One step's whole forward with its pages gathered into a copy, against the same step
    with our kernels reading them in place (None where they cannot be built). `new_tokens`
    1: a decode step of `batch` sequences; more: `batch` prefill chunks of that many tokens
    after their cached context."""

    batch: int
    context_len: int
    gathered_s: float
    in_place_s: float | None
    new_tokens: int = 1

    @property
    def speedup(self) -> float | None:
        return None if self.in_place_s is None else self.gathered_s / self.in_place_s


def gather_cost(
    engine: LLMEngine, batch: int, context_len: int, repeats: int, new_tokens: int = 1
) -> GatherCost:
    """One step of `batch` sequences of `context_len` tokens, the last `new_tokens` of each
    new, on a scratch cache, both ways (ScatteredStep)."""
    step = ScatteredStep(engine, batch, context_len, new_tokens)
    in_place = CpuBackend(engine.layout, engine.device)
    gathered_s = step.best_s(CpuBackend(engine.layout, engine.device, in_place=False), repeats)
    in_place_s = step.best_s(in_place, repeats) if in_place.kernel is not None else None
    return GatherCost(batch, context_len, gathered_s, in_place_s, new_tokens)


def fill_normal(pages: torch.Tensor, layout: KVLayout, chunk: int = 2**16) -> None:
    """One layer's pages filled with N(0, 1) K (or V) as its store writes them."""
    slots = torch.arange(pages.shape[0] * layout.page_size)
    kernel = attention_cpu._kernel() if layout.scaled else None
    for at in range(0, len(slots), chunk):
        part = slots[at : at + chunk]
        x = torch.randn(len(part), layout.num_kv_heads, layout.head_dim)
        if kernel is not None:
            attention_cpu.store_in_place(kernel, pages, part, x, layout)
        else:
            layout.store(pages, part, x)


class ScatteredStep:
    """One step's whole forward of `batch` sequences of `context_len` tokens, the last
    `new_tokens` of each new (1: a decode step), on a scratch cache of the engine's size.

    Page tables are random pages (with repeats when the cache is too small for the batch),
    so the pages are read as scattered as a long-running server's. The pages hold random
    normal K and V (8-bit ones coded by the store: zeroed runs would re-code on every
    token, where a server's re-code on a few).
    """

    def __init__(self, engine: LLMEngine, batch: int, context_len: int, new_tokens: int) -> None:
        layout, ps, device = engine.layout, engine.layout.page_size, engine.device
        self.engine = engine
        self.cache = KVCache(layout, engine.cache.num_pages, device)
        for pages in (*self.cache.k, *self.cache.v):
            fill_normal(pages, layout)
        width = pages_for(context_len, ps)
        pages = torch.randint(0, self.cache.num_pages, (batch, width), device=device)
        at = torch.arange(context_len - new_tokens, context_len, device=device)
        self.positions = at.repeat(batch)
        rows = torch.arange(batch, device=device).repeat_interleave(new_tokens)
        self.step = StepBatch(
            num_decodes=batch if new_tokens == 1 else 0,
            query_start=list(range(0, batch * new_tokens + 1, new_tokens)),
            context_lens=[context_len] * batch,
            page_table=pages,
            slot_mapping=pages[rows, self.positions // ps] * ps + self.positions % ps,
            positions=self.positions,
        )
        self.ids = torch.randint(0, engine.spec.vocab_size, (batch * new_tokens,), device=device)
        self.last = torch.arange(new_tokens - 1, batch * new_tokens, new_tokens, device=device)

    def best_s(self, backend: CpuBackend, repeats: int) -> float:
        """The best of `repeats` forwards through `backend`, after one to warm up."""
        attn = backend.prepare(self.step)
        model = self.engine.model
        forward = lambda: model.forward(
            self.ids, self.positions, backend, attn, self.cache, self.last
        )
        forward()
        return min(timed(forward) for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
