"""The KV transfer wire format: a handshake and notices, fixed little-endian binary layouts.

Nothing here unpickles: every field is a number, a length-prefixed UTF-8 string or raw
bytes, and a message that is short, long, or from another version is refused with
WireError. Peers whose compatibility hash differs (model, dtype, quantization, page size
or KV layout) are refused with IncompatiblePeerError before any KV moves.
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct
from dataclasses import dataclass

import torch

from cluster.engine.kernels.kv_cache import KVLayout, kv_dtype
from cluster.engine.model.checkpoint import ModelSpec
from cluster.types import PageId, RequestId, SampledToken

MAGIC = b"SPKV"
# 2: STARTED, RENEW, ACK and REVOKE, a STARTED with its handshake; 3: DONE with top logprobs;
# 4: a handshake lists every rank of the model, each with its KV heads
VERSION = 4


class WireError(ValueError):
    """Bytes from a peer that are not a valid message of this version."""


class IncompatiblePeerError(ConnectionError):
    """A peer whose KV pages cannot be ours: another model, dtype, quantization, page size
    or layout."""


def compat_hash(
    spec: ModelSpec, dtype: str, kv_cache_dtype: str, page_size: int, quantization: str
) -> bytes:
    """16 bytes that two peers must share before one writes KV pages into the other: the
    model, the weights' quantization (KV from other weights is another model's KV) and the
    page format as KVLayout defines it (order, page size, KV dtype)."""
    kv = kv_dtype(kv_cache_dtype, getattr(torch, dtype))
    page = KVLayout.of(spec, page_size, kv).hash_input
    key = (
        f"{spec.name}|{spec.num_layers}|{spec.num_kv_heads}|{spec.head_dim}|{spec.vocab_size}|"
        f"{dtype}|{quantization}|{page}"
    )
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


class _Reader:
    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = memoryview(data), 0, what

    def take(self, fmt: str) -> tuple[int | float, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise WireError(f"{self.what}: truncated at byte {self.pos}")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def raw(self) -> bytes:
        (n,) = self.take("<I")
        end = self.pos + int(n)
        if end > len(self.data):
            raise WireError(f"{self.what}: field of {n} bytes runs past the end")
        out = bytes(self.data[self.pos : end])
        self.pos = end
        return out

    def text(self) -> str:
        try:
            return self.raw().decode()
        except UnicodeDecodeError:
            raise WireError(f"{self.what}: a string field is not UTF-8") from None

    def header(self) -> None:
        magic, version = self.take("<4sH")
        if magic != MAGIC:
            raise WireError(f"{self.what}: bad magic {magic!r}, not a splitserve KV message")
        if version != VERSION:
            raise WireError(f"{self.what}: version {version}, this build speaks {VERSION}")

    def end(self) -> None:
        if self.pos != len(self.data):
            raise WireError(f"{self.what}: {len(self.data) - self.pos} trailing bytes")


def _raw(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


@dataclass(frozen=True)
class RankPages:
    """One rank's KV cache as a peer writes into it: its transfer agent, where its pages
    are, and which of the model's KV heads they hold (a page of one layer is
    [len(heads), page_size, head_dim]: kv_cache.KVLayout)."""

    agent: str  # the rank's transfer agent name
    agent_metadata: bytes  # opaque to us: the transport's own connection blob
    num_pages: int
    page_bytes: int  # one page of one layer of K (or V)
    k_base: int  # address of k[0, 0]
    v_base: int
    on_gpu: bool
    device_id: int
    heads: range  # [start, stop) of the model's KV heads

    def encode(self) -> bytes:
        return b"".join(
            (
                _raw(self.agent.encode()),
                _raw(self.agent_metadata),
                struct.pack(
                    "<IQQQ?III",
                    self.num_pages,
                    self.page_bytes,
                    self.k_base,
                    self.v_base,
                    self.on_gpu,
                    self.device_id,
                    self.heads.start,
                    self.heads.stop,
                ),
            )
        )

    @staticmethod
    def read(r: _Reader) -> RankPages:
        agent, meta = r.text(), r.raw()
        pages, page_bytes, k_base, v_base, on_gpu, dev, h0, h1 = r.take("<IQQQ?III")
        return RankPages(
            agent,
            meta,
            int(pages),
            int(page_bytes),
            int(k_base),
            int(v_base),
            bool(on_gpu),
            int(dev),
            range(int(h0), int(h1)),
        )


@dataclass(frozen=True)
class Handshake:
    """What a KV receiver publishes so a sender can write into its pages: every rank of
    its model (tensor parallelism), rank 0 first, whose agent takes the notices."""

    compat: bytes  # compat_hash(...)
    num_layers: int
    ranks: tuple[RankPages, ...]

    @property
    def agent(self) -> str:
        """Where notices go: rank 0's agent."""
        return self.ranks[0].agent

    def encode(self) -> bytes:
        return b"".join(
            (
                struct.pack(
                    "<4sH16sIH", MAGIC, VERSION, self.compat, self.num_layers, len(self.ranks)
                ),
                *(rank.encode() for rank in self.ranks),
            )
        )

    @staticmethod
    def decode(data: bytes) -> Handshake:
        r = _Reader(data, "handshake")
        r.header()
        compat, layers, num_ranks = r.take("<16sIH")
        if not num_ranks:
            raise WireError("handshake: no rank")
        ranks = tuple(RankPages.read(r) for _ in range(int(num_ranks)))
        r.end()
        return Handshake(bytes(compat), int(layers), ranks)  # type: ignore[arg-type]

    def check(self, compat: bytes) -> None:
        """Refuse a peer that does not share our compatibility hash."""
        if self.compat != compat:
            raise IncompatiblePeerError(
                f"KV peer {self.agent!r} has compatibility hash {self.compat.hex()}, ours is "
                f"{compat.hex()}: model, dtype, quantization, page size or KV layout differ"
            )


