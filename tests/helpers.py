"""Shared test helpers: the leak check every engine test ends with, the one way tests
wait (polling an observable predicate until a deadline, never a sleep then an assert),
the mark for tests whose subject is bfloat16 compute, scattered page tables, and attention
row by row as a layer (LayerAttention) defines it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
import torch

from cluster.engine.engine import LLMEngine
from cluster.engine.kernels.cpu_isa import cpu, native_bf16
from cluster.engine.kernels.kv_cache import KVCache
from cluster.engine.kernels.layer_attention import LayerAttention
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.sched.page_pool import pages_for

POLL_S = 0.02

# A test that needs a dtype takes float32; one whose subject is bfloat16 compute on the
# bundled model carries this mark: without native bf16 torch emulates it ~6x slower.
needs_native_bf16 = pytest.mark.skipif(
    not native_bf16(cpu()[1]),
    reason="bfloat16 is emulated on this CPU (no AVX512_BF16, AMX-BF16 or Arm BF16)",
)


def assert_no_leak(engine: LLMEngine) -> None:
    """Every page is free again and no request is left in the engine."""
    assert not engine.has_unfinished()
    sched = engine.scheduler
    assert not sched.running and not sched.waiting and not sched.transferring
    assert engine.num_free_pages == engine.pool.num_pages, (
        f"{engine.pool.num_pages - engine.num_free_pages} pages still referenced"
    )


def wait_until(ok: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Return once `ok()` is true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S)


async def until(probe: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60.0) -> None:
    """`wait_until` on an event loop: return once `await probe()` is true."""
    deadline = time.monotonic() + timeout_s
    while not await probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(POLL_S)


def scattered_pages(lens: list[int], page_size: int, num_pages: int, seed: int) -> torch.Tensor:
    """A page table [seqs, width] (int64, 0-padded): each sequence's pages drawn without
    repeats from a shuffled pool of `num_pages`, so with holes and in any order."""
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(len(lens), max(pages_for(n, page_size) for n in lens), dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        count = pages_for(n, page_size)
        table[i, :count] = order[used : used + count]
        used += count
    return table


def windowed_reference(
    q: torch.Tensor, cache: KVCache, batch: StepBatch, attn: LayerAttention
) -> torch.Tensor:
    """Each query row by itself, over its sequence's tokens as the cache holds them: the
    keys in (position - window, position], scores scaled, soft-capped, softmax, V."""
    lay, out = cache.layout, []
    for i in range(batch.num_seqs):
        context = batch.context_lens[i]
        ids = batch.page_table[i, : pages_for(context, lay.page_size)]
        keys = lay.gather(cache.k[0], ids, context).float()  # [context, kv_heads, dim]
        values = lay.gather(cache.v[0], ids, context).float()
        for row in range(batch.query_start[i], batch.query_start[i + 1]):
            p = int(batch.positions[row])
            lo = 0 if attn.window is None else max(0, p + 1 - attn.window)
            group = q.shape[1] // keys.shape[1]
            k = keys[lo : p + 1].repeat_interleave(group, 1)  # [t, heads, dim]
            v = values[lo : p + 1].repeat_interleave(group, 1)
            s = torch.einsum("hd,thd->ht", q[row].float(), k) * attn.scale_for(q.shape[-1])
            if attn.softcap is not None:
                s = torch.tanh(s / attn.softcap) * attn.softcap
            out.append(torch.einsum("ht,thd->hd", torch.softmax(s, -1), v))
    return torch.stack(out)
