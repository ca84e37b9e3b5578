"""The Triton attention backend: our own kernels (paged_kernels.py) read K/V pages in place.

`prepare` packs the step's page table, context lengths, query offsets, slots and
positions into one int32 buffer and copies it to the device once; every layer then
launches two to four kernels (RoPE with the KV store, decode + its reduce, prefill) and
never waits on the host. q and k reach `forward` before RoPE (`fuses_rope`), rotated by
the layer's tables where its LayerAttention has its own, with its window, soft-capping and
score scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.engine.kernels import paged_kernels
from cluster.engine.kernels.kv_cache import KVCache
from cluster.engine.kernels.layer_attention import PLAIN, LayerAttention
from cluster.engine.kernels.step_batch import StepBatch


@dataclass(frozen=True)
class TritonMetadata:
    slot_mapping: torch.Tensor  # [tokens] int32; -1 (padding) writes nothing
    positions: torch.Tensor  # [tokens] int32: RoPE's
    page_table: torch.Tensor  # [seqs, width] int32
    context_lens: torch.Tensor  # [seqs] int32; 0 for a padding row
    query_start: torch.Tensor  # [seqs + 1] int32
    num_decodes: int  # sequences [0, num_decodes) are decodes
    max_query_len: int  # the longest prefill chunk; 0 when there is none
    num_splits: int  # partitions of each decode context (decode_splits)


MAX_SPLITS = 32  # the split-K partials' workspace is sized for this many (runner.workspace_bytes)
MIN_PARTITION = 256  # tokens: shorter partitions cost more in partials than they add


def decode_splits(batch: int, kv_heads: int, max_context: int, programs: int) -> int:
    """Partitions per decode context (split-K): enough that batch x kv_heads x splits
    programs reach `programs` (twice the GPU's SMs), none under MIN_PARTITION tokens of the
    longest context, at most MAX_SPLITS. A large batch fills the GPU alone: one split."""
    fill = -(-programs // max(1, batch * kv_heads))  # a step with no decode: 0 rows
    return max(1, min(MAX_SPLITS, fill, -(-max_context // MIN_PARTITION)))


def programs_for(device: torch.device) -> int:
    """Decode programs that fill `device`: two per SM on a GPU; one on the CPU, where
    Triton's interpreter runs the programs one after another."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


class TritonBackend:
    name = "triton"
    fuses_rope = True

    def __init__(
        self,
        device: torch.device,
        kv_heads: int,
        rope: tuple[torch.Tensor, torch.Tensor],  # the model's cos and signed-sin tables
        block: int = 64,
        layers: Sequence[LayerAttention] = (),  # each layer's, where any is not PLAIN
    ) -> None:
        self.layers = layers
        self.device = device
        self.kv_heads = kv_heads
        self.rope = rope
        self.programs = programs_for(device)
        self.block = block  # query rows and keys per tile

    def splits(self, batch: int, max_context: int) -> int:
        return decode_splits(batch, self.kv_heads, max_context, self.programs)

    def prepare(self, batch: StepBatch) -> TritonMetadata:
        nd, seqs = batch.num_decodes, batch.num_seqs
        host = torch.cat(
            [
                batch.slot_mapping.int(),
                batch.positions.int(),
                torch.tensor(batch.context_lens + batch.query_start, dtype=torch.int32),
                batch.page_table.int().flatten(),
            ]
        )
        packed = host.to(self.device)
        tokens = batch.slot_mapping.shape[0]
        lens = packed[2 * tokens : 2 * tokens + seqs]
        starts = packed[2 * tokens + seqs : 2 * tokens + 2 * seqs + 1]
        table = packed[2 * tokens + 2 * seqs + 1 :].view(seqs, -1)
        chunks = [batch.query_start[i + 1] - batch.query_start[i] for i in range(nd, seqs)]
        return TritonMetadata(
            packed[:tokens],
            packed[tokens : 2 * tokens],
            table,
            lens,
            starts,
            nd,
            max(chunks, default=0),
            self.splits(nd, max(batch.context_lens[:nd], default=0)),
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
        attn = self.layers[layer] if self.layers else PLAIN
        paged_kernels.rope_store_kv(
            q, k, v, k_cache, v_cache, cache.layout, md.slot_mapping, md.positions,
            *(attn.rope or self.rope),
        )  # fmt: skip
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            paged_kernels.paged_decode(
                q[:nd],
                k_cache,
                v_cache,
                cache.layout,
                md.page_table[:nd],
                md.context_lens[:nd],
                md.num_splits,
                out[:nd],
                self.block,
                attn,
            )
        if md.max_query_len:
            paged_kernels.paged_prefill(
                q,
                k_cache,
                v_cache,
                cache.layout,
                md.page_table[nd:],
                md.context_lens[nd:],
                md.query_start[nd:],
                md.max_query_len,
                out,
                self.block,
                self.block,
                attn,
            )
        return out
