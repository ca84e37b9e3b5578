"""The CPU attention backend: write new K/V into their page slots, then attend.

A batch holds decode rows first (one query token each), then prefill chunks (many
query tokens each, possibly after cached context). Where our C kernels build
(paged_attention.c), both read the pages in place through the page table: no gather
copy, no mask. Decodes in one call, a row's KV head over 16 of its pages a task (a
row's output the same in any batch); each prefill chunk, after context or not, in blocks
of rows with an online softmax (measured 1.1-3.1x faster than SDPA on 8-2,048 new tokens
after 0-4,096 cached; docs/benchmarks.md). Every prompt row takes the same kernel
whatever the chunking, so a prompt's tokens do not depend on its batch.
Elsewhere decodes' pages are gathered (index_select: measured ~2x faster than advanced
indexing) into a padded [kv_heads, batch, max_context] copy with a length mask; a
prefill chunk with no earlier context attends to its own fresh K/V, one with context
gathers its pages, and both go through SDPA's fused kernel (4-D inputs; see
`heads_first`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.config import ConfigError
from cluster.engine.kernels import native
from cluster.engine.kernels.kv_cache import KVCache, KVLayout
from cluster.engine.kernels.layer_attention import PLAIN, LayerAttention
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.sched.page_pool import pages_for


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first row of this chunk in the batch
    num_tokens: int  # query tokens in this chunk
    context_len: int  # tokens attended to, this chunk's included
    pages: torch.Tensor  # page ids covering context_len tokens (long)


@dataclass(frozen=True)
class CpuMetadata:
    slot_mapping: torch.Tensor  # [N] flat slot (page * page_size + offset) for each new token
    num_decodes: int  # rows [0, num_decodes) are decodes
    decode_pages: torch.Tensor | None  # [num_decodes, max_pages] page ids, padded with 0
    decode_lens: torch.Tensor | None  # [num_decodes] int64 contexts, for the kernel
    # Where the pages are gathered instead (no kernel): their length mask, and a workspace
    # reused by every layer for the copies (a fresh ~100 MB tensor per layer costs more in
    # page faults than the copy itself at large batch x context).
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_pages * page_size] bool
    decode_workspace: torch.Tensor | None  # [2, kv_heads, num_decodes * max_pages, ...]
    prefills: tuple[PrefillChunk, ...]


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.library("paged_attention.c")
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """paged_attention.c's functions typed."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_attention.restype = ctypes.c_int
    lib.paged_attention.argtypes = [
        ptr, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int, i64, ptr, i64, ptr, i64, ctypes.c_float,
        i64, ctypes.c_float,
    ]  # fmt: skip
    lib.paged_prefill.restype = ctypes.c_int
    lib.paged_prefill.argtypes = [
        ptr, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int, i64, ptr, i64, i64, ctypes.c_float,
        i64, ctypes.c_float,
    ]  # fmt: skip
    lib.kv_store.restype = None
    lib.kv_store.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ptr, i64, ptr, i64]
    return lib


class CpuBackend:
    name = "cpu"
    fuses_rope = False

    def __init__(
        self,
        layout: KVLayout,
        device: torch.device,
        in_place: bool = True,
        layers: Sequence[LayerAttention] = (),  # each layer's, where any is not PLAIN
    ) -> None:
        """`in_place`: decodes and prefills read their pages through our kernels where they
        build (else the pages are gathered)."""
        self.layout = layout
        self.device = device
        self.layers = tuple(layers)
        self.kernel = _kernel() if in_place and layout.kind >= 0 else None
        if layout.scaled and self.kernel is None:
            raise ConfigError(
                f"kv_cache_dtype: {layout.kv_name} pages are read by our C kernels "
                "(paged_attention.c), which could not be built or loaded here (is there a C "
                "compiler?); kv_cache_dtype auto serves without them"
            )

    def prepare(self, batch: StepBatch) -> CpuMetadata:
        ps, nd = self.layout.page_size, batch.num_decodes
        decode_pages = decode_lens = decode_mask = workspace = None
        if nd:
            lens = torch.tensor(batch.context_lens[:nd])
            width = pages_for(max(batch.context_lens[:nd]), ps)
            decode_pages = batch.page_table[:nd, :width].contiguous()
            if self.kernel is not None:
                decode_lens = lens
            else:
                mask = torch.arange(width * ps)[None, :] < lens[:, None]
                decode_mask = mask[:, None, None, :]
                lay = self.layout
                workspace = torch.empty(
                    (2, lay.num_kv_heads, nd * width, ps, lay.head_dim), dtype=lay.dtype
                )
        chunks = []
        for i in range(nd, batch.num_seqs):
            start, context = batch.query_start[i], batch.context_lens[i]
            pages = batch.page_table[i, : pages_for(context, ps)]
            chunks.append(PrefillChunk(start, batch.query_start[i + 1] - start, context, pages))
        return CpuMetadata(
            batch.slot_mapping,
            nd,
            decode_pages,
            decode_lens,
            decode_mask,
            workspace,
            tuple(chunks),
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        metadata: CpuMetadata,
    ) -> torch.Tensor:
        attn = self.layers[layer] if self.layers else PLAIN
        return paged_attention(
            q, k, v, cache.k[layer], cache.v[layer], metadata, self.layout, self.kernel, attn
        )


