"""The KV cache tensors: one preallocated pool of pages per layer, sized from a memory budget,
and the one definition of a KV page's format (KVLayout), which every kernel, the transfer
and the compatibility hash read.

Layout per layer, head-major (vLLM's "HND"): k[layer] and v[layer] are [num_pages,
num_kv_heads, page_size, head_dim]. So one page of one layer is one contiguous block, a
run of consecutive page ids one contiguous span, and one KV head range of a page one
contiguous run (what a transfer between different tensor-parallel splits sends as one
descriptor). Token slot `page * page_size + offset` of head h lies at
`((page * num_kv_heads + h) * page_size + offset) * head_dim` elements.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch

from cluster.engine.sched.page_pool import pages_for


class KVShape(Protocol):
    """What a model's spec tells the cache (model.checkpoint.ModelSpec has these)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True)
class KVLayout:
    """The format of one cache's pages (a rank's heads, with tensor parallelism)."""

    ORDER: ClassVar[str] = "k,v:[layers,pages,kv_heads,page_size,head_dim]"  # head-major

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @staticmethod
    def of(spec: KVShape, page_size: int, dtype: torch.dtype) -> KVLayout:
        return KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size, dtype)

    def layer_shape(self, num_pages: int) -> tuple[int, int, int, int]:
        """One layer's K (or V) tensor."""
        return (num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def item_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def head_bytes(self) -> int:
        """One KV head of one page of one layer of K (or V): one contiguous run."""
        return self.page_size * self.head_dim * self.item_bytes

    @property
    def page_bytes(self) -> int:
        """One page of one layer of K (or V): its heads' runs back to back."""
        return self.num_kv_heads * self.head_bytes

    def head_runs(self, num_pages: int, heads: range) -> np.ndarray:
        """Byte offsets, into a K (or V) tensor of every layer, of each (layer, page)'s run
        of this cache's heads `heads` (counted from its first), layer by layer then page by
        page; a run is len(heads) * head_bytes long (what a transfer descriptor covers)."""
        pages = np.arange(self.num_layers * num_pages, dtype=np.uint64)
        return pages * np.uint64(self.page_bytes) + np.uint64(heads.start * self.head_bytes)

    @property
    def hash_input(self) -> str:
        """What two peers' pages must agree on beyond the model (cluster.transfer.wire's
        compat_hash): the order, the page size, the dtype and the head size; not the layer
        or head counts, which the model gives and tensor parallelism splits."""
        return f"{self.ORDER}|{self.page_size}|{self.dtype}|{self.head_dim}"

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.item_bytes

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_for(self, budget_bytes: float) -> int:
        return int(budget_bytes // self.bytes_per_page)

    def capacity_report(self, num_pages: int, max_len: int) -> str:
        """How many sequences this much KV memory lets one batch, in numbers."""
        tokens = num_pages * self.page_size
        per_max = pages_for(max_len, self.page_size)
        fits = ", ".join(
            f"{num_pages // pages_for(n, self.page_size)} of {n}"
            for n in (512, 2048)
            if n < max_len
        )
        return (
            f"KV cache: {num_pages * self.bytes_per_page / 2**30:.2f} GiB in {num_pages} pages of "
            f"{self.page_size} tokens ({self.bytes_per_token / 1024:.1f} KiB/token, "
            f"{tokens} tokens); fits {num_pages // per_max} sequences of the max length "
            f"{max_len}" + (f", or {fits} tokens" if fits else "")
        )


class KVCache:
    """Owns the page tensors; the PagePool decides which pages are whose."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        shape = (layout.num_layers, *layout.layer_shape(num_pages))
        self.layout = layout
        self.num_pages = num_pages
        self.k = _zeros(shape, layout.dtype, device)
        self.v = _zeros(shape, layout.dtype, device)


def store_tokens(pages: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [N, kv_heads, head_dim] into token slots `slots` [N] (page * page_size + offset)
    of one layer's pages (k[layer] or v[layer])."""
    page_size = pages.shape[2]
    pages[slots // page_size, :, slots % page_size] = x


def gather_tokens(pages: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens held in pages `ids` (in order) of one layer's pages, as a copy
    [n, kv_heads, head_dim]."""
    return pages[ids].transpose(1, 2).flatten(0, 1)[:n]


MADV_HUGEPAGE = 14


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on Linux CPU backed by transparent huge pages where the kernel allows.

    Huge pages matter to the KV transfer: UCX's cross-memory attach pins the pages it
    copies, and with 4 KiB pages that pinning halved the bandwidth (6 vs 11 GB/s here).
    """
    t = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu" and sys.platform == "linux":
        start = -(-t.data_ptr() // 4096) * 4096
        end = (t.data_ptr() + t.numel() * t.element_size()) // 4096 * 4096
        if end > start:  # advice only: refused (THP off) is fine
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)
    return t.zero_()
