"""A worker's KV transfer endpoint: NIXL agents over UCX, one-sided WRITEs into peer pages.

The receiver registers its whole KV cache once and publishes a Handshake; a sender
connects to it (refusing a different compatibility hash), then WRITEs runs of pages,
layer range by layer range, straight into the receiver's pages. Each WRITE carries a
LAYERS notice that the receiver reads after the bytes have landed; the receiver never
polls page contents. On one host UCX moves the bytes by cross-memory attach (cma),
across hosts over RDMA or TCP, and CUDA pages GPU to GPU (cuda_ipc, GPUDirect RDMA).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import ConfigError
from cluster.engine.kv_cache import KVCache
from cluster.transfer.wire import Handshake, Notice, WireError
from cluster.types import PageId

log = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """A WRITE or notice could not be posted or failed in flight."""


def page_runs(src: Sequence[PageId], dst: Sequence[PageId]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both page lists count up by one together."""
    assert len(src) == len(dst)
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


@dataclass(frozen=True)
class Peer:
    name: str
    handshake: Handshake


@dataclass
class Write:
    handle: Any
    num_bytes: int


class KVEndpoint:
    """One NIXL agent over one KVCache. Not thread-safe: one thread drives it."""

    def __init__(
        self,
        name: str,
        cache: KVCache,
        compat: bytes,
        ucx_devices: str,
        ucx_transports: str = "",
        progress_thread: bool = False,
    ) -> None:
        """UCX runs on exactly `ucx_devices` over `ucx_transports` ("" for all of either);
        ConfigError naming the field if this host has not got them. Without a progress
        thread, UCX moves only inside `finished`, `notices` and the posting calls: the owner
        must call one of them regularly (workers do every tick)."""
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.name = name
        self.cache = cache
        self.compat = compat
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        self._agent = nixl_agent(name, config)
        _create_ucx_backend(self._agent, ucx_devices, ucx_transports)
        self._on_gpu = cache.k.is_cuda
        self._dev = cache.k.device.index or 0
        self._regs = [self._agent.register_memory(t) for t in (cache.k, cache.v)]
        self.page_bytes = cache.k[0, 0].numel() * cache.k.element_size()
        self._peers: dict[str, Peer] = {}
        self._inbox: list[Notice] = []

    def handshake(self) -> bytes:
        return Handshake(
            compat=self.compat,
            agent=self.name,
            agent_metadata=self._agent.get_agent_metadata(),
            num_layers=self.cache.k.shape[0],
            num_pages=self.cache.num_pages,
            page_bytes=self.page_bytes,
            k_base=self.cache.k.data_ptr(),
            v_base=self.cache.v.data_ptr(),
            on_gpu=self._on_gpu,
            device_id=self._dev,
        ).encode()

    def connect(self, handshake: bytes) -> Peer:
        """The peer behind a handshake, connected once; IncompatiblePeerError if it differs."""
        hs = Handshake.decode(handshake)
        hs.check(self.compat)
        known = self._peers.get(hs.agent)
        if known is not None and known.handshake == hs:
            return known
        if known is not None:  # the same name restarted: forget the old one
            self._agent.remove_remote_agent(hs.agent)
        self._agent.add_remote_agent(hs.agent_metadata)
        peer = Peer(hs.agent, hs)
        self._peers[hs.agent] = peer
        return peer

    def write(
        self,
        peer: Peer,
        layers: range,
        src: Sequence[PageId],
        dst: Sequence[PageId],
        notice: Notice,
    ) -> Write:
        """Post one WRITE of pages src -> dst (K and V) for `layers`; the notice rides on it.
        The caller posts only KV the device has finished writing (see the engine's
        LayerReady): UCX reads the pages as they are when it runs, and nothing here waits
        on the device."""
        hs = peer.handshake
        assert hs.page_bytes == self.page_bytes and 0 <= layers.start < layers.stop
        runs = np.array(page_runs(src, dst), dtype=np.uint64).reshape(-1, 3)
        lay = np.arange(layers.start, layers.stop, dtype=np.uint64)[:, None]
        pb = np.uint64(self.page_bytes)
        here = np.uint64(self.cache.num_pages)
        there = np.uint64(hs.num_pages)
        lengths = np.broadcast_to(runs[:, 2] * pb, (len(lay), len(runs))).ravel()
        local, remote = [], []
        for base, peer_base in ((self.cache.k, hs.k_base), (self.cache.v, hs.v_base)):
            local.append((np.uint64(base.data_ptr()) + (lay * here + runs[:, 0]) * pb).ravel())
            remote.append((np.uint64(peer_base) + (lay * there + runs[:, 1]) * pb).ravel())
        lengths = np.concatenate([lengths, lengths])

        def descs(addrs: list[np.ndarray], on_gpu: bool, dev: int) -> Any:
            rows = np.stack(
                [np.concatenate(addrs), lengths, np.full(len(lengths), dev, np.uint64)], axis=1
            )
            return self._agent.get_xfer_descs(rows, "VRAM" if on_gpu else "DRAM")

        try:
            handle = self._agent.initialize_xfer(
                "WRITE",
                descs(local, self._on_gpu, self._dev),
                descs(remote, hs.on_gpu, hs.device_id),
                peer.name,
                notice.encode(),
            )
            if self._agent.transfer(handle) == "ERR":
                self._agent.release_xfer_handle(handle)
                raise TransferError(f"WRITE to {peer.name} failed to post")
        except TransferError:
            raise
        except Exception as e:  # NIXL raises its own types, e.g. on a disconnected peer
            raise TransferError(f"WRITE to {peer.name} failed: {e}") from e
        return Write(handle, int(lengths.sum()))

    def finished(self, write: Write) -> bool:
        """True once the WRITE has completed; TransferError if it failed (a peer that went
        away included: NIXL then raises its own error, which must not escape, or each
        poll of the worker's loop would fail on it again). Either way its handle is
        released."""
        try:
            state = self._agent.check_xfer_state(write.handle)
        except Exception as e:
            state = f"{type(e).__name__}: {e}"
        if state == "PROC":
            return False
        with contextlib.suppress(Exception):  # a failed transfer's handle may refuse too
            self._agent.release_xfer_handle(write.handle)
        if state != "DONE":
            raise TransferError(f"WRITE failed in flight: {state}")
        return True

    def notify(self, peer: Peer, notice: Notice) -> None:
        try:
            self._agent.send_notif(peer.name, notice.encode())
        except Exception as e:
            raise TransferError(f"notice to {peer.name} failed: {e}") from e

    def progress(self) -> None:
        """Drive UCX: send queued notices, complete WRITEs (needed without a progress thread)."""
        for sender, messages in self._agent.get_new_notifs().items():
            for msg in messages:
                try:
                    self._inbox.append(Notice.decode(msg))
                except WireError as e:
                    log.warning("dropped a notice from %s: %s", sender, e)

    def notices(self) -> list[Notice]:
        """Notices that arrived since the last call; malformed ones are logged and dropped."""
        self.progress()
        out, self._inbox = self._inbox, []
        return out


