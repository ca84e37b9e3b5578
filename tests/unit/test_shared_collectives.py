"""Collectives through shared memory between real processes: every rank gets the same
sum and every rank's tensor, calls in a row reuse the slots safely, a rank waiting for the
next step outlives the in-step time limit, and a dead peer ends the wait."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

from cluster.engine.model.shared_collectives import PeerLost, SharedExchange

CALLS = 200


def _rank_1(path: Path, out: mp.Queue, delay_s: float = 0.0) -> None:
    ex = SharedExchange(path, 1, 2, timeout_s=60)
    sums = []
    for i in range(CALLS):
        x = torch.full((3, 5), float(i)) + 0.5
        ex.all_reduce(x)
        sums.append(x[0, 0].item())
    parts = ex.exchange(torch.tensor([7, 8, 9]))
    out.put((sums, [p.tolist() for p in parts]))
    time.sleep(delay_s)
    ex.exchange(torch.zeros(1))


@pytest.fixture
def segment(tmp_path: Path) -> Path:
    path = tmp_path / "segment"  # any file both processes map; /dev/shm in production
    assert SharedExchange.create(path, 2)
    return path


def test_two_ranks_sum_and_gather_alike_call_after_call(segment: Path) -> None:
    out: mp.Queue = mp.get_context("fork").Queue()
    peer = mp.get_context("fork").Process(target=_rank_1, args=(segment, out))
    peer.start()
    ex = SharedExchange(segment, 0, 2, timeout_s=60)
    mine = []
    for i in range(CALLS):
        x = torch.full((3, 5), float(i))
        ex.all_reduce(x)
        assert torch.equal(x, torch.full((3, 5), 2 * i + 0.5))
        mine.append(x[0, 0].item())
    parts = [p.tolist() for p in ex.exchange(torch.tensor([1, 2, 3]))]
    theirs, their_parts = out.get(timeout=60)
    assert theirs == mine
    assert parts == their_parts == [[1, 2, 3], [7, 8, 9]]
    ex.exchange(torch.zeros(1))
    peer.join(60)
    assert peer.exitcode == 0


def test_a_rank_waiting_for_the_next_step_outlives_the_in_step_limit(segment: Path) -> None:
    out: mp.Queue = mp.get_context("fork").Queue()
    ctx = mp.get_context("fork")
    # rank 1 is idle past rank 0's in-step limit (0.01 s) and its first liveness probe.
    peer = ctx.Process(target=_rank_1, args=(segment, out, 1.5))
    peer.start()
    ex = SharedExchange(segment, 0, 2, timeout_s=0.01)
    for i in range(CALLS):
        ex.all_reduce(torch.full((3, 5), float(i)))
    ex.exchange(torch.tensor([1, 2, 3]))
    out.get(timeout=60)
    ex.exchange(torch.zeros(1), patient=True)  # waits for rank 1, however long it idles
    peer.join(60)
    assert peer.exitcode == 0


def test_a_dead_peer_ends_the_wait(segment: Path) -> None:
    ctx = mp.get_context("fork")
    peer = ctx.Process(target=lambda: SharedExchange(segment, 1, 2, timeout_s=60))
    peer.start()
    peer.join(60)  # it mapped the segment, wrote its pid, and exited
    ex = SharedExchange(segment, 0, 2, timeout_s=60)
    with pytest.raises(PeerLost, match=r"rank 1 \(pid \d+\) is gone"):
        ex.exchange(torch.zeros(1), patient=True)