def paged_attention(
    q: torch.Tensor,  # [N, heads, head_dim]
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # this layer's pages (layout.layer_shape)
    v_cache: torch.Tensor,
    batch: CpuMetadata,
    layout: KVLayout,
    kernel: ctypes.CDLL | None = None,  # paged_attention.c, where the decodes read in place
    attn: LayerAttention = PLAIN,
) -> torch.Tensor:
    for cache, x in ((k_cache, k), (v_cache, v)):
        if layout.scaled and kernel is not None:
            store_in_place(kernel, cache, batch.slot_mapping, x, layout)
        else:
            layout.store(cache, batch.slot_mapping, x)
    outs: list[torch.Tensor] = []
    nd = batch.num_decodes
    if nd and batch.decode_lens is not None:
        assert kernel is not None and batch.decode_pages is not None
        outs.append(_decode_in_place(kernel, q[:nd], k_cache, v_cache, batch, layout, attn))
    elif nd:
        assert batch.decode_pages is not None and batch.decode_mask is not None
        assert batch.decode_workspace is not None
        flat = batch.decode_pages.flatten()
        ws_k, ws_v = batch.decode_workspace
        # Gathered heads first, so that each row's pages of a head are one [context] span.
        torch.index_select(k_cache.transpose(0, 1), 1, flat, out=ws_k)
        torch.index_select(v_cache.transpose(0, 1), 1, flat, out=ws_v)
        kv_heads, head_dim = k.shape[1], k.shape[2]
        kd = ws_k.view(kv_heads, nd, -1, head_dim).transpose(0, 1)
        vd = ws_v.view(kv_heads, nd, -1, head_dim).transpose(0, 1)
        mask = batch.decode_mask
        if attn.window is not None:  # the last `window` of each row's context
            lens = mask.flatten(1).sum(1, keepdim=True)
            at = torch.arange(mask.shape[-1])[None, :]
            mask = mask & (at >= lens - attn.window)[:, None, None, :]
        if attn == PLAIN:
            outs.append(_decode_attention(q[:nd], kd, vd, mask))
        else:
            outs.append(_explicit(q[:nd].unsqueeze(2), kd, vd, mask, attn).squeeze(2))
    for c in batch.prefills:
        if kernel is not None:
            rows = q[c.start : c.start + c.num_tokens]
            outs.append(_prefill_in_place(kernel, rows, k_cache, v_cache, c, layout, attn))
            continue
        qc = heads_first(q[c.start : c.start + c.num_tokens])
        if attn != PLAIN:
            kc = heads_first(layout.gather(k_cache, c.pages, c.context_len))
            vc = heads_first(layout.gather(v_cache, c.pages, c.context_len))
            offset = c.context_len - c.num_tokens
            rows = torch.arange(c.num_tokens).unsqueeze(1) + offset
            at = torch.arange(c.context_len).unsqueeze(0)
            mask = at <= rows
            if attn.window is not None:
                mask &= at > rows - attn.window
            out = _explicit(qc, kc, vc, mask, attn)
        elif c.context_len == c.num_tokens:
            kc = heads_first(k[c.start : c.start + c.num_tokens])
            vc = heads_first(v[c.start : c.start + c.num_tokens])
            out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
        else:
            kc = heads_first(layout.gather(k_cache, c.pages, c.context_len))
            vc = heads_first(layout.gather(v_cache, c.pages, c.context_len))
            offset = c.context_len - c.num_tokens
            rows = torch.arange(c.num_tokens, device=q.device).unsqueeze(1) + offset
            mask = torch.arange(c.context_len, device=q.device).unsqueeze(0) <= rows
            out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def store_in_place(
    kernel: ctypes.CDLL, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, lay: KVLayout
) -> None:
    """x [N, kv_heads, head_dim] into 8-bit pages by paged_attention.c's kv_store."""
    xf = x.float().contiguous()
    kernel.kv_store(
        cache.data_ptr(), lay.kind, lay.num_kv_heads, lay.page_size, lay.head_dim,
        slots.data_ptr(), len(slots), xf.data_ptr(), xf.stride(0),
    )  # fmt: skip