class NoticeKind(enum.IntEnum):
    """Sender to receiver: STARTED, RENEW, LAYERS, DONE, CANCEL; receiver to sender: ACK,
    REVOKE (see cluster/transfer/inbound.py and push.py for the protocol)."""

    LAYERS = 1  # rides on a WRITE: these layers of these pages have landed
    DONE = 2  # the sender posted every WRITE of this request; carries the first token
    CANCEL = 3  # the sender stopped and has no WRITE left in flight
    STARTED = 4  # admitted to prefill: claims the pages; carries the sender's handshake
    RENEW = 5  # still queued or prefilling: the lease goes on
    ACK = 6  # the claim holds: WRITEs may follow
    REVOKE = 7  # post nothing more; CANCEL once nothing is in flight


@dataclass(frozen=True)
class Notice:
    """A notice between a KV sender and its receiver, about one request."""

    kind: NoticeKind
    request_id: RequestId
    layer_start: int = 0
    layer_end: int = 0
    pages: tuple[PageId, ...] = ()  # receiver's page ids written (LAYERS)
    num_bytes: int = 0  # bytes written (LAYERS) or in all (DONE)
    num_writes: int = 0  # DONE: how many LAYERS notices to expect
    first: SampledToken | None = None  # DONE: the first token
    handshake: bytes = b""  # STARTED: the sender's Handshake, for the receiver's answers

    def encode(self) -> bytes:
        """The first token travels as its id (-1: none), its logprob (NaN: not asked for)
        and its alternatives."""
        rid = self.request_id.encode()
        first = self.first or SampledToken(-1, None)
        logprob = math.nan if first.logprob is None else first.logprob
        return b"".join(
            (
                struct.pack("<4sHB", MAGIC, VERSION, self.kind),
                _raw(rid),
                struct.pack(
                    "<HHQIqd",
                    self.layer_start,
                    self.layer_end,
                    self.num_bytes,
                    self.num_writes,
                    first.token_id,
                    logprob,
                ),
                _raw(struct.pack(f"<{len(self.pages)}I", *self.pages)),
                _raw(self.handshake),
                _raw(b"".join(struct.pack("<qd", t, lp) for t, lp in first.top_logprobs)),
            )
        )

    @staticmethod
    def decode(data: bytes) -> Notice:
        r = _Reader(data, "notice")
        r.header()
        (kind,) = r.take("<B")
        if kind not in NoticeKind._value2member_map_:
            raise WireError(f"notice: unknown kind {kind}")
        rid = r.text()
        start, end, nbytes, nwrites, tok, lp = r.take("<HHQIqd")
        pages, handshake, top = r.raw(), r.raw(), r.raw()
        r.end()
        if len(pages) % 4:
            raise WireError("notice: page list is not a whole number of u32")
        if len(top) % 16:
            raise WireError("notice: top logprobs are not whole (i64, f64) pairs")
        tops = tuple((int(t), float(v)) for t, v in struct.iter_unpack("<qd", top))
        first = SampledToken(int(tok), None if math.isnan(lp) else float(lp), tops)
        return Notice(
            NoticeKind(int(kind)),
            RequestId(rid),
            int(start),
            int(end),
            tuple(PageId(p) for p in struct.unpack(f"<{len(pages) // 4}I", pages)),
            int(nbytes),
            int(nwrites),
            first if tok >= 0 else None,
            handshake,
        )
