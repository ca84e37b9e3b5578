"""StepBatch: one step's attention layout on the host, as the runner builds it and every
attention backend (cluster/engine/kernels/attention.py) reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepBatch:
    """One step's attention layout, on the host. Sequences run decodes first (one new
    token each), then prefill chunks; sequence i's new tokens are rows
    [query_start[i], query_start[i + 1]) of the step."""

    num_decodes: int
    query_start: list[int]  # [seqs + 1]
    context_lens: list[int]  # [seqs] tokens each attends to, its new ones included
    page_table: torch.Tensor  # [seqs, width] int64 page ids covering each context, 0-padded
    slot_mapping: torch.Tensor  # [tokens] int64 slot (page * page_size + offset) per new token
    positions: torch.Tensor  # [tokens] int64 position of each new token in its sequence

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)
