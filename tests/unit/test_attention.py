"""Attention: the bfloat16 CPU decode path (two matmuls) agrees with SDPA in float32, and
prefills run SDPA's fused kernel on the engine's own shapes and match a reference. The
backend and dtype an engine resolves `auto` to, per device."""

from __future__ import annotations

import ctypes
import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from cluster.config import ConfigError
from cluster.engine.kernels import attention_cpu
from cluster.engine.kernels.attention import resolve_backend
from cluster.engine.kernels.attention_cpu import (
    CpuBackend,
    CpuMetadata,
    PrefillChunk,
    _decode_attention,
    paged_attention,
)
from cluster.engine.kernels.kv_cache import KVCache, KVLayout, gather_tokens
from cluster.engine.kernels.layer_attention import LayerAttention
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.sched.page_pool import pages_for
from tests.helpers import scattered_pages, windowed_reference

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def flashinfer_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """find_spec answers for flashinfer as on a GPU host that has it (it builds for CUDA only)."""
    find_spec = importlib.util.find_spec
    installed = lambda name, *args: (
        find_spec("torch") if name == "flashinfer" else find_spec(name, *args)
    )
    monkeypatch.setattr(importlib.util, "find_spec", installed)


def test_auto_backend_takes_flashinfer_only_where_it_has_kernels_for_the_dtype(
    flashinfer_installed: None,
) -> None:
    assert resolve_backend("auto", CUDA, "bfloat16", "auto") == "flashinfer"
    assert (
        resolve_backend("auto", CUDA, "float32", "auto") == "triton"
    )  # FlashInfer: no fp32 kernels
    assert resolve_backend("auto", CPU, "bfloat16", "auto") == "cpu"
    with pytest.raises(ConfigError, match="attention_backend: flashinfer has no float32 kernels"):
        resolve_backend("flashinfer", CUDA, "float32", "auto")
    # 8-bit pages' scales per token and head: FlashInfer does not read them, triton does.
    assert resolve_backend("auto", CUDA, "bfloat16", "int8") == "triton"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype: int8 .* attention_backend triton"):
        resolve_backend("flashinfer", CUDA, "bfloat16", "int8")


def test_fp8_pages_are_refused_on_a_gpu_without_fp8_conversions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))  # an A100
    for name, kv in (("auto", "fp8"), ("triton", "fp8_e5m2")):
        with pytest.raises(ConfigError, match=rf"kv_cache_dtype: {kv} .* 8\.0.* int8 or bfloat16"):
            resolve_backend(name, CUDA, "bfloat16", kv)
    assert resolve_backend("triton", CUDA, "bfloat16", "int8") == "triton"
    assert resolve_backend("triton", CPU, "float32", "fp8") == "triton"  # the interpreter's
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))  # an H100
    assert resolve_backend("auto", CUDA, "bfloat16", "fp8") == "triton"


