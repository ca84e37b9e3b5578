"""CUDA-graph decode: one captured model step per batch-size bucket.

A decode step of n sequences runs the graph of the smallest bucket >= n. Its inputs
are one int32 buffer on the device (ids, positions, slots, context lengths, query
offsets, page table, each a segment sized for the largest bucket), filled from a
pinned host copy in one transfer of the part the step reads; the graph writes its
logits into a buffer of its own. Rows past n are padding: slot -1 (the store kernel
writes nothing, so no page is touched) and context length 0 (attention yields zeros).
Sampling runs after the replay, on the device (cluster/engine/sampler.py).

Capture needs a GPU and the triton backend (its kernels take their sizes from these
buffers, never from the host); elsewhere the runner runs each step eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.engine.attention_triton import TritonBackend, TritonMetadata
from cluster.engine.kv_cache import KVCache
from cluster.engine.model import LlamaModel
from cluster.engine.page_pool import pages_for
from cluster.engine.step_batch import StepBatch

PADDING_SLOT = -1


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs itself."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*sizes, max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows; None when n exceeds them all."""
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True)
class Segments:
    """Where each input lives in the flat int32 buffer, for up to `rows` rows."""

    rows: int
    width: int  # page-table columns

    def offsets(self) -> dict[str, int]:
        r = self.rows
        return {
            "ids": 0,
            "positions": r,
            "slots": 2 * r,
            "lens": 3 * r,
            "starts": 4 * r,
            "table": 5 * r + 1,
        }

    @property
    def size(self) -> int:
        return 5 * self.rows + 1 + self.rows * self.width

    def read(self, rows: int, width: int) -> int:
        """How much of the buffer a step of `rows` sequences with `width` pages each reads:
        its leading part, up to the last row's last page (the replay copies no more)."""
        return self.offsets()["table"] + (rows - 1) * self.width + width


def fill(
    buffer: torch.Tensor,  # [Segments.size] int32, host
    seg: Segments,
    batch: StepBatch,
    ids: list[int],
    bucket: int,
) -> None:
    """Write a decode step padded to `bucket` rows into the buffer's segments."""
    n, off = len(ids), seg.offsets()
    assert batch.num_decodes == batch.num_seqs == n <= bucket <= seg.rows

    def put(name: str, values: torch.Tensor, padding: int) -> None:
        at = off[name]
        buffer[at : at + n] = values
        buffer[at + n : at + bucket] = padding

    put("ids", torch.tensor(ids), 0)
    put("positions", batch.positions, 0)
    put("slots", batch.slot_mapping, PADDING_SLOT)
    put("lens", torch.tensor(batch.context_lens), 0)
    table = buffer[off["table"] : off["table"] + bucket * seg.width].view(bucket, seg.width)
    width = batch.page_table.shape[1]
    table[:n, :width] = batch.page_table
    table[:n, width:] = 0
    table[n:] = 0


class DecodeGraphs:
    """Captured decode steps; `run` replays the one for the step's bucket."""

    def __init__(
        self,
        model: LlamaModel,
        attention: TritonBackend,
        cache: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        assert device.type == "cuda" and torch.cuda.is_available()
        self.buckets = bucket_sizes(max_num_seqs)
        self.seg = Segments(self.buckets[-1], pages_for(max_model_len, cache.layout.page_size))
        self.host = torch.zeros(self.seg.size, dtype=torch.int32).pin_memory()
        self.inputs = torch.zeros(self.seg.size, dtype=torch.int32, device=device)
        off = self.seg.offsets()
        self.inputs[off["slots"] : off["lens"]] = PADDING_SLOT  # capture writes no page
        self.inputs[off["starts"] : off["table"]] = torch.arange(self.seg.rows + 1)
        self.host.copy_(self.inputs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            # A split count per bucket, fixed in its graph: each sequence's partitions
            # follow from its own length (paged_kernels), so any context fits it.
            step = self._step(model, attention, cache, b, attention.splits(b, max_model_len))
            step()  # compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = step()
            self.graphs[b] = graph
        torch.cuda.synchronize(device)

    def _step(
        self, model: LlamaModel, attention: TritonBackend, cache: KVCache, b: int, splits: int
    ) -> Callable[[], torch.Tensor]:
        off, buf = self.seg.offsets(), self.inputs
        part = lambda name, n: buf[off[name] : off[name] + n]
        metadata = TritonMetadata(
            slot_mapping=part("slots", b),
            positions=part("positions", b),
            page_table=part("table", b * self.seg.width).view(b, self.seg.width),
            context_lens=part("lens", b),
            query_start=part("starts", b + 1),
            num_decodes=b,
            max_query_len=0,
            num_splits=splits,
        )
        rows = torch.arange(b, device=buf.device)
        return lambda: model.forward(
            part("ids", b).long(), part("positions", b).long(), attention, metadata, cache, rows
        )

    def run(self, batch: StepBatch, ids: list[int]) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode step of n rows; None when no bucket holds n."""
        bucket = bucket_for(len(ids), self.buckets)
        if bucket is None or batch.page_table.shape[1] > self.seg.width:
            return None
        # The previous step's copy has landed: its sampled tokens came back to the host.
        fill(self.host, self.seg, batch, ids, bucket)
        read = self.seg.read(len(ids), batch.page_table.shape[1])
        self.inputs[:read].copy_(self.host[:read], non_blocking=True)
        self.graphs[bucket].replay()
        return self.logits[bucket][: len(ids)]
