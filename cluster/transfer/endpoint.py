"""A worker's KV transfer endpoint: NIXL agents over UCX, one-sided WRITEs into peer pages.

The receiver registers its whole KV cache once and publishes a Handshake; a sender
connects to it (refusing a different compatibility hash), then WRITEs runs of pages,
layer range by layer range, straight into the receiver's pages. Each WRITE carries a
LAYERS notice that the receiver reads after the bytes have landed; the receiver never
polls page contents. On one host UCX moves the bytes by cross-memory attach (cma),
across hosts over RDMA or TCP, and CUDA pages GPU to GPU (cuda_ipc, GPUDirect RDMA).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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
        progress_thread: bool = False,
    ) -> None:
        """Without a progress thread, UCX moves only inside `finished`, `notices` and the
        posting calls: the owner must call one of them regularly (workers do every tick)."""
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.cache = cache
        self.compat = compat
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        self._agent = nixl_agent(name, config)
        self._agent.create_backend("UCX", {"ucx_devices": ucx_devices})
        self._on_gpu = cache.k.is_cuda
        self._mem = "VRAM" if self._on_gpu else "DRAM"
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
        """Post one WRITE of pages src -> dst (K and V) for `layers`; the notice rides on it."""
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

        def descs(addrs: list[np.ndarray], dev: int) -> Any:
            rows = np.stack(
                [np.concatenate(addrs), lengths, np.full(len(lengths), dev, np.uint64)], axis=1
            )
            return self._agent.get_xfer_descs(rows, self._mem)

        if self._on_gpu:
            torch.cuda.current_stream().synchronize()  # the KV must be written before UCX reads
        try:
            handle = self._agent.initialize_xfer(
                "WRITE",
                descs(local, self._dev),
                descs(remote, hs.device_id),
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
        """True once the WRITE has completed (then its handle is released); raises if it failed."""
        state = self._agent.check_xfer_state(write.handle)
        if state == "PROC":
            return False
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
