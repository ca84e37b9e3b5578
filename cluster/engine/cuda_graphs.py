"""CUDA graphs: whole decode steps per batch-size bucket, and the pieces between attention
calls of any other step per token-count bucket.

A decode step of n sequences runs the graph of the smallest bucket >= n. Its inputs
are one int32 buffer on the device (ids, positions, slots, context lengths, query
offsets, page table, each a segment sized for the largest bucket), filled from a
pinned host copy (`Staging`) in one transfer of the part the step reads; the graph writes its
logits into a buffer of its own. Rows past n are padding: slot -1 (the store kernel
writes nothing, so no page is touched) and context length 0 (attention yields zeros).
Sampling runs after the replay, on the device (cluster/engine/sampler.py).

A step with prefill chunks (or one no decode graph takes) of up to PIECEWISE_MAX_TOKENS
tokens replays `PiecewiseGraphs`: the model cut at attention (LlamaModel.before_attention
and after_attention), each piece captured once per token bucket over static buffers, and
attention run eagerly between the replays, sized by the step's own metadata: one capture
serves any mix of decodes and chunks (vLLM's piecewise graphs). Padding rows compute on
stale but finite rows and are never read.

Capture needs a GPU. Decode graphs need the triton backend (its kernels take their sizes
from these buffers, never from the host); the pieces take any backend (FlashInfer's
steps replay them too), and rotate q and k themselves when the backend does not.
Without a GPU the runner runs each step eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cluster.engine.kernels.attention import AttentionBackend
from cluster.engine.kernels.attention_triton import TritonBackend, TritonMetadata
from cluster.engine.kernels.kv_cache import KVCache
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.model.model import LlamaModel
from cluster.engine.sched.page_pool import pages_for

PADDING_SLOT = -1
PIECEWISE_MAX_TOKENS = 512  # the widest step whose pieces are captured (vLLM's default)

Replay = Callable[[], None]
Capture = Callable[[Callable[[], None]], Replay]  # a piece in, what replays it out


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs itself."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*sizes, max_num_seqs]


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two and the points halfway between them (x 1.5) below max_tokens, then
    max_tokens itself: a step pads at most a third of its rows."""
    sizes = {b for i in range(max_tokens.bit_length()) for b in (1 << i, 3 << i >> 1)}
    return [*sorted(b for b in sizes if b < max_tokens), max_tokens]


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


