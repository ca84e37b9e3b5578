"""8-bit KV pages (kv_cache.py's scaled format): what they hold against the values written,
the C store's bytes against the torch definition's, every CPU attention path reading them in
place against a float32 reference over their decoded values, and the tokens a budget holds."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from cluster.engine.kernels import attention_cpu
from cluster.engine.kernels.attention_cpu import CpuBackend
from cluster.engine.kernels.kv_cache import KVCache, KVLayout
from cluster.engine.kernels.step_batch import StepBatch
from tests.helpers import scattered_pages

CPU = torch.device("cpu")
KV8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
IDS = ["fp8_e4m3", "fp8_e5m2", "int8"]
needs_kernel = pytest.mark.skipif(attention_cpu._kernel() is None, reason="no C compiler here")


def _writes(g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(slots, x [n, 3, 64]) in step order: a 21-token prompt over pages 5 and 2, then 14
    decodes of it growing 40% a step beside a second sequence on page 7, decoded from an
    empty page; one head a thousand times smaller than the others."""
    steps = [(torch.cat([torch.arange(80, 96), torch.arange(32, 37)]), 21)]
    for i in range(14):
        steps.append((torch.tensor([37 + i, 112 + i]), 2))
    out = []
    for i, (slots, n) in enumerate(steps):
        x = torch.randn(n, 3, 64, generator=g) * 1.4**i
        x[:, 1] *= 1e-3  # its own scales
        out.append((slots, x))
    return out


def _held(lay: KVLayout, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The values one layer's pages hold at token slots `slots` [n], decoded: [n, kv_heads,
    dim]."""
    ps = lay.page_size
    codes = lay.values(pages)[slots // ps, :, slots % ps].float()
    return codes * lay.scales(pages)[slots // ps, :, slots % ps].unsqueeze(-1)


@pytest.mark.parametrize("dtype", KV8, ids=IDS)
def test_pages_hold_what_was_written_within_the_dtype_s_steps(dtype: torch.dtype) -> None:
    layout = KVLayout(1, 3, 64, 16, dtype)
    cache = KVCache(layout, 8, CPU)
    assert cache.k.shape == (1, 8, 3, 16 * 64 + 16) and cache.k.dtype == torch.uint8
    writes = _writes(torch.Generator().manual_seed(0))
    for slots, x in writes:
        layout.store(cache.k[0], slots, x)
    slots = torch.cat([s for s, _ in writes])
    wrote = torch.cat([x for _, x in writes])
    held = _held(layout, cache.k[0], slots)
    bound = {torch.float8_e4m3fn: 0.04, torch.float8_e5m2: 0.08}.get(dtype, 0.02)
    for h in range(3):  # relative to each head's own size: its scale is its own
        assert (held[:, h] - wrote[:, h]).norm() / wrote[:, h].norm() < bound


@needs_kernel
@pytest.mark.parametrize("dtype", KV8, ids=IDS)
def test_the_c_store_writes_the_definition_s_bytes(dtype: torch.dtype) -> None:
    layout = KVLayout(1, 3, 64, 16, dtype)
    ours, theirs = KVCache(layout, 8, CPU), KVCache(layout, 8, CPU)
    kernel = attention_cpu._kernel()
    assert kernel is not None
    for slots, x in _writes(torch.Generator().manual_seed(1)):
        attention_cpu.store_in_place(kernel, ours.k[0], slots, x, layout)
        layout.store(theirs.k[0], slots, x)
        assert torch.equal(ours.k, theirs.k)


def _decoded(cache: KVCache) -> KVCache:
    """A float32 cache holding the values an 8-bit one's codes and scales stand for."""
    lay = cache.layout
    out = KVCache(replace(lay, dtype=torch.float32), cache.num_pages, CPU)
    for mine, theirs in ((out.k, cache.k), (out.v, cache.v)):
        for layer in range(lay.num_layers):
            mine[layer] = lay.values(theirs[layer]).float() * lay.scales(theirs[layer])[..., None]
    return out


