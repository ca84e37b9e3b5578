"""Executes a scheduled step: lays the batch out, runs the model, returns logits.

Only sequences whose last token's KV is computed in this step get a logits row:
every decode, and a prefill chunk that finishes its sequence's uncomputed tokens; after
those rows, the prompt positions whose logprobs a request asked for (`prompt_rows`).
A decode-only step replays a captured CUDA graph when the engine has them; any other step
of up to PIECEWISE_MAX_TOKENS tokens replays the graphs of the model's pieces between
attention calls (cluster/engine/cuda_graphs.py). On the CPU, a model whose matrices are all
on our integer kernel runs its layers in one C call a step (cluster/engine/layer_loop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cluster.engine import layer_loop
from cluster.engine.kernels.attention import AttentionBackend, make_backend
from cluster.engine.kernels.attention_cpu import CpuMetadata
from cluster.engine.kernels.kv_cache import KVCache
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.model.checkpoint import ModelSpec
from cluster.engine.model.model import LlamaModel
from cluster.engine.sched.block_table import BlockTables
from cluster.engine.sched.page_pool import pages_for
from cluster.engine.sched.scheduler import Step
from cluster.engine.sched.sequence import Sequence

if TYPE_CHECKING:  # it imports triton, which a CPU-only install may lack
    from cluster.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs


@dataclass(frozen=True)
class StepInputs:
    """One step's model inputs on the host."""

    ids: list[int]
    batch: StepBatch  # its positions are the model's
    sampled: list[Sequence]  # the sequences that get a next token
    logits_rows: list[int]  # their rows, then the rows of prompt_rows(step), in order


def prompt_rows(step: Step) -> list[tuple[Sequence, int, int]]:
    """(seq, first position, count): the prompt positions of this step whose logits the
    prompt's logprobs need (position p predicts token p + 1 of the prompt)."""
    return [
        (seq, seq.num_computed, end - seq.num_computed)
        for seq, n in step.prefills
        if seq.sampling.prompt_logprobs is not None
        and (end := min(seq.num_computed + n, seq.num_prompt - 1)) > seq.num_computed
    ]


