"""Attention: the bfloat16 CPU decode path (two matmuls) agrees with SDPA in float32, and
prefills run SDPA's fused kernel on the engine's own shapes and match a reference. The
backend and dtype an engine resolves `auto` to, per device."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from cluster.config import ConfigError
from cluster.engine.attention import resolve_backend
from cluster.engine.attention_cpu import (
    CpuMetadata,
    PrefillChunk,
    _decode_attention,
    paged_attention,
)
from cluster.engine.page_pool import pages_for

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
    assert resolve_backend("auto", CUDA, "bfloat16") == "flashinfer"
    assert resolve_backend("auto", CUDA, "float32") == "triton"  # FlashInfer: no fp32 kernels
    assert resolve_backend("auto", CPU, "bfloat16") == "cpu"
    with pytest.raises(ConfigError, match="attention_backend: flashinfer has no float32 kernels"):
        resolve_backend("flashinfer", CUDA, "float32")


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


def _prefill_batch(num_tokens: int, context_len: int, page_size: int) -> CpuMetadata:
    pages = torch.arange(pages_for(context_len, page_size))
    pos = torch.arange(context_len - num_tokens, context_len)
    return CpuMetadata(
        slot_mapping=pages[pos // page_size] * page_size + pos % page_size,
        num_decodes=0,
        decode_pages=None,
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
    k_cache = torch.randn(pages, page_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(pages, page_size, kv_heads, dim, generator=g).to(dtype)
    chosen: list[SDPBackend] = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        choice = torch._fused_sdp_choice(*args, **kwargs)  # type: ignore[attr-defined]
        chosen.append(SDPBackend(choice))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    out = paged_attention(q, k, v, k_cache, v_cache, _prefill_batch(n, context, page_size))
    monkeypatch.undo()
    assert chosen == [SDPBackend.FLASH_ATTENTION]

    # Reference: the whole context in float32, each query row masked causally.
    keys = k_cache.flatten(0, 1)[:context].float().repeat_interleave(3, 1)
    values = v_cache.flatten(0, 1)[:context].float().repeat_interleave(3, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * dim**-0.5
    causal = torch.arange(context)[None, :] <= torch.arange(cached, context)[:, None]
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    ref = torch.einsum("hqk,khd->qhd", weights, values)
    assert out.shape == (n, heads, dim)
    assert (out.float() - ref).abs().max().item() < (1e-4 if dtype == torch.float32 else 0.05)
