"""Decode attention: the bfloat16 CPU path (two matmuls) agrees with SDPA in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cluster.engine.attention import _decode_attention


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