def lay_out(step: Step, page_size: int, tables: BlockTables) -> StepInputs:
    """The step as token ids, positions and the attention layout, decodes first."""
    ps, nd = page_size, len(step.decodes)
    seqs = [(s, 1) for s in step.decodes] + list(step.prefills)
    context_lens = [s.num_computed + n for s, n in seqs]
    width = max(pages_for(c, ps) for c in context_lens)
    table = tables.table([s for s, _ in seqs], width)
    ids = [s.token_ids[s.num_computed] for s in step.decodes]
    pos = torch.tensor(context_lens[:nd], dtype=torch.long) - 1
    positions = [pos]
    slots = [table[torch.arange(nd), pos // ps] * ps + pos % ps]
    starts = list(range(nd + 1))
    # A decode row is sampled unless it is a prompt's one-token chunk short of its end.
    rows = [i for i, s in enumerate(step.decodes) if s.num_computed + 1 == len(s.token_ids)]
    sampled = [step.decodes[i] for i in rows]
    for i in range(nd, len(seqs)):
        seq, context = seqs[i][0], context_lens[i]
        ids.extend(seq.token_ids[seq.num_computed : context])
        pos = torch.arange(seq.num_computed, context)
        positions.append(pos)
        slots.append(table[i, pos // ps] * ps + pos % ps)
        starts.append(len(ids))
        if context == len(seq.token_ids):
            sampled.append(seq)
            rows.append(len(ids) - 1)
    first = {id(s): starts[nd + i] for i, (s, _) in enumerate(step.prefills)}
    for seq, _, count in prompt_rows(step):
        rows.extend(range(first[id(seq)], first[id(seq)] + count))
    batch = StepBatch(nd, starts, context_lens, table, torch.cat(slots), torch.cat(positions))
    return StepInputs(ids, batch, sampled, rows)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        attention: AttentionBackend,
        device: torch.device,
        max_model_len: int,
        graphs: DecodeGraphs | None = None,
        pieces: PiecewiseGraphs | None = None,
        loop: layer_loop.LayerLoop | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        self.device = device
        self.tables = BlockTables(pages_for(max_model_len, cache.layout.page_size))
        self.graphs = graphs
        self.pieces = pieces
        self.loop = loop

    def run(
        self, step: Step, on_layer: Callable[[int], None] | None = None
    ) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences that get a next token, and their logits rows [len, vocab].

        `on_layer(i)` runs as soon as layer i's KV for this step is in the cache (in every
        rank's, with tensor parallelism: after the layer's all-reduces).
        """
        inputs = lay_out(step, self.cache.layout.page_size, self.tables)
        if self.graphs is not None and not step.prefills and on_layer is None:
            logits = self.graphs.run(inputs.batch, inputs.ids)
            if logits is not None:
                rows = inputs.logits_rows
                return inputs.sampled, logits if len(rows) == len(logits) else logits[rows]
        metadata = self.attention.prepare(inputs.batch)
        wanted = torch.tensor(inputs.logits_rows, dtype=torch.long).to(self.device)
        if self.pieces is not None:
            logits = self.pieces.run(inputs.batch, inputs.ids, metadata, wanted, on_layer)
            if logits is not None:
                return inputs.sampled, logits
        ids = torch.tensor(inputs.ids, dtype=torch.long)
        if self.loop is not None:
            assert isinstance(metadata, CpuMetadata)
            logits = self.loop.forward(ids, inputs.batch.positions, metadata, wanted, on_layer)
            return inputs.sampled, logits
        if self.model.group is not None:  # the other ranks run the same step on theirs
            self.model.group.send_step(ids, inputs.batch, wanted)
        logits = self.model.forward(
            ids.to(self.device),
            inputs.batch.positions.to(self.device),
            self.attention,
            metadata,
            self.cache,
            wanted,
            on_layer,
        )
        return inputs.sampled, logits

    def follow(self) -> None:
        """A rank > 0: each step rank 0 sends, run on this rank's shard and KV cache (its
        logits are rank 0's to sample), until rank 0 stops."""
        group = self.model.group
        assert group is not None
        while (step := group.receive_step()) is not None:
            ids, batch, rows = step
            metadata = self.attention.prepare(batch)
            d = self.device
            self.model.forward(
                ids.to(d), batch.positions.to(d), self.attention, metadata, self.cache, rows.to(d)
            )
        group.close()

    def stop_followers(self) -> None:
        """Rank 0: end the other ranks' `follow`, and leave the group."""
        group = self.model.group
        assert group is not None
        try:
            group.stop()
        finally:  # a group that lost a rank is left too: the next engine here joins anew
            group.close()


def graph_kinds(backend: str, device: torch.device) -> tuple[bool, bool]:
    """(whole decode steps, pieces between attention calls): the CUDA graphs a runner on
    `backend` replays. Decode graphs need the triton backend (its kernels take their sizes
    from device buffers); pieces run with any backend on CUDA (attention stays eager)."""
    cuda = device.type == "cuda"
    return cuda and backend == "triton", cuda


def workspace_bytes(
    spec: ModelSpec,
    item: int,  # bytes per activation value
    backend: str,
    device: torch.device,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> int:
    """What a runner allocates besides weights and KV at its widest step, an upper bound:
    activations of max_num_batched_tokens rows (residual and its norm, q/k/v, attention's
    output, the MLP's gate, up and their product), float32 logits of max_num_seqs rows
    and the sampler's probabilities, and the backend's scratch (Triton's split-K
    partials, FlashInfer's workspace). Decode graphs hold their own copy for their largest
    bucket, in a pool no eager step reuses; the piecewise graphs their static buffers and
    their pool's temporaries, a row's activations each, for PIECEWISE_MAX_TOKENS rows at
    most."""
    per_row = (
        2 * spec.hidden_size
        + (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        + 3 * spec.intermediate_size
    ) * item
    logits = 2 * max_num_seqs * spec.vocab_size * 4
    scratch = 0
    if backend == "triton":
        from cluster.engine.kernels.attention_triton import MAX_SPLITS

        scratch = max_num_seqs * spec.num_heads * MAX_SPLITS * (spec.head_dim + 2) * 4
    elif backend == "flashinfer":
        from cluster.engine.kernels.attention_flashinfer import WORKSPACE_BYTES

        scratch = WORKSPACE_BYTES
    eager = max(max_num_batched_tokens, max_num_seqs) * per_row + logits + scratch
    decode_graphs, pieces = graph_kinds(backend, device)
    total = eager + (max_num_seqs * per_row + logits + scratch if decode_graphs else 0)
    if pieces:
        from cluster.engine.cuda_graphs import PIECEWISE_MAX_TOKENS

        total += 2 * min(PIECEWISE_MAX_TOKENS, max_num_batched_tokens) * per_row
    return total


def build_runner(
    model: LlamaModel,
    cache: KVCache,
    backend: str,  # resolve_backend's answer
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    device: torch.device,
) -> ModelRunner:
    """A runner on `backend`; on CUDA its steps replay CUDA graphs (`graph_kinds`), unless
    the model is split across ranks or routes its MLP to experts (Mixtral, Qwen3-MoE):
    its steps then run eager."""
    rope = (model.cos, model.signed_sin)
    attention = make_backend(
        backend, cache.layout, model.spec.num_heads, device, rope, model.attention_layers()
    )
    decode_graphs, pieces = graph_kinds(backend, device)
    # graphs: no experts (which rows go to which expert is data)
    if not pieces or model.group is not None or model.spec.experts:
        loop = layer_loop.build(model, cache, attention)
        return ModelRunner(model, cache, attention, device, max_model_len, loop=loop)
    from cluster.engine.cuda_graphs import (
        PIECEWISE_MAX_TOKENS,
        DecodeGraphs,
        PiecewiseGraphs,
        cuda_capture,
    )
    from cluster.engine.kernels.attention_triton import TritonBackend

    graphs = None
    if decode_graphs:
        assert isinstance(attention, TritonBackend)
        graphs = DecodeGraphs(model, attention, cache, max_num_seqs, max_model_len, device)
    tokens = min(PIECEWISE_MAX_TOKENS, max_num_batched_tokens)
    replays = PiecewiseGraphs(model, attention, cache, tokens, device, cuda_capture())
    torch.cuda.synchronize(device)
    return ModelRunner(model, cache, attention, device, max_model_len, graphs, replays)