def _decode_in_place(
    kernel: ctypes.CDLL,
    q: torch.Tensor,  # [decodes, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: CpuMetadata,
    lay: KVLayout,
    attn: LayerAttention,
) -> torch.Tensor:
    """The decodes' attention by paged_attention.c, reading their pages in place."""
    pages, lens = batch.decode_pages, batch.decode_lens
    assert pages is not None and lens is not None
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    rows, heads, dim = q.shape
    failed = kernel.paged_attention(
        qf.data_ptr(), out.data_ptr(), heads, lay.num_kv_heads, dim, k_cache.data_ptr(),
        v_cache.data_ptr(), lay.kind, lay.page_size, pages.data_ptr(),
        pages.shape[1], lens.data_ptr(), rows, attn.scale_for(dim), attn.window or 0,
        attn.softcap or 0.0,
    )  # fmt: skip
    if failed:
        raise MemoryError("paged_attention: no scratch memory for its scores")
    return out.to(q.dtype)


def _prefill_in_place(
    kernel: ctypes.CDLL,
    q: torch.Tensor,  # [chunk tokens, heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: PrefillChunk,
    lay: KVLayout,
    attn: LayerAttention,
) -> torch.Tensor:
    """A prefill chunk's attention (after its context, if any) by paged_attention.c."""
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    rows, heads, dim = q.shape
    pages = chunk.pages.contiguous()
    failed = kernel.paged_prefill(
        qf.data_ptr(), out.data_ptr(), heads, lay.num_kv_heads, dim, k_cache.data_ptr(),
        v_cache.data_ptr(), lay.kind, lay.page_size, pages.data_ptr(),
        chunk.context_len, rows, attn.scale_for(dim), attn.window or 0, attn.softcap or 0.0,
    )  # fmt: skip
    if failed:
        raise MemoryError("paged_prefill: no scratch memory")
    return out.to(q.dtype)


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, head_dim] -> [1, heads, tokens, head_dim], a view.

    SDPA needs 4-D inputs to pick a fused kernel: with 3-D ones PyTorch runs the unfused
    "math" backend on every device (measured 4x slower on a 1,024-token CPU prefill).
    """
    return x.transpose(0, 1).unsqueeze(0)


FUSED_BF16_DECODE_BATCH = 4


def _decode_attention(
    q: torch.Tensor,  # [batch, heads, head_dim]
    k: torch.Tensor,  # [batch, kv_heads, context, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor,  # [batch, 1, 1, context] bool
) -> torch.Tensor:
    if q.dtype == torch.float32 or q.is_cuda:
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True)
        return out.squeeze(2)
    b, heads, dim = q.shape
    if b <= FUSED_BF16_DECODE_BATCH:
        # A KV head's query heads as that head's query rows: SDPA's fused kernel, no GQA
        # expansion (measured 18 us against 46 for matmuls at batch 1, 128 tokens).
        grouped = q.view(b, k.shape[1], -1, dim)
        return F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask).view(b, heads, dim)
    # Larger batches: on CPU, torch's SDPA kernels measured 1.5-12x slower than two matmuls
    # in bfloat16 at batch 8-64. Query heads grouped by their KV head; softmax in float32.
    scores = torch.matmul(q.view(b, k.shape[1], -1, dim), k.transpose(2, 3)).float()
    scores = (scores * dim**-0.5).masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v).view(b, heads, dim)


def _explicit(
    q: torch.Tensor,  # [b, heads, rows, head_dim]
    k: torch.Tensor,  # [b, kv_heads, context, head_dim]
    v: torch.Tensor,
    mask: torch.Tensor,  # broadcasts to [b, heads, rows, context], True: attended
    attn: LayerAttention,
) -> torch.Tensor:
    """Attention as transformers' eager path computes Gemma's: scores times the scale,
    soft-capped, masked, softmax in float32 (SDPA has no soft-capping)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(2, 3)) * attn.scale_for(q.shape[-1])
    if attn.softcap is not None:
        scores = torch.tanh(scores / attn.softcap) * attn.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
