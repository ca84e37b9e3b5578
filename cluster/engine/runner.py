"""Executes a scheduled step: builds the batch tensors, runs the model, returns logits.

Only sequences whose last token's KV is computed in this step get a logits row:
every decode, and a prefill chunk that finishes its sequence's uncomputed tokens.
"""

from __future__ import annotations

import torch

from cluster.engine.attention import AttentionBatch, PrefillChunk
from cluster.engine.kv_cache import KVCache
from cluster.engine.model import LlamaModel
from cluster.engine.scheduler import Step
from cluster.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.page_size = cache.layout.page_size
        self.device = device

    def run(self, step: Step) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences that get a next token, and their logits rows [len, vocab]."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampled: list[Sequence] = []
        logits_rows: list[int] = []

        def add_tokens(seq: Sequence, n: int) -> None:
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(seq.pages[p // ps] * ps + p % ps for p in range(start, start + n))
            if start + n == len(seq.token_ids):
                sampled.append(seq)
                logits_rows.append(len(ids) - 1)

        for seq in step.decodes:
            add_tokens(seq, 1)
        decode_pages = decode_mask = None
        if step.decodes:
            lens = [s.num_computed + 1 for s in step.decodes]
            width = -(-max(lens) // ps)
            table = [s.pages[:width] + [0] * (width - len(s.pages[:width])) for s in step.decodes]
            decode_pages = torch.tensor(table, dtype=torch.long, device=self.device)
            cols = torch.arange(width * ps, device=self.device)
            decode_mask = (cols[None, :] < torch.tensor(lens, device=self.device)[:, None])[
                :, None, None, :
            ]
        chunks = []
        for seq, n in step.prefills:
            start, context = len(ids), seq.num_computed + n
            add_tokens(seq, n)
            pages = torch.tensor(
                seq.pages[: -(-context // ps)], dtype=torch.long, device=self.device
            )
            chunks.append(PrefillChunk(start, n, context, pages))
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decodes=len(step.decodes),
            decode_pages=decode_pages,
            decode_mask=decode_mask,
            prefills=tuple(chunks),
        )
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            batch,
            self.cache,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device),
        )
        return sampled, logits
