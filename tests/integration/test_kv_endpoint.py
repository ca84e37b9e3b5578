"""The KV endpoint between two processes over real UCX: WRITEs land in exactly the
receiver's named pages (host memory here; GPU memory GPU to GPU where CUDA exists),
and notices arrive after the bytes."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cluster.config import ConfigError
from cluster.engine.kernels.kv_cache import KVCache, KVLayout, kv_dtype
from cluster.engine.model.checkpoint import ModelSpec
from cluster.transfer.endpoint import KVEndpoint
from cluster.transfer.wire import Handshake, IncompatiblePeerError, Notice, NoticeKind, compat_hash
from cluster.types import PageId, RequestId, SampledToken
from tests.unit.test_wire import SPEC

LAYOUT = KVLayout(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, 16, torch.float32)
SRC = [PageId(p) for p in (3, 4, 5, 9, 10)]
DST = [PageId(p) for p in (20, 21, 7, 8, 30)]
DONE = Notice(NoticeKind.DONE, RequestId("r"), num_writes=1, first=SampledToken(5, None))


def _receive(device: str, conn: Any, spec: ModelSpec, kv: str = "auto") -> None:
    cache = KVCache(_layout(kv), 40, torch.device(device))
    ep = KVEndpoint("receiver", cache, compat_hash(spec, "float32", kv, 16, "none"), "lo")
    conn.send(ep.handshake())
    notices: list[Notice] = []
    deadline = time.monotonic() + 30
    while len(notices) < 2 and time.monotonic() < deadline:
        notices += ep.notices()
        time.sleep(0.001)
    conn.send((notices, cache.k.cpu().numpy(), cache.v.cpu().numpy()))  # by value


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layout(kv: str) -> KVLayout:
    return dataclasses.replace(LAYOUT, dtype=kv_dtype(kv, torch.float32))


@pytest.mark.parametrize(
    ("device", "receiver_device", "kv"),
    [
        ("cpu", "cpu", "auto"),
        ("cpu", "cpu", "int8"),  # 8-bit pages: codes and their scales, in the same runs
        pytest.param("cuda", "cuda", "auto", marks=GPU),
        pytest.param("cuda", "cpu", "auto", marks=GPU),  # the receiver's memory is its own
    ],
)
def test_a_write_lands_in_exactly_the_named_pages_and_its_notice_follows(
    device: str, receiver_device: str, kv: str
) -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    receiver = ctx.Process(target=_receive, args=(receiver_device, there, SPEC, kv))
    receiver.start()
    try:
        cache = KVCache(_layout(kv), 12, torch.device(device))
        for t in (cache.k, cache.v):  # every byte a page holds, its scales too
            t.copy_(torch.randn(t.shape) if t.is_floating_point() else torch.randint_like(t, 256))
        ep = KVEndpoint("sender", cache, compat_hash(SPEC, "float32", kv, 16, "none"), "lo")
        peer = ep.connect(here.recv())
        layers = range(1, 2)  # layer 1 only: layer 0 must stay untouched
        notice = Notice(NoticeKind.LAYERS, RequestId("r"), 1, 2, tuple(DST), 2 * 5 * ep.page_bytes)
        write = ep.write(peer, layers, SRC, DST, notice)
        deadline = time.monotonic() + 30
        while not ep.finished(write):
            assert time.monotonic() < deadline
        assert write.num_bytes == 2 * len(SRC) * ep.page_bytes
        # 8-bit: a quarter of float32's bytes, and the scales' 16 bytes a run
        run = 16 * SPEC.head_dim
        assert ep.page_bytes == SPEC.num_kv_heads * (run + 16 if kv == "int8" else 4 * run)
        ep.notify(peer, DONE)
        notices, k_np, v_np = here.recv()
        k, v = torch.from_numpy(k_np), torch.from_numpy(v_np)
    finally:
        receiver.join(30)
    assert [n.kind for n in notices] == [NoticeKind.LAYERS, NoticeKind.DONE]
    assert notices[0] == notice and notices[1] == DONE
    for got, sent in ((k, cache.k.cpu()), (v, cache.v.cpu())):
        assert torch.equal(got[1, DST], sent[1, SRC])
        untouched = [p for p in range(40) if p not in DST]
        assert not got[1, untouched].any() and not got[0].any()


SPEC3 = dataclasses.replace(SPEC, num_kv_heads=3, num_heads=6)  # the bundled model's 3 heads
COMPAT3 = compat_hash(SPEC3, "float32", "auto", 16, "none")


def _cache(heads: range, pages: int) -> KVCache:
    layout = KVLayout(SPEC3.num_layers, len(heads), SPEC3.head_dim, 16, torch.float32)
    return KVCache(layout, pages, torch.device("cpu"))


def _receive_ranks(conn: Any, splits: list[range]) -> None:
    """A receiver whose model is split over `splits` (a rank each, each its own agent):
    publishes the handshake of all, reads rank 0's notices, sends back every rank's
    pages joined along the heads."""
    caches = [_cache(heads, 40) for heads in splits]
    names = ["receiver", *(f"receiver-rank{r}" for r in range(1, len(splits)))]
    eps = [
        KVEndpoint(name, cache, COMPAT3, "lo", heads=heads)
        for name, cache, heads in zip(names, caches, splits, strict=True)
    ]
    conn.send(Handshake(COMPAT3, SPEC3.num_layers, tuple(ep.memory() for ep in eps)).encode())
    notices: list[Notice] = []
    deadline = time.monotonic() + 30
    while len(notices) < 2 and time.monotonic() < deadline:
        notices += eps[0].notices()
        for rank in eps[1:]:  # as a worker's other ranks do (TensorRank.progress_kv)
            rank.progress()
        time.sleep(0.001)
    k = torch.cat([c.k for c in caches], dim=2)  # [layers, pages, heads, page_size, dim]
    v = torch.cat([c.v for c in caches], dim=2)
    conn.send((notices, k.numpy(), v.numpy()))


class _LocalRank:
    """Another rank of the sender's model in this process (a TensorRank's part, without Ray)."""

    def __init__(self, ep: KVEndpoint) -> None:
        self.ep, self.memory = ep, ep.memory()

    def post(self, handshake: bytes, layers: range, src: Any, dst: Any) -> Any:
        write = self.ep.write(self.ep.connect(handshake), layers, src, dst, None)
        return SimpleNamespace(done=lambda: self.ep.finished(write))


@pytest.mark.parametrize(
    ("senders", "receivers"),
    [
        ([range(0, 3)], [range(0, 2), range(2, 3)]),  # TP=1 -> TP=2
        ([range(0, 2), range(2, 3)], [range(0, 3)]),  # TP=2 -> TP=1
        ([range(0, 2), range(2, 3)], [range(0, 1), range(1, 3)]),  # splits that cross
    ],
    ids=["1-to-2", "2-to-1", "crossed"],
)
def test_each_ranks_heads_land_in_the_peer_rank_holding_them_and_one_notice_follows(
    senders: list[range], receivers: list[range]
) -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    receiver = ctx.Process(target=_receive_ranks, args=(there, receivers))
    receiver.start()
    try:
        full_k = torch.randn(SPEC3.num_layers, 12, 3, 16, SPEC3.head_dim)
        full_v = torch.randn(full_k.shape)
        eps = []
        for r, heads in enumerate(senders):
            cache = _cache(heads, 12)
            cache.k.copy_(full_k[:, :, heads.start : heads.stop])
            cache.v.copy_(full_v[:, :, heads.start : heads.stop])
            eps.append(KVEndpoint(f"sender-rank{r}", cache, COMPAT3, "lo", heads=heads))
        ep = eps[0]
        ep.followers = [_LocalRank(other) for other in eps[1:]]
        peer = ep.connect(here.recv())
        assert ep.model_page_bytes == 16 * 3 * SPEC3.head_dim * 4
        nbytes = 2 * len(SRC) * ep.model_page_bytes
        notice = Notice(NoticeKind.LAYERS, RequestId("r"), 1, 2, tuple(DST), nbytes)
        write = ep.write(peer, range(1, 2), SRC, DST, notice)
        deadline = time.monotonic() + 30
        while not ep.finished(write):
            assert time.monotonic() < deadline
        assert write.num_bytes == nbytes
        ep.notify(peer, DONE)
        notices, k_np, v_np = here.recv()
    finally:
        receiver.join(30)
    assert [n.kind for n in notices] == [NoticeKind.LAYERS, NoticeKind.DONE]
    assert notices[0] == notice
    for got, sent in ((torch.from_numpy(k_np), full_k), (torch.from_numpy(v_np), full_v)):
        assert torch.equal(got[1, DST], sent[1, SRC])
        untouched = [p for p in range(40) if p not in DST]
        assert not got[1, untouched].any() and not got[0].any()


def test_descriptor_lists_are_prepared_once_per_connection_and_serve_every_write() -> None:
    """TP=1 into a 2 + 1 split: one local and one remote list per pair of ranks sharing
    heads (two pairs), prepared at connect; three WRITEs of different pages and layers
    (a run of pages consecutive on both sides among them), and a connect again with the
    same handshake, prepare none; every page lands where it was sent."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    receiver = ctx.Process(target=_receive_ranks, args=(there, [range(0, 2), range(2, 3)]))
    receiver.start()
    try:
        cache = _cache(range(0, 3), 12)
        cache.k.copy_(torch.randn(cache.k.shape))
        cache.v.copy_(torch.randn(cache.v.shape))
        ep = KVEndpoint("sender", cache, COMPAT3, "lo")
        built: list[str] = []
        prep = ep._agent.prep_xfer_dlist
        ep._agent.prep_xfer_dlist = lambda agent, *a, **k: (
            built.append(agent) or prep(agent, *a, **k)
        )
        raw = here.recv()
        peer = ep.connect(raw)
        assert sorted(built) == sorted(["NIXL_INIT_AGENT"] * 2 + ["receiver", "receiver-rank1"])
        sends = [
            (range(0, 1), [PageId(p) for p in (0, 1, 2, 3)], [PageId(p) for p in (30, 31, 32, 33)]),
            (range(1, 2), SRC, DST),
            (range(0, 2), [PageId(11)], [PageId(0)]),
        ]
        for i, (layers, src, dst) in enumerate(sends):
            last = i == len(sends) - 1
            notice = Notice(NoticeKind.LAYERS, RequestId("r"), 0, 2) if last else None
            write = ep.write(ep.connect(raw), layers, src, dst, notice)
            deadline = time.monotonic() + 30
            while not ep.finished(write):
                assert time.monotonic() < deadline
        assert ep.connect(raw) is peer and len(built) == 4
        ep.notify(peer, DONE)
        _, k_np, v_np = here.recv()
    finally:
        receiver.join(30)
    for got, sent in ((torch.from_numpy(k_np), cache.k), (torch.from_numpy(v_np), cache.v)):
        written = torch.zeros(got.shape[:2], dtype=torch.bool)
        for layers, src, dst in sends:
            for layer in layers:
                assert torch.equal(got[layer, dst], sent[layer, src])
                written[layer, dst] = True
        assert not got[~written].any()