@pytest.mark.parametrize("dtype", KV8, ids=IDS)
def test_decodes_and_prefill_chunks_read_8bit_pages_in_place(
    build: ctypes.CDLL, dtype: torch.dtype
) -> None:
    # Decodes of 1, 17 and 40 tokens (one past 16 pages: two tasks merged), a 5-token chunk
    # after 27 cached and a fresh 6-token prompt, on scattered pages: through CpuBackend
    # as the engine calls it, against the gathered float32 path over the decoded pages.
    g = torch.Generator().manual_seed(3)
    layout = KVLayout(1, 3, 64, 16, dtype)
    cache = KVCache(layout, 24, CPU)
    every = torch.arange(24 * 16)
    for t in (cache.k[0], cache.v[0]):
        layout.store(t, every, torch.randn(24 * 16, 3, 64, generator=g))
    lens, news = [1, 17, 40, 32, 6], [1, 1, 1, 5, 6]
    table = scattered_pages(lens, 16, 24, seed=3)
    at = torch.cat([torch.arange(n - new, n) for n, new in zip(lens, news, strict=True)])
    owner = torch.cat([torch.full((new,), i) for i, new in enumerate(news)])
    slots = table[owner, at // 16] * 16 + at % 16
    batch = StepBatch(3, [0, 1, 2, 3, 8, 14], lens, table, slots, at)
    q, k, v = (torch.randn(14, h, 64, generator=g) for h in (9, 3, 3))
    backend = CpuBackend(layout, CPU)
    backend.kernel = build
    ours = backend.forward(0, q, k, v, cache, backend.prepare(batch))

    ref_cache = _decoded(cache)  # the new tokens' K and V too, as stored
    k_new, v_new = (t[0][slots // 16, :, slots % 16] for t in (ref_cache.k, ref_cache.v))
    gathered = CpuBackend(ref_cache.layout, CPU, in_place=False)
    ref = gathered.forward(0, q, k_new, v_new, ref_cache, gathered.prepare(batch))
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5)


def test_8bit_pages_hold_twice_bfloat16_s_tokens_and_four_times_float32_s() -> None:
    # The bundled model's KV shape: 30 layers of 3 KV heads of 64, pages of 16 tokens.
    def pages(dtype: torch.dtype) -> int:
        return KVLayout(30, 3, 64, 16, dtype).pages_for(2**30)

    for dtype in KV8:
        assert pages(dtype) >= 1.95 * pages(torch.bfloat16)
        assert pages(dtype) >= 3.9 * pages(torch.float32)


@pytest.mark.parametrize("dtype", KV8, ids=IDS)
def test_a_page_s_bytes_are_the_same_however_its_tokens_are_batched(dtype: torch.dtype) -> None:
    # 40 tokens over pages 3, 0 and 6, growing: written at once, in chunks of 7, a token a
    # step; by the torch definition and by the C store. Every way, the same bytes, and a
    # token's bytes never change once written (what a row read before, it reads after).
    g = torch.Generator().manual_seed(2)
    layout = KVLayout(1, 3, 64, 16, dtype)
    x = torch.randn(40, 3, 64, generator=g) * torch.linspace(0.2, 9.0, 40)[:, None, None]
    slots = (torch.tensor([3, 0, 6])[:, None] * 16 + torch.arange(16)).flatten()[:40]
    kernel = attention_cpu._kernel()
    caches = []
    for chunk in (40, 7, 1):
        for c_store in (False, True):
            if c_store and kernel is None:
                continue
            cache = KVCache(layout, 8, CPU)
            for i in range(0, 40, chunk):
                before = _held(layout, cache.k[0], slots[:i])
                part = (cache.k[0], slots[i : i + chunk], x[i : i + chunk])
                if c_store:
                    attention_cpu.store_in_place(kernel, *part, layout)
                else:
                    layout.store(*part)
                assert torch.equal(_held(layout, cache.k[0], slots[:i]), before)
            caches.append(cache.k)
    assert all(torch.equal(c, caches[0]) for c in caches[1:])
