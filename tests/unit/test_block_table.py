"""The persistent page table: a step's table equals each sequence's page list, 0-padded,
laying out a step copies in only the pages gained since the last one, and a finished
sequence's row is reused."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cluster.engine.sched.block_table import BlockTables
from cluster.engine.sched.sequence import Sequence
from cluster.types import PageId, RequestId, SamplingParams


def _seq(name: str, pages: list[int]) -> Sequence:
    return Sequence(
        RequestId(name), [1, 2, 3], 3, SamplingParams(), pages=[PageId(p) for p in pages]
    )


class _Writes(TorchDispatchMode):
    """How many page ids are copied into rows (in-place copies and fills, by element)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.fill_.Tensor):
            self.elements += args[0].numel()
        return func(*args, **(kwargs or {}))


def _table(tables: BlockTables, seqs: list[Sequence], width: int) -> tuple[list[list[int]], int]:
    with _Writes() as writes:
        table = tables.table(seqs, width)
    return table.tolist(), writes.elements


def test_rows_persist_and_each_step_copies_only_the_new_pages() -> None:
    tables = BlockTables(max_pages=8)
    a, b = _seq("a", [7, 3]), _seq("b", [5])
    # First sight: each row cleared (8 pages) and its pages written.
    assert _table(tables, [a, b], 3) == ([[7, 3, 0], [5, 0, 0]], 2 * 8 + 3)
    assert _table(tables, [a, b], 3) == ([[7, 3, 0], [5, 0, 0]], 0)  # nothing new: nothing
    a.pages.append(PageId(9))  # a decode crossed into a new page
    assert _table(tables, [b, a], 3) == ([[5, 0, 0], [7, 3, 9]], 1)
    a.pages.extend([PageId(2), PageId(4)])
    assert _table(tables, [a], 4) == ([[7, 3, 9, 2]], 2)  # a step wider than before too


def test_a_replaced_page_list_is_rewritten_and_leaves_no_stale_page() -> None:
    tables = BlockTables(max_pages=8)
    a = _seq("a", [7, 3, 9])
    tables.table([a], 3)
    a.pages = []  # preempted: its pages went back to the pool
    a.pages = [PageId(6)]  # re-admitted elsewhere
    assert _table(tables, [a], 3) == ([[6, 0, 0]], 3 + 1)  # 3 cleared, 1 written


def test_rows_outgrow_their_first_allocation_and_a_gone_sequence_frees_its_row() -> None:
    tables = BlockTables(max_pages=4, rows=2)
    seqs = [_seq(str(i), [i + 1, i + 2]) for i in range(3)]  # one more than the rows
    assert tables.table(seqs, 2).tolist() == [[1, 2], [2, 3], [3, 4]]
    assert tables.values.shape[0] == 4
    del seqs[1]  # finished: the engine holds it no more
    fresh = _seq("new", [9])
    assert tables.table([fresh, *seqs], 3).tolist() == [[9, 0, 0], [1, 2, 0], [3, 4, 0]]
    assert tables.values.shape[0] == 4  # the gone one's row, cleared, not a new one
