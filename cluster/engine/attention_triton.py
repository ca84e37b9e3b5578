"""The Triton attention backend: our own kernels (paged_kernels.py) read K/V pages in place.

`prepare` packs the step's page table, context lengths, query offsets and slots into one
int32 buffer and copies it to the device once; every layer then launches three to five
kernels (store, decode + its reduce, prefill) and never waits on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.engine import paged_kernels
from cluster.engine.attention import StepBatch
from cluster.engine.kv_cache import KVCache


@dataclass(frozen=True)
class TritonMetadata:
    slot_mapping: torch.Tensor  # [tokens] int32; -1 (padding) writes nothing
    page_table: torch.Tensor  # [seqs, width] int32
    context_lens: torch.Tensor  # [seqs] int32; 0 for a padding row
    query_start: torch.Tensor  # [seqs + 1] int32
    num_decodes: int  # sequences [0, num_decodes) are decodes
    max_query_len: int  # the longest prefill chunk; 0 when there is none
    num_splits: int  # decode partitions covering the longest decode context


class TritonBackend:
    name = "triton"

    def __init__(self, device: torch.device, partition: int = 256, block: int = 64) -> None:
        self.device = device
        self.partition = partition  # decode context tokens per program (split-K)
        self.block = block  # query rows and keys per tile

    def splits_for(self, max_context: int) -> int:
        return max(1, -(-max_context // self.partition))

    def prepare(self, batch: StepBatch) -> TritonMetadata:
        nd, seqs = batch.num_decodes, batch.num_seqs
        host = torch.cat(
            [
                batch.slot_mapping.int(),
                torch.tensor(batch.context_lens + batch.query_start, dtype=torch.int32),
                batch.page_table.int().flatten(),
            ]
        )
        packed = host.to(self.device)
        tokens = batch.slot_mapping.shape[0]
        lens = packed[tokens : tokens + seqs]
        starts = packed[tokens + seqs : tokens + 2 * seqs + 1]
        table = packed[tokens + 2 * seqs + 1 :].view(seqs, -1)
        chunks = [batch.query_start[i + 1] - batch.query_start[i] for i in range(nd, seqs)]
        return TritonMetadata(
            packed[:tokens],
            table,
            lens,
            starts,
            nd,
            max(chunks, default=0),
            self.splits_for(max(batch.context_lens[:nd], default=0)),
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        metadata: TritonMetadata,
    ) -> torch.Tensor:
        md, nd = metadata, metadata.num_decodes
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        paged_kernels.store_kv(k, v, k_cache, v_cache, md.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            paged_kernels.paged_decode(
                q[:nd],
                k_cache,
                v_cache,
                md.page_table[:nd],
                md.context_lens[:nd],
                md.num_splits,
                self.partition,
                out[:nd],
                self.block,
            )
        if md.max_query_len:
            paged_kernels.paged_prefill(
                q,
                k_cache,
                v_cache,
                md.page_table[nd:],
                md.context_lens[nd:],
                md.query_start[nd:],
                md.max_query_len,
                out,
                self.block,
                self.block,
            )
        return out