class Staging:
    """A pinned host buffer a step fills and copies to the device without waiting: `ready`
    blocks until the previous step's copy has read it (an event recorded after that copy),
    so a refill never overwrites bytes a copy still in flight reads. A buffer that is not
    pinned copies synchronously and has nothing to wait for."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.copied = torch.cuda.Event() if host.is_pinned() else None

    def ready(self) -> torch.Tensor:
        """The host buffer, free to refill."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host

    def copy_to(self, device_buffer: torch.Tensor, n: int | None = None) -> None:
        """The first `n` values (all, None) to `device_buffer`, on the current stream."""
        src, dst = (self.host, device_buffer) if n is None else (self.host[:n], device_buffer[:n])
        dst.copy_(src, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


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
        self.inputs = torch.zeros(self.seg.size, dtype=torch.int32, device=device)
        off = self.seg.offsets()
        self.inputs[off["slots"] : off["lens"]] = PADDING_SLOT  # capture writes no page
        self.inputs[off["starts"] : off["table"]] = torch.arange(self.seg.rows + 1)
        self.staging = Staging(self.inputs.cpu().pin_memory())
        # The logits rows: a graph holds no tensor it reads, so this object holds them all.
        self.rows = torch.arange(self.seg.rows, device=device)
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
        rows = self.rows[:b]
        return lambda: model.forward(
            part("ids", b).long(), part("positions", b).long(), attention, metadata, cache, rows
        )

    def run(self, batch: StepBatch, ids: list[int]) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode step of n rows; None when no bucket holds n."""
        bucket = bucket_for(len(ids), self.buckets)
        if bucket is None or batch.page_table.shape[1] > self.seg.width:
            return None
        fill(self.staging.ready(), self.seg, batch, ids, bucket)
        self.staging.copy_to(self.inputs, self.seg.read(len(ids), batch.page_table.shape[1]))
        self.graphs[bucket].replay()
        return self.logits[bucket][: len(ids)]


def cuda_capture() -> Capture:
    """Captures pieces into CUDA graphs sharing one memory pool: each piece leaves its
    results in buffers allocated outside the pool, so no replay needs another's memory."""
    pool = torch.cuda.graph_pool_handle()

    def capture(piece: Callable[[], None]) -> Replay:
        piece()  # compiles its kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            piece()
        return graph.replay

    return capture


class PiecewiseGraphs:
    """The model's pieces between attention calls, per token bucket; `run` replays them
    around eager attention. Piece i finishes layer i - 1 from attention's output (piece 0
    embeds the ids instead) and runs layer i up to its qkv projection, its q/k norms, and
    RoPE unless the attention backend rotates q and k itself (the last piece leaves the
    final residual and MLP output for the logits)."""

    def __init__(
        self,
        model: LlamaModel,
        attention: AttentionBackend,
        cache: KVCache,
        max_tokens: int,
        device: torch.device,
        capture: Capture,
    ) -> None:
        s, dtype = model.spec, model.norm.dtype
        self.model, self.attention, self.cache = model, attention, cache
        self.buckets = token_buckets(max_tokens)
        rows = self.buckets[-1]
        # The step's token ids and positions: one copy to the device a step.
        pinned = device.type == "cuda"
        self.staging = Staging(torch.zeros(2, rows, dtype=torch.long, pin_memory=pinned))
        self.inputs = torch.zeros(2, rows, dtype=torch.long, device=device)
        self.x = torch.zeros(rows, s.hidden_size, dtype=dtype, device=device)  # residual
        self.mlp = torch.zeros_like(self.x)  # the last layer's MLP output
        qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        self.qkv = torch.zeros(rows, qkv, dtype=dtype, device=device)
        self.a = torch.zeros(rows, s.num_heads * s.head_dim, dtype=dtype, device=device)
        pieces = range(len(model.layers) + 1)
        self.replays = {  # largest first: the smaller ones reuse its memory
            b: [capture(self._piece(i, b)) for i in pieces] for b in reversed(self.buckets)
        }

    def _piece(self, i: int, b: int) -> Callable[[], None]:
        m, last = self.model, len(self.model.layers)
        x, a = self.x[:b], self.a[:b]

        def keep(dst: torch.Tensor, src: torch.Tensor) -> None:
            if src is not dst:  # on CUDA the fused add writes the residual in place
                dst.copy_(src)

        def run() -> None:
            mlp = None
            ids, positions = self.inputs[:, :b]
            if i == 0:
                x.copy_(m.embed_tokens(ids))
            else:
                new_x, mlp = m.after_attention(i - 1, x, a)
                keep(x, new_x)
            if i < last:
                new_x, qkv = m.before_attention(i, x, mlp)
                keep(x, new_x)
                self.qkv[:b].copy_(qkv)
                qk, _ = m.heads(self.qkv[:b])
                if m.spec.qk_norm:  # Qwen3's, Gemma 3's: each head normed before RoPE
                    keep(qk, m.norm_heads(i, qk))
                if not self.attention.fuses_rope:
                    keep(qk, m.rope(i, qk, positions, m.rope_rows(positions)))
            else:
                assert mlp is not None
                self.mlp[:b].copy_(mlp)

        return run

    def run(
        self,
        batch: StepBatch,
        ids: list[int],
        metadata: Any,  # attention.prepare(batch)
        logits_rows: torch.Tensor,
        on_layer: Callable[[int], None] | None,
    ) -> torch.Tensor | None:
        """Logits of `logits_rows` of a step of len(ids) tokens; None when no bucket holds
        it. `on_layer(i)` runs once layer i's KV is in the cache, as in model.forward."""
        n = len(ids)
        bucket = bucket_for(n, self.buckets)
        if bucket is None:
            return None
        host = self.staging.ready()
        host[0, :n] = torch.tensor(ids)
        host[1, :n] = batch.positions
        self.staging.copy_to(self.inputs)  # 16 bytes a row: all of it
        m, heads = self.model, self.model.spec.num_heads
        *layers, last = self.replays[bucket]
        for i, replay in enumerate(layers):
            replay()
            qk, v = m.heads(self.qkv[:n])
            out = self.attention.forward(i, qk[:, :heads], qk[:, heads:], v, self.cache, metadata)
            self.a[:n].copy_(out.view(n, -1))
            if on_layer is not None:
                on_layer(i)
        last()
        return m.logits(self.x[:n], self.mlp[:n], logits_rows)
