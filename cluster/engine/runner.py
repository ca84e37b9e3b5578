"""Executes a scheduled step: builds the batch tensors, runs the model, returns logits.

Only sequences whose last token's KV is computed in this step get a logits row:
every decode, and a prefill chunk that finishes its sequence's uncomputed tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cluster.engine.attention import AttentionBatch, PrefillChunk
from cluster.engine.kv_cache import KVCache
from cluster.engine.model import LlamaModel
from cluster.engine.page_pool import pages_for
from cluster.engine.scheduler import Step
from cluster.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.page_size = cache.layout.page_size
        self.device = device

    def run(
        self, step: Step, on_layer: Callable[[int], None] | None = None
    ) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences that get a next token, and their logits rows [len, vocab].

        `on_layer(i)` runs as soon as layer i's KV for this step is in the cache.
        """
        ps = self.page_size
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        sampled: list[Sequence] = []
        logits_rows: list[int] = []

        decode_pages = decode_mask = workspace = None
        if step.decodes:
            nd = len(step.decodes)
            pos = torch.tensor([s.num_computed for s in step.decodes])
            width = pages_for(int(pos.max()) + 1, ps)
            table = torch.tensor(
                [s.pages[:width] + [0] * (width - len(s.pages[:width])) for s in step.decodes]
            )
            ids.extend(s.token_ids[s.num_computed] for s in step.decodes)
            positions.append(pos)
            slots.append(table[torch.arange(nd), pos // ps] * ps + pos % ps)
            for row, seq in enumerate(step.decodes):
                if seq.num_computed + 1 == len(seq.token_ids):
                    sampled.append(seq)
                    logits_rows.append(row)
            mask = torch.arange(width * ps)[None, :] <= pos[:, None]
            decode_pages = table.to(self.device)
            decode_mask = mask[:, None, None, :].to(self.device)
            k = self.cache.k
            workspace = k.new_empty((2, nd * width, *k.shape[2:]))
        chunks = []
        for seq, n in step.prefills:
            start, context = len(ids), seq.num_computed + n
            pages = torch.tensor(seq.pages[: pages_for(context, ps)])
            ids.extend(seq.token_ids[seq.num_computed : context])
            pos = torch.arange(seq.num_computed, context)
            positions.append(pos)
            slots.append(pages[pos // ps] * ps + pos % ps)
            if context == len(seq.token_ids):
                sampled.append(seq)
                logits_rows.append(len(ids) - 1)
            chunks.append(PrefillChunk(start, n, context, pages.to(self.device)))
        batch = AttentionBatch(
            slot_mapping=torch.cat(slots).to(self.device),
            num_decodes=len(step.decodes),
            decode_pages=decode_pages,
            decode_mask=decode_mask,
            decode_workspace=workspace,
            prefills=tuple(chunks),
        )
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.cat(positions).to(self.device),
            batch,
            self.cache,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            on_layer,
        )
        return sampled, logits
