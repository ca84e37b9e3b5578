"""The FlashInfer attention backend: FlashInfer's paged prefill kernel for every row.

A decode row is a query of one token; FlashInfer's causal mask aligns a chunk's queries
to the end of its context, so decodes, prefix hits and later chunks are one batch. The
step is planned once (`prepare`) and run per layer over the cache's own [pages, kv_heads,
page_size, head_dim] tensors (head-major: FlashInfer's "HND"), read in place.

Selected only on CUDA with flashinfer installed; it has not run yet (no GPU here).
"""

from __future__ import annotations

import itertools

import torch

from cluster.engine.kernels.kv_cache import KVCache, KVLayout, store_tokens
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.sched.page_pool import pages_for

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's scratch for split-K partials


class FlashInferBackend:
    name = "flashinfer"
    fuses_rope = False

    def __init__(self, layout: KVLayout, num_heads: int, device: torch.device) -> None:
        import flashinfer

        self.layout = layout
        self.num_heads = num_heads
        self.device = device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")

    def prepare(self, batch: StepBatch) -> torch.Tensor:
        """Plans the step; the metadata is the slot of each new token."""
        lay, ps = self.layout, self.layout.page_size
        counts = [pages_for(n, ps) for n in batch.context_lens]
        pages = torch.cat([batch.page_table[i, :c] for i, c in enumerate(counts)])
        ints = lambda xs: torch.tensor(xs, dtype=torch.int32)  # plan reads these on the host
        self.wrapper.plan(
            ints(batch.query_start),
            ints([0, *itertools.accumulate(counts)]),
            pages.to(self.device, torch.int32),
            ints([(n - 1) % ps + 1 for n in batch.context_lens]),
            self.num_heads,
            lay.num_kv_heads,
            lay.head_dim,
            ps,
            causal=True,
            q_data_type=lay.dtype,
            kv_data_type=lay.dtype,
        )
        return batch.slot_mapping.to(self.device)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        metadata: torch.Tensor,
    ) -> torch.Tensor:
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        store_tokens(k_cache, metadata, k)
        store_tokens(v_cache, metadata, v)
        out: torch.Tensor = self.wrapper.run(q.contiguous(), (k_cache, v_cache))
        return out
