"""The KV cache tensors: one preallocated pool of pages per layer, sized from a memory budget,
and the one definition of a KV page's format (KVLayout), which every kernel, the transfer
and the compatibility hash read.

Layout per layer, head-major (vLLM's "HND"): k[layer] and v[layer] are [num_pages,
num_kv_heads, page_size, head_dim]. So one page of one layer is one contiguous block, a
run of consecutive page ids one contiguous span, and one KV head range of a page one
contiguous run (what a transfer between different tensor-parallel splits sends as one
descriptor). Token slot `page * page_size + offset` of head h lies at
`((page * num_kv_heads + h) * page_size + offset) * head_dim` elements.

8-bit KV (`engine.kv_cache_dtype` fp8_e4m3, fp8_e5m2, int8) keeps a scale per token and
KV head, a power of two in one byte (an exponent, as OCP's MX formats' E8M0): each head run
is its page_size * head_dim codes, then its tokens' scale bytes, padded to a multiple of
16 (SCALE_BYTES at 16-token pages, so runs stay 16-byte aligned); a layer's tensor is those
runs as bytes, [num_pages, num_kv_heads, head_bytes] uint8. A value is its code times
2^(its token's byte - 127). A token's scale is set from its own largest magnitude alone
(that magnitude over it falls in [2^(SHIFT-1), 2^SHIFT), below the dtype's largest code),
and dividing by a power of two is exact, so a token's codes never change once written and
depend on its values only: a row reads the same bytes whatever the batching (a prompt at
once, in chunks, on another worker, recomputed after preemption), as with float pages.
Why this and not a float32 scale per page and head (the same 16 bytes a run): a page's
scale is set before its later tokens come, so either a larger one re-codes the earlier
(and a row that read them before reads other bytes than one after: measured, tokens moved
with the chunking) or it clips them; and per token the scale fits each token, not the
page's largest. Against a float32 scale per token: 1 byte, not 4 (1.97x bfloat16's tokens
at head_dim 64, not 1.88x). Every reader (paged_attention.c, the Triton kernels) reads
codes in place and applies a token's scale to its score and its weight, not to each
element.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch

from cluster.engine.sched.page_pool import pages_for

# engine.kv_cache_dtype's names (auto: the model's dtype) and what each stores.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
# An 8-bit dtype's largest code (QMAX), and where a token's scale puts its largest
# magnitude: in [2^(SHIFT-1), 2^SHIFT), below QMAX (int8: up to 127.5, rounded to 127 at
# most; e4m3 up to 256 of 448, e5m2 up to 2^15 of 57344: their relative steps are the same
# over the range, so leaving its top unused costs nothing).
QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
SHIFT = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15, torch.int8: 7}
SCALE_BYTES = 16  # a 16-token run's scale bytes, one a token (a multiple of 16 in general)
# The C kernels' name for each stored dtype (kv_pages.h).
KIND = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float8_e4m3fn: 2,
    torch.float8_e5m2: 3,
    torch.int8: 4,
}


def kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """What `engine.kv_cache_dtype: name` stores beside a model of `model_dtype`."""
    return KV_CACHE_DTYPES[name] or model_dtype


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

    ORDER: ClassVar[str] = "k,v:[layers,pages,kv_heads,page_size,head_dim(,scale)]"

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype  # what a value is stored as: float32, bfloat16, or an 8-bit code

    @staticmethod
    def of(spec: KVShape, page_size: int, dtype: torch.dtype) -> KVLayout:
        return KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size, dtype)

    @property
    def scaled(self) -> bool:
        """8-bit: each head run carries its scale."""
        return self.dtype in QMAX

    @property
    def kind(self) -> int:
        """The C kernels' name for the format (kv_pages.h); -1 where they have none."""
        return KIND.get(self.dtype, -1)

    @property
    def tensor_dtype(self) -> torch.dtype:
        return torch.uint8 if self.scaled else self.dtype

    def layer_shape(self, num_pages: int) -> tuple[int, ...]:
        """One layer's K (or V) tensor: its values, or (8-bit) its runs as bytes."""
        if self.scaled:
            return (num_pages, self.num_kv_heads, self.head_bytes)
        return (num_pages, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def head_bytes(self) -> int:
        """One KV head of one page of one layer of K (or V): one contiguous run."""
        codes = self.page_size * self.head_dim * self.dtype.itemsize
        return codes + (-(-self.page_size // 16) * 16 if self.scaled else 0)

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
    def bytes_per_page(self) -> int:
        """K and V of one page across all layers: what the pool is sized in."""
        return 2 * self.num_layers * self.page_bytes

    @property
    def bytes_per_token(self) -> float:
        """K and V of one token across all layers, its share of its page's scales counted."""
        return self.bytes_per_page / self.page_size

    def pages_for(self, budget_bytes: float) -> int:
        return int(budget_bytes // self.bytes_per_page)

    @property
    def kv_name(self) -> str:
        return next(n for n, d in KV_CACHE_DTYPES.items() if d == self.dtype)

    def values(self, pages: torch.Tensor) -> torch.Tensor:
        """One layer's pages as [pages, kv_heads, page_size, head_dim] of the KV dtype: the
        tensor, or (8-bit) a view of its runs' codes."""
        if not self.scaled:
            return pages
        codes = pages[..., : self.page_size * self.head_dim].view(self.dtype)
        return codes.unflatten(-1, (self.page_size, self.head_dim))

    def scale_bytes(self, pages: torch.Tensor) -> torch.Tensor:
        """8-bit: one layer's tokens' scale bytes, a uint8 view [pages, kv_heads, page_size]."""
        at = self.page_size * self.head_dim
        return pages[..., at : at + self.page_size]

    def scales(self, pages: torch.Tensor) -> torch.Tensor:
        """8-bit: one layer's tokens' scales as float32 [pages, kv_heads, page_size]."""
        exponents = self.scale_bytes(pages).int() - 127
        return torch.ldexp(torch.ones(exponents.shape), exponents)

    def store(self, pages: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x [N, kv_heads, head_dim] into token slots `slots` [N] (page * page_size +
        offset) of one layer's pages (k[layer] or v[layer]). 8-bit: each token and head
        coded at its own power-of-two scale (the module docstring), bit for bit as
        kv_pages.h's store."""
        if not self.scaled:
            store_tokens(pages, slots, x)
            return
        x = x.float()
        _, k = torch.frexp(x.abs().amax(-1))  # amax = m 2^k, m in [0.5, 1)
        e = (k - SHIFT[self.dtype]).clamp(-127, 127)
        page, offset = slots // self.page_size, slots % self.page_size
        self.values(pages)[page, :, offset] = self._code(torch.ldexp(x, -e[..., None]))
        self.scale_bytes(pages)[page, :, offset] = (e + 127).to(torch.uint8)

    def _code(self, x: torch.Tensor) -> torch.Tensor:
        """float32 values (over their scale) as the nearest 8-bit codes (ties to even)."""
        qmax = QMAX[self.dtype]
        x = x.clamp(-qmax, qmax)
        return (x.round() if self.dtype == torch.int8 else x).to(self.dtype)

    def gather(self, pages: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
        """The first n tokens held in pages `ids` (in order) of one layer's pages, as a copy
        [n, kv_heads, head_dim] (8-bit: decoded to float32)."""
        if not self.scaled:
            return gather_tokens(pages, ids, n)
        held = self.values(pages)[ids].float() * self.scales(pages)[ids][..., None]
        return held.transpose(1, 2).flatten(0, 1)[:n]

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
            f"KV cache ({self.kv_name}): {num_pages * self.bytes_per_page / 2**30:.2f} GiB in "
            f"{num_pages} pages of {self.page_size} tokens "
            f"({self.bytes_per_token / 1024:.1f} KiB/token, "
            f"{tokens} tokens); fits {num_pages // per_max} sequences of the max length "
            f"{max_len}" + (f", or {fits} tokens" if fits else "")
        )


class KVCache:
    """Owns the page tensors; the PagePool decides which pages are whose."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device) -> None:
        shape = (layout.num_layers, *layout.layer_shape(num_pages))
        self.layout = layout
        self.num_pages = num_pages
        self.k = _zeros(shape, layout.tensor_dtype, device)
        self.v = _zeros(shape, layout.tensor_dtype, device)


def store_tokens(pages: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """x [N, kv_heads, head_dim] into token slots `slots` [N] (page * page_size + offset)
    of one layer's pages of a float dtype (KVLayout.store: any)."""
    page_size = pages.shape[2]
    pages[slots // page_size, :, slots % page_size] = x.to(pages.dtype)


def gather_tokens(pages: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens held in pages `ids` (in order) of one layer's pages of a float
    dtype, as a copy [n, kv_heads, head_dim] (KVLayout.gather: any)."""
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
