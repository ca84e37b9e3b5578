"""The KV endpoint between two processes over real UCX: WRITEs land in exactly the
receiver's named pages (host memory here; GPU memory GPU to GPU where CUDA exists),
and notices arrive after the bytes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.config import ConfigError
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


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    ("device", "receiver_device"),
    [
        ("cpu", "cpu"),
        pytest.param("cuda", "cuda", marks=GPU),
        pytest.param("cuda", "cpu", marks=GPU),  # the receiver's memory type is its own
    ],
)
def test_a_write_lands_in_exactly_the_named_pages_and_its_notice_follows(
    device: str, receiver_device: str
) -> None:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    receiver = ctx.Process(target=_receive, args=(receiver_device, there, SPEC))
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
    return KVEndpoint(name, cache, compat_hash(SPEC, "float32", 16, "none"), devices, transports)


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