def _create_ucx_backend(agent: Any, devices: str, transports: str) -> None:
    """Give `agent` a UCX backend on exactly `devices` over `transports` ("" for all).

    UCX reads UCX_NET_DEVICES and UCX_TLS when NIXL creates its context, so they are set
    for that call only, and the config wins over the environment. NIXL's own parameters
    cannot carry them: `device_list` appends ":1" (an InfiniBand port) to every name, so no
    TCP device (`lo`, `eth0`) can be named, and `engine_config` splits on the commas that
    UCX writes its lists with."""
    missing = [d for d in devices.split(",") if devices and not _is_device(d)]
    if missing:
        raise ConfigError(
            f"transfer.ucx_devices: {missing[0]!r} is not a network or RDMA device of this "
            f"host (see /sys/class/net and /sys/class/infiniband)"
        )
    env = {"UCX_NET_DEVICES": devices or "all", "UCX_TLS": transports or "all"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        agent.create_backend("UCX", {})
    except Exception as e:
        raise ConfigError(
            f"transfer.ucx_devices {devices!r} with transfer.ucx_transports {transports!r}: "
            f"UCX cannot start on them here ({e}; UCX's log above names what it found)"
        ) from None
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value


def _is_device(name: str) -> bool:
    """A network interface (`lo`, `eth0`) or an RDMA device, with or without its port
    (`mlx5_0`, `mlx5_0:1`), as UCX names them."""
    dev, _, port = name.partition(":")
    rdma = Path("/sys/class/infiniband", dev)
    if port:
        return (rdma / "ports" / port).is_dir()
    return Path("/sys/class/net", dev).exists() or rdma.exists()
