"""The KV endpoint between two processes over real UCX: WRITEs land in exactly the
receiver's named pages (host memory here; GPU memory GPU to GPU where CUDA exists),
and notices arrive after the bytes."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from cluster.engine.checkpoint import ModelSpec
from cluster.engine.kv_cache import KVCache, KVLayout
from cluster.transfer.endpoint import KVEndpoint
from cluster.transfer.wire import Notice, NoticeKind, compat_hash
from cluster.types import PageId, RequestId
from tests.unit.test_wire import SPEC

LAYOUT = KVLayout(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, 16, torch.float32)
SRC = [PageId(p) for p in (3, 4, 5, 9, 10)]
DST = [PageId(p) for p in (20, 21, 7, 8, 30)]


def _receive(device: str, conn: Any, spec: ModelSpec) -> None:
    cache = KVCache(LAYOUT, 40, torch.device(device))
    ep = KVEndpoint("receiver", cache, compat_hash(spec, "float32", 16, "none"), "lo")
    conn.send(ep.handshake())
    notices: list[Notice] = []
    deadline = time.monotonic() + 30
    while len(notices) < 2 and time.monotonic() < deadline:
        notices += ep.notices()
        time.sleep(0.001)
    conn.send((notices, cache.k.cpu().numpy(), cache.v.cpu().numpy()))  # by value


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)
def test_a_write_lands_in_exactly_the_named_pages_and_its_notice_follows(device: str) -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    receiver = ctx.Process(
        target=_receive, args=("cpu" if device == "cpu" else "cuda", there, SPEC)
    )
    receiver.start()
    try:
        cache = KVCache(LAYOUT, 12, torch.device(device))
        cache.k.copy_(torch.randn(cache.k.shape))
        cache.v.copy_(torch.randn(cache.v.shape))
        ep = KVEndpoint("sender", cache, compat_hash(SPEC, "float32", 16, "none"), "lo")
        peer = ep.connect(here.recv())
        layers = range(1, 2)  # layer 1 only: layer 0 must stay untouched
        notice = Notice(NoticeKind.LAYERS, RequestId("r"), 1, 2, tuple(DST), 2 * 5 * ep.page_bytes)
        write = ep.write(peer, layers, SRC, DST, notice)
        deadline = time.monotonic() + 30
        while not ep.finished(write):
            assert time.monotonic() < deadline
        assert write.num_bytes == 2 * len(SRC) * ep.page_bytes
        ep.notify(peer, Notice(NoticeKind.DONE, RequestId("r"), num_writes=1, first_token=5))
        notices, k_np, v_np = here.recv()
        k, v = torch.from_numpy(k_np), torch.from_numpy(v_np)
    finally:
        receiver.join(30)
    assert [n.kind for n in notices] == [NoticeKind.LAYERS, NoticeKind.DONE]
    assert notices[0] == notice and notices[1].first_token == 5
    for got, sent in ((k, cache.k.cpu()), (v, cache.v.cpu())):
        assert torch.equal(got[1, DST], sent[1, SRC])
        untouched = [p for p in range(40) if p not in DST]
        assert not got[1, untouched].any() and not got[0].any()
