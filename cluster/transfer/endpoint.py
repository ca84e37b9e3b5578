"""A worker's KV transfer endpoint: NIXL agents over UCX, one-sided WRITEs into peer pages.

The receiver registers its whole KV cache once (each rank's, with tensor parallelism)
and publishes a Handshake; a sender connects to it (refusing a different compatibility
hash, or heads split in a way it cannot map), then WRITEs runs of pages, layer range by
layer range, straight into the receiver's pages, each rank's heads into the rank that
holds them. Each WRITE is followed by a LAYERS notice (riding on it, or sent once its
parts have all landed) that the receiver reads after the bytes; the receiver never polls
page contents. On one host UCX moves the bytes by cross-memory attach (cma),
across hosts over RDMA or TCP, and CUDA pages GPU to GPU (cuda_ipc, GPUDirect RDMA).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cluster.config import ConfigError
from cluster.engine.kernels.kv_cache import KVCache
from cluster.transfer.wire import Handshake, IncompatiblePeerError, Notice, RankPages, WireError
from cluster.types import PageId

log = logging.getLogger(__name__)


def nixl_package(torch_cuda: str | None) -> str:
    """The NIXL build for torch's CUDA major version (`torch.version.cuda`; None: a CPU
    torch): UCX's CUDA memory hooks load that version's libcudart, so a CUDA 13 torch
    needs nixl-cu13. A CPU torch takes the CUDA 12 build, which runs without CUDA."""
    major = 12 if torch_cuda is None else int(torch_cuda.split(".")[0])
    return f"nixl_cu{major}"


class TransferError(RuntimeError):
    """A WRITE or notice could not be posted or failed in flight."""


def side_rows(
    k_base: int, v_base: int, runs: np.ndarray, run_bytes: int, device: int
) -> np.ndarray:
    """One side's descriptor list as (address, length, device) rows from its runs' offsets
    (KVLayout.head_runs: one per (layer, page)): entry (t, layer, page) at index
    (t * num_layers + layer) * num_pages + page, t 0 for K and 1 for V."""
    addrs = np.concatenate([np.uint64(k_base) + runs, np.uint64(v_base) + runs])
    n = len(addrs)
    return np.stack(
        [addrs, np.full(n, run_bytes, np.uint64), np.full(n, device, np.uint64)], axis=1
    )


def side_indices(
    layers: range, pages: Sequence[PageId], num_layers: int, num_pages: int
) -> np.ndarray:
    """Indices into a `side_rows` list for K then V of `layers` of `pages`, layer by layer
    and pages in the order given: pages consecutive on both sides become consecutive
    entries that are contiguous on both, which NIXL merges into one descriptor."""
    lay = np.arange(2)[:, None] * num_layers + np.arange(layers.start, layers.stop)[None, :]
    at = lay[:, :, None] * num_pages + np.asarray(pages, dtype=np.int64)[None, None, :]
    return at.ravel().astype(np.int32)


@dataclass(frozen=True)
class Route:
    """This rank's share of KV heads with one peer rank, and the two prepared descriptor
    lists (NIXL's prep_xfer_dlist) that serve every WRITE between them: built once when
    the peer connects, picked from by index (side_indices) on each WRITE."""

    rank: RankPages
    heads: range  # the model's KV heads both hold
    local: Any  # this side's list (shared by every route of the same heads)
    remote: Any  # the peer rank's list


@dataclass(frozen=True)
class Peer:
    name: str  # its rank 0's agent, where notices go
    handshake: Handshake
    raw: bytes  # the handshake as it came, for this model's other ranks
    routes: tuple[Route, ...]  # one per peer rank whose heads overlap this rank's


class Pending(Protocol):
    """WRITEs another rank of this model posted (tensor parallelism)."""

    def done(self) -> bool:
        """True once they are over, none in flight; TransferError if one failed."""
        ...


class RankWriter(Protocol):
    """Another rank of this model (rank 0's endpoint has one per other rank): it posts the
    WRITEs of its own KV heads."""

    memory: RankPages

    def post(
        self, handshake: bytes, layers: range, src: Sequence[PageId], dst: Sequence[PageId]
    ) -> Pending: ...


@dataclass
class Write:
    """One WRITE of pages for some layers, in parts: one per (rank here, rank there) pair
    whose KV heads overlap. Over once every part is; its notice rides on the one part
    when there is one, else goes once all are over."""

    handles: list[Any]  # this rank's parts in flight
    num_bytes: int  # every part's, other ranks' too
    peer: Peer
    notice: Notice | None = None  # to send once every part is over
    pending: list[Pending] = field(default_factory=list)  # the other ranks' parts
    error: str = ""  # the first part that failed


class KVEndpoint:
    """One NIXL agent over one KVCache. Not thread-safe: one thread drives it.

    With tensor parallelism each rank's cache holds its range of the model's KV heads,
    and every rank has an agent; rank 0's endpoint speaks for the model: its handshake
    lists every rank, its `write` has the other ranks post theirs (`followers`), and only
    it sends and reads notices. A WRITE copies each head range straight from the rank
    that holds it into the peer rank that holds it, whatever the two sides' TP sizes: a
    page is head-major ([heads, page_size, head_dim], kv_cache.KVLayout), so the heads two
    ranks share are one run per page, and whole pages where they hold the same heads. The
    descriptors of every (K/V, layer, page) run are prepared once per pair of ranks when
    the peer connects (a Route); a WRITE picks them by index, and NIXL merges pages
    consecutive on both sides into one descriptor. Nothing is gathered."""

    def __init__(
        self,
        name: str,
        cache: KVCache,
        compat: bytes,
        ucx_devices: str,
        ucx_transports: str = "",
        progress_thread: bool = False,
        heads: range | None = None,
    ) -> None:
        """UCX runs on exactly `ucx_devices` over `ucx_transports` ("" for all of either);
        ConfigError naming the field if this host has not got them. Without a progress
        thread, UCX moves only inside `finished`, `notices` and the posting calls: the owner
        must call one of them regularly (workers do every tick). `heads`: the model's KV
        heads this cache holds (all of them without tensor parallelism)."""
        import torch

        package = nixl_package(torch.version.cuda)
        try:
            if package == "nixl_cu13":
                from nixl_cu13._api import nixl_agent, nixl_agent_config
            else:
                from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ModuleNotFoundError:
            pip = package.replace("_", "-")
            raise ConfigError(
                f"transfer: this torch is built for CUDA {torch.version.cuda or '(none)'}: "
                f"KV moves over NIXL's build for it, {pip} (pip install {pip}==1.5.1; "
                "scripts/setup picks it)"
            ) from None

        self.name = name
        self.cache = cache
        self.compat = compat
        self.heads = range(cache.layout.num_kv_heads) if heads is None else heads
        assert len(self.heads) == cache.layout.num_kv_heads, (self.heads, cache.layout)
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        self._agent = nixl_agent(name, config)
        _create_ucx_backend(self._agent, ucx_devices, ucx_transports)
        self._on_gpu = cache.k.is_cuda
        self._dev = cache.k.device.index or 0
        self._regs = [self._agent.register_memory(t) for t in (cache.k, cache.v)]
        self.page_bytes = cache.layout.page_bytes
        self.head_bytes = cache.layout.head_bytes  # one head of one page: one run
        self.followers: list[RankWriter] = []  # this model's other ranks, on rank 0
        self._peers: dict[str, Peer] = {}
        self._local_lists: dict[range, Any] = {}  # by the heads its runs cover
        self._inbox: list[Notice] = []

    @property
    def model_page_bytes(self) -> int:
        """One page of one layer of K (or V) over every rank: the model's heads."""
        num_heads = len(self.heads) + sum(len(f.memory.heads) for f in self.followers)
        return num_heads * self.head_bytes

    def memory(self) -> RankPages:
        """This rank's pages as a peer writes into them."""
        return RankPages(
            self.name,
            self._agent.get_agent_metadata(),
            self.cache.num_pages,
            self.page_bytes,
            self.cache.k.data_ptr(),
            self.cache.v.data_ptr(),
            self._on_gpu,
            self._dev,
            self.heads,
        )

    def handshake(self) -> bytes:
        ranks = (self.memory(), *(f.memory for f in self.followers))
        return Handshake(self.compat, self.cache.k.shape[0], ranks).encode()

    def connect(self, handshake: bytes) -> Peer:
        """The peer behind a handshake, connected once; IncompatiblePeerError if it differs
        or splits its heads in a way this rank's cannot map onto."""
        hs = Handshake.decode(handshake)
        hs.check(self.compat)
        self._check_heads(hs)
        known = self._peers.get(hs.agent)
        if known is not None and known.handshake == hs:
            return known
        if known is not None:  # the same name restarted: forget the old one
            for route in known.routes:
                self._agent.release_dlist_handle(route.remote)
            for rank in known.handshake.ranks:
                self._agent.remove_remote_agent(rank.agent)
        for rank in hs.ranks:
            self._agent.add_remote_agent(rank.agent_metadata)
        routes = tuple(
            self._route(rank, heads)
            for rank in hs.ranks
            if (heads := _overlap(self.heads, rank.heads))
        )
        peer = Peer(hs.agent, hs, handshake, routes)
        self._peers[hs.agent] = peer
        return peer

    def _route(self, rank: RankPages, heads: range) -> Route:
        """The prepared lists between this rank and `rank` for the heads both hold."""
        here = self.cache.layout
        there = replace(here, num_kv_heads=len(rank.heads))  # the hash: alike
        run = here.head_bytes * len(heads)
        local = self._local_lists.get(heads)
        if local is None:
            mine = _shifted(heads, self.heads.start)
            runs = here.head_runs(self.cache.num_pages, mine)
            rows = side_rows(self.cache.k.data_ptr(), self.cache.v.data_ptr(), runs, run, self._dev)
            local = self._prep("NIXL_INIT_AGENT", rows, self._on_gpu)
            self._local_lists[heads] = local
        runs = there.head_runs(rank.num_pages, _shifted(heads, rank.heads.start))
        rows = side_rows(rank.k_base, rank.v_base, runs, run, rank.device_id)
        return Route(rank, heads, local, self._prep(rank.agent, rows, rank.on_gpu))

    def _prep(self, agent: str, rows: np.ndarray, on_gpu: bool) -> Any:
        try:
            return self._agent.prep_xfer_dlist(agent, rows, "VRAM" if on_gpu else "DRAM")
        except Exception as e:  # NIXL raises its own types
            raise TransferError(f"descriptors for {agent} could not be prepared: {e}") from e

    def _check_heads(self, hs: Handshake) -> None:
        start = 0
        for rank in hs.ranks:
            if rank.heads.start != start or not rank.heads:
                why = f"its ranks' KV heads {[r.heads for r in hs.ranks]} do not tile from 0"
                raise IncompatiblePeerError(f"KV peer {hs.agent!r}: {why}")
            if rank.page_bytes != self.head_bytes * len(rank.heads):
                raise IncompatiblePeerError(
                    f"KV peer {hs.agent!r}: rank {rank.agent!r} has {rank.page_bytes}-byte "
                    f"pages for {len(rank.heads)} KV heads, ours {self.head_bytes} per head"
                )
            start = rank.heads.stop
        if self.heads.stop > start:
            raise IncompatiblePeerError(
                f"KV peer {hs.agent!r} holds KV heads 0-{start - 1}, "
                f"ours reach {self.heads.stop - 1}"
            )

    def write(
        self,
        peer: Peer,
        layers: range,
        src: Sequence[PageId],
        dst: Sequence[PageId],
        notice: Notice | None,
    ) -> Write:
        """Post the WRITE of pages src -> dst (K and V) for `layers`, this rank's heads into
        each peer rank holding them, and have the other ranks of this model post theirs;
        `notice` follows (rides on the one part when there is one). The caller posts only
        KV the device has finished writing on every rank (see the engine's LayerReady):
        UCX reads the pages as they are when it runs, and nothing here waits on the device.
        TransferError if no part could be posted; a part failing after another was posted
        fails the Write once every part is over."""
        hs = peer.handshake
        assert 0 <= layers.start < layers.stop <= hs.num_layers
        routes = peer.routes
        rides = not self.followers and len(routes) == 1 and routes[0].rank == hs.ranks[0]
        write = Write([], 0, peer, None if rides else notice)
        for route in routes:
            try:
                handle = self._post(route, layers, src, dst, notice if rides else None)
            except TransferError as e:
                if not write.handles:
                    raise
                write.error = str(e)
                return write
            write.handles.append(handle)
            write.num_bytes += 2 * len(src) * len(layers) * self.head_bytes * len(route.heads)
        n = 2 * len(src) * len(layers)
        for follower in self.followers:
            write.pending.append(follower.post(peer.raw, layers, src, dst))
            write.num_bytes += n * self.head_bytes * len(follower.memory.heads)
        return write

    def _post(
        self,
        route: Route,
        layers: range,
        src: Sequence[PageId],
        dst: Sequence[PageId],
        notice: Notice | None,
    ) -> Any:
        """Post one part: this rank's share of the pages into the route's rank's."""
        num_layers, rank = self.cache.layout.num_layers, route.rank
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE",
                route.local,
                side_indices(layers, src, num_layers, self.cache.num_pages),
                route.remote,
                side_indices(layers, dst, num_layers, rank.num_pages),
                b"" if notice is None else notice.encode(),
            )
            if self._agent.transfer(handle) == "ERR":
                self._agent.release_xfer_handle(handle)
                raise TransferError(f"WRITE to {rank.agent} failed to post")
        except TransferError:
            raise
        except Exception as e:  # NIXL raises its own types, e.g. on a disconnected peer
            raise TransferError(f"WRITE to {rank.agent} failed: {e}") from e
        return handle

    def finished(self, write: Write) -> bool:
        """True once every part of the WRITE is over and its notice is sent; TransferError
        if a part failed (a peer that went away included: NIXL then raises its own error,
        which must not escape, or each poll of the worker's loop would fail on it again),
        once none is in flight any more. Each part's handle is released as it ends."""
        still = []
        for handle in write.handles:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as e:
                state = f"{type(e).__name__}: {e}"
            if state == "PROC":
                still.append(handle)
                continue
            with contextlib.suppress(Exception):  # a failed transfer's handle may refuse too
                self._agent.release_xfer_handle(handle)
            if state != "DONE":
                write.error = write.error or f"WRITE failed in flight: {state}"
        write.handles = still
        pending = []
        for part in write.pending:
            try:
                if not part.done():
                    pending.append(part)
            except TransferError as e:
                write.error = write.error or str(e)
        write.pending = pending
        if write.handles or write.pending:
            return False
        if write.error:
            raise TransferError(write.error)
        if write.notice is not None:
            notice, write.notice = write.notice, None
            self.notify(write.peer, notice)
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


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def _shifted(heads: range, first: int) -> range:
    """The model's `heads` counted from a cache's first head, `first`."""
    return range(heads.start - first, heads.stop - first)


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