def test_a_peer_whose_heads_do_not_tile_is_refused() -> None:
    ep = KVEndpoint("tiler", _cache(range(0, 3), 4), COMPAT3, "lo")
    gap = Handshake(
        COMPAT3,
        SPEC3.num_layers,
        (ep.memory(), dataclasses.replace(ep.memory(), agent="other", heads=range(4, 5))),
    )
    with pytest.raises(IncompatiblePeerError, match="do not tile from 0"):
        ep.connect(gap.encode())
    short = Handshake(
        COMPAT3,
        SPEC3.num_layers,
        (dataclasses.replace(ep.memory(), heads=range(0, 2), page_bytes=ep.head_bytes * 2),),
    )
    with pytest.raises(IncompatiblePeerError, match="holds KV heads 0-1, ours reach 2"):
        ep.connect(short.encode())


def _listening_sockets() -> set[str]:
    """Local addresses (hex ip:port, as /proc/net/tcp writes them) this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            inodes.add(os.readlink(f"/proc/self/fd/{fd}").removeprefix("socket:[").rstrip("]"))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.add(cols[1])
    return found


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1, ::1


def _endpoint(name: str, devices: str, transports: str = "") -> KVEndpoint:
    cache = KVCache(LAYOUT, 4, torch.device("cpu"))
    return KVEndpoint(
        name, cache, compat_hash(SPEC, "float32", "auto", 16, "none"), devices, transports
    )


def test_ucx_devices_lo_reaches_ucx_it_listens_on_loopback_only() -> None:
    before = _listening_sockets()
    ep = _endpoint("lo-only", "lo")
    opened = _listening_sockets() - before
    assert opened, "UCX's TCP transport opened no listener on lo"
    assert all(addr.startswith(LOOPBACK) for addr in opened), opened
    assert ep.handshake()


def test_a_device_this_host_has_not_got_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"transfer.ucx_devices: 'nosuch0' is not a network"):
        _endpoint("made-up", "lo,nosuch0")


def test_a_transport_ucx_cannot_use_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"transfer.ucx_transports 'nosuchtl'"):
        _endpoint("bad-tls", "lo", "nosuchtl")
    assert "UCX_TLS" not in os.environ and "UCX_NET_DEVICES" not in os.environ