def test_bfloat16_decode_attention_matches_float32_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, context, dim = 5, 9, 3, 40, 64
    q = torch.randn(batch, heads, dim, generator=g)
    k = torch.randn(batch, kv_heads, context, dim, generator=g)
    v = torch.randn(batch, kv_heads, context, dim, generator=g)
    lens = torch.tensor([1, 7, 16, 33, 40])
    mask = (torch.arange(context)[None, :] < lens[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True)
    ours = _decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert ours.dtype is torch.bfloat16
    assert (ours.float() - ref.squeeze(2)).abs().max().item() < 0.05
    # A one-token context attends to exactly that token's value.
    assert torch.allclose(ours[0].float(), v[0, :, 0].repeat_interleave(3, 0), atol=0.02)


def _layout(pages: torch.Tensor) -> KVLayout:
    """The format of one layer's float pages [pages, kv_heads, page_size, head_dim]."""
    return KVLayout(1, pages.shape[1], pages.shape[3], pages.shape[2], pages.dtype)


def _prefill_batch(num_tokens: int, context_len: int, page_size: int) -> CpuMetadata:
    pages = torch.arange(pages_for(context_len, page_size))
    pos = torch.arange(context_len - num_tokens, context_len)
    return CpuMetadata(
        slot_mapping=pages[pos // page_size] * page_size + pos % page_size,
        num_decodes=0,
        decode_pages=None,
        decode_lens=None,
        decode_mask=None,
        decode_workspace=None,
        prefills=(PrefillChunk(0, num_tokens, context_len, pages),),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [0, 48], ids=["fresh", "after-cached-context"])
def test_prefill_runs_the_fused_kernel_and_matches_reference(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, cached: int
) -> None:
    # The bundled model's attention shape: 9 query heads over 3 KV heads of 64.
    heads, kv_heads, dim, page_size, n = 9, 3, 64, 16, 80
    g = torch.Generator().manual_seed(1)
    context = cached + n
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    k = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
    pages = pages_for(context, page_size)
    k_cache = torch.randn(pages, kv_heads, page_size, dim, generator=g).to(dtype)
    v_cache = torch.randn(pages, kv_heads, page_size, dim, generator=g).to(dtype)
    chosen: list[SDPBackend] = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        choice = torch._fused_sdp_choice(*args, **kwargs)  # type: ignore[attr-defined]
        chosen.append(SDPBackend(choice))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    out = paged_attention(
        q, k, v, k_cache, v_cache, _prefill_batch(n, context, page_size), _layout(k_cache)
    )
    monkeypatch.undo()
    assert chosen == [SDPBackend.FLASH_ATTENTION]

    # Reference: the whole context in float32, each query row masked causally.
    every = torch.arange(pages)
    keys = gather_tokens(k_cache, every, context).float().repeat_interleave(3, 1)
    values = gather_tokens(v_cache, every, context).float().repeat_interleave(3, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * dim**-0.5
    causal = torch.arange(context)[None, :] <= torch.arange(cached, context)[:, None]
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    ref = torch.einsum("hqk,khd->qhd", weights, values)
    assert out.shape == (n, heads, dim)
    assert (out.float() - ref).abs().max().item() < (1e-4 if dtype == torch.float32 else 0.05)


def _mixed_batch(page_size: int, g: torch.Generator) -> StepBatch:
    """Decodes of 1, 17 and 40 tokens, a 5-token chunk after 27 cached ones and a fresh
    6-token prompt, on pages scattered through a 24-page cache."""
    lens, news = [1, 17, 40, 32, 6], [1, 1, 1, 5, 6]
    table = scattered_pages(lens, page_size, 24, seed=3)
    positions = torch.cat([torch.arange(n - new, n) for n, new in zip(lens, news, strict=True)])
    owner = torch.cat([torch.full((new,), i) for i, new in enumerate(news)])
    slots = table[owner, positions // page_size] * page_size + positions % page_size
    starts = [0, *torch.tensor(news).cumsum(0).tolist()]
    return StepBatch(3, starts, lens, table, slots, positions)


@pytest.mark.skipif(attention_cpu._kernel() is None, reason="no C compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_read_in_place_attend_as_the_gathered_copy(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    layout = KVLayout(1, 3, 64, 16, dtype)
    cache = KVCache(layout, 24, CPU)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    batch = _mixed_batch(16, g)
    n = batch.query_start[-1]
    q, k, v = (torch.randn(n, h, 64, generator=g).to(dtype) for h in (9, 3, 3))
    in_place = CpuBackend(layout, CPU)
    assert in_place.kernel is not None
    gathered = CpuBackend(layout, CPU, in_place=False)
    meta = in_place.prepare(batch)
    assert meta.decode_lens is not None and meta.decode_workspace is None  # nothing gathered
    ours = in_place.forward(0, q, k, v, cache, meta)
    ref = gathered.forward(0, q, k, v, cache, gathered.prepare(batch))
    assert ours.dtype == dtype and ours.shape == (n, 9, 64)
    tolerance = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(ours.float(), ref.float(), rtol=0, atol=tolerance)


@pytest.mark.skipif(attention_cpu._kernel() is None, reason="no C compiler here")
def test_a_long_decode_is_split_merged_and_the_same_alone_or_batched() -> None:
    # A 300-token row's 19 pages are two tasks' (16 pages a task) whose sums are merged;
    # 10-token rows beside it have one page and an empty second split. The long row's output
    # is the gathered copy's, and bit for bit the same alone as in a batch of four.
    g = torch.Generator().manual_seed(7)
    layout = KVLayout(1, 3, 64, 16, torch.float32)
    cache = KVCache(layout, 24, CPU)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=g))
    lens = [300, 10, 10, 10]
    table = scattered_pages(lens, 16, 24, seed=1)
    at = torch.tensor(lens) - 1
    slots = table[range(4), at // 16] * 16 + at % 16
    both = StepBatch(4, [0, 1, 2, 3, 4], lens, table, slots, at)
    alone = StepBatch(1, [0, 1], lens[:1], table[:1], slots[:1], at[:1])
    q, k, v = (torch.randn(4, h, 64, generator=g) for h in (9, 3, 3))
    in_place, gathered = CpuBackend(layout, CPU), CpuBackend(layout, CPU, in_place=False)
    ours = in_place.forward(0, q, k, v, cache, in_place.prepare(both))
    ref = gathered.forward(0, q, k, v, cache, gathered.prepare(both))
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    one = in_place.forward(0, q[:1], k[:1], v[:1], cache, in_place.prepare(alone))
    assert torch.equal(one[0], ours[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("page_size", "heads", "kv_heads", "dim"),
    [(16, 9, 3, 64), (5, 8, 2, 32), (16, 4, 4, 128)],  # the bundled model's; others, generic
)
@pytest.mark.parametrize("cached", [0, 37])
def test_a_prefill_chunk_reads_the_pages_in_place(
    monkeypatch: pytest.MonkeyPatch,
    build: ctypes.CDLL,
    dtype: torch.dtype,
    page_size: int,
    heads: int,
    kv_heads: int,
    dim: int,
    cached: int,
) -> None:
    # 45 query rows, fresh or after 37 cached tokens: three blocks of rows, the last one
    # partial, and a chunk that ends (and after context starts) inside a page.
    g = torch.Generator().manual_seed(5)
    n = 45
    context = cached + n
    width = pages_for(context, page_size)
    pages = torch.randperm(2 * width, generator=g)[:width]
    k_cache, v_cache = (
        torch.randn(2 * width, kv_heads, page_size, dim, generator=g).to(dtype) for _ in "kv"
    )
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(n, kv_heads, dim, generator=g).to(dtype) for _ in "kv")
    at = torch.arange(cached, context)
    meta = CpuMetadata(
        pages[at // page_size] * page_size + at % page_size,
        0,
        None,
        None,
        None,
        None,
        (PrefillChunk(0, n, context, pages),),
    )

    def no_sdpa(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("SDPA ran: the pages were gathered")

    monkeypatch.setattr(F, "scaled_dot_product_attention", no_sdpa)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, _layout(k_cache), build)
    monkeypatch.undo()

    # Reference: the pages gathered in float32, each query row masked causally.
    group = heads // kv_heads
    keys = gather_tokens(k_cache, pages, context).float().repeat_interleave(group, 1)
    values = gather_tokens(v_cache, pages, context).float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * dim**-0.5
    causal = torch.arange(context)[None, :] <= at[:, None]
    ref = torch.einsum(
        "hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), values
    )
    assert out.dtype == dtype and out.shape == (n, heads, dim)
    tolerance = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=tolerance)


@pytest.mark.skipif(attention_cpu._kernel() is None, reason="no C compiler here")
def test_a_later_token_s_large_score_stays_out_of_an_earlier_row_s_softmax() -> None:
    # Token 5's key is made to score ~400 against query head 0 of every row: rows 0-4 must
    # not see it, not even as their running max (all their weights would underflow alike).
    g = torch.Generator().manual_seed(9)
    n, page_size = 16, 16
    q = torch.randn(n, 3, 64, generator=g)
    q[:, 0] = q[0, 0]
    k, v = (torch.randn(n, 1, 64, generator=g) for _ in "kv")
    k[5, 0] = 50 * q[0, 0]
    pages = torch.tensor([0])
    k_cache, v_cache = (torch.zeros(1, 1, page_size, 64) for _ in "kv")
    meta = CpuMetadata(torch.arange(n), 0, None, None, None, None, (PrefillChunk(0, n, n, pages),))
    lay = _layout(k_cache)
    ours = paged_attention(q, k, v, k_cache, v_cache, meta, lay, attention_cpu._kernel())
    ref = paged_attention(q, k, v, k_cache, v_cache, meta, lay)  # SDPA on the chunk's own K/V
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize(
    "attn",
    [
        LayerAttention(window=1),
        LayerAttention(window=7, scale=0.3),
        LayerAttention(window=20, softcap=5.0),
        LayerAttention(window=1000, softcap=2.0),
        LayerAttention(scale=0.2, softcap=3.0),
    ],
    ids=["window-1", "window-7-scale", "window-20-softcap", "window-past-context", "softcap"],
)
@pytest.mark.parametrize("in_place", [True, False], ids=["kernel", "gathered"])
def test_gemma_s_windows_and_soft_capping_attend_as_defined(
    page_size: int, attn: LayerAttention, in_place: bool
) -> None:
    # Gemma's layers: a sliding window (the query's own token and the window - 1 before it),
    # scores soft-capped and scaled by query_pre_attn_scalar. Decodes of 1, 17, 40 tokens, a
    # chunk after cached context and a fresh prompt, in the C kernel and the gathered path,
    # against each row computed by itself.
    if in_place and attention_cpu._kernel() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(11)
    layout = KVLayout(1, 3, 64, page_size, torch.float32)
    cache = KVCache(layout, 24, CPU)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=g))
    batch = _mixed_batch(page_size, g)
    n = batch.query_start[-1]
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (9, 3, 3))
    backend = CpuBackend(layout, CPU, in_place=in_place, layers=[attn])
    assert (backend.kernel is not None) == in_place
    ours = backend.forward(0, q, k, v, cache, backend.prepare(batch))
    torch.testing.assert_close(ours, windowed_reference(q, cache, batch, attn), rtol=0, atol=2e-5)
