"""The running sequences' page tables as rows of one host tensor, kept from step to step.

A step's page table was rebuilt from every sequence's Python list of pages (3.8 ms at
batch 64 x 2k tokens, 78 ms at 256 x 8k on this CPU, serial with the GPU). Here each
sequence keeps a row: a step copies in only the pages a sequence gained since its last
step (a page list the scheduler replaced, on preemption or re-admission, is rewritten),
then gathers the step's rows in one op. A row is free again once its Sequence is gone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from cluster.engine.sched.sequence import Sequence
from cluster.types import PageId


@dataclass
class _Row:
    index: int  # in BlockTables.values
    pages: list[PageId]  # the list object the row was filled from
    filled: int  # its leading pages already in the row; 0 after them


class BlockTables:
    def __init__(self, max_pages: int, rows: int = 16) -> None:
        self.values = torch.zeros(rows, max_pages, dtype=torch.int64)  # max_model_len's pages
        self._rows: weakref.WeakKeyDictionary[Sequence, _Row] = weakref.WeakKeyDictionary()
        self._free = list(range(rows))

    def table(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """[len(seqs), width] int64 page ids: each sequence's first `width` pages, 0 after."""
        rows = torch.tensor([self._update(s) for s in seqs])
        return self.values[:, :width].index_select(0, rows)

    def _update(self, seq: Sequence) -> int:
        row = self._rows.get(seq)
        if row is None:
            row = _Row(self._take(), seq.pages, 0)
            self._rows[seq] = row
            weakref.finalize(seq, self._free.append, row.index)
        elif row.pages is not seq.pages or len(seq.pages) < row.filled:  # replaced
            self.values[row.index, : row.filled] = 0
            row.pages, row.filled = seq.pages, 0
        n = len(seq.pages)
        if n > row.filled:
            self.values[row.index, row.filled : n] = torch.tensor(seq.pages[row.filled : n])
            row.filled = n
        return row.index

    def _take(self) -> int:
        """A free row, cleared of the pages of the sequence that had it."""
        if not self._free:  # twice the rows; the old ones keep their indices
            have = self.values.shape[0]
            self.values = torch.cat([self.values, torch.zeros_like(self.values)])
            self._free.extend(range(have, 2 * have))
        index = self._free.pop()
        self.values[index] = 0
        return index
