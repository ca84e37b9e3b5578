"""The two transfer adapters together (prefill_worker.sender.KVSender and
decode_worker.receiver.KVReceiver) over a fake transport and two fake clocks, as vLLM's
FakeNixlWrapper tests its connector: notices go through in order, a WRITE lands when the
test lets the network move, and landing into pages the receiver has already handed on
fails the test. Each side's clock starts minutes away from the other's, both ways: only
durations count, so no skew lets a WRITE reach a page that was let go."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from cluster.engine.kv_sink import KVStored, PageHolds, PromptDone
from cluster.engine.layer_ready import LayerReady
from cluster.engine.sched.page_pool import PagePool
from cluster.transfer import inbound
from cluster.transfer.inbound import Terms
from cluster.transfer.wire import Notice, NoticeKind
from cluster.types import PageId, RequestId, SampledToken
from decode_worker.receiver import KVReceiver, Release, Transfer
from prefill_worker.sender import KVSender

LAYERS, PAGE, LEASE_S = 3, 16, 30.0
RID = RequestId("r")
DST = tuple(PageId(p) for p in (7, 8, 9))
FIRST = SampledToken(5, -0.5)


@dataclass
class Clock:
    """A monotonic clock whose origin is its own; `Net.wait` moves every clock alike."""

    now: float

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeWrite:
    to: str
    dst: list[PageId]
    notice: Notice
    done: bool = False
    num_bytes: int = 0


@dataclass
class Net:
    """Two endpoints by name; what the receiver has let go, to check each landing against."""

    clocks: list[Clock]
    inboxes: dict[str, list[Notice]] = field(default_factory=dict)
    in_flight: list[FakeWrite] = field(default_factory=list)
    released: list[tuple[RequestId, Release]] = field(default_factory=list)
    landed: int = 0

    def wait(self, seconds: float) -> None:
        for clock in self.clocks:
            clock.now += seconds

    def land(self) -> None:
        """Every WRITE in flight lands, then its LAYERS notice."""
        for write in self.in_flight:
            rid = write.notice.request_id
            assert rid not in [r for r, _ in self.released], "a WRITE landed in let-go pages"
            assert set(write.dst) <= set(DST)
            write.done = True
            self.landed += 1
            self.inboxes[write.to].append(write.notice)
        self.in_flight.clear()


@dataclass
class FakeEndpoint:
    name: str
    net: Net
    model_page_bytes: int = 64

    def handshake(self) -> bytes:
        return self.name.encode()

    def connect(self, handshake: bytes) -> str:
        return handshake.decode()

    def notify(self, peer: str, notice: Notice) -> None:
        self.net.inboxes[peer].append(Notice.decode(notice.encode()))  # as the wire has it

    def notices(self) -> list[Notice]:
        out, self.net.inboxes[self.name] = self.net.inboxes[self.name], []
        return out

    def write(self, peer: str, layers: range, src: Any, dst: Any, notice: Notice) -> FakeWrite:
        self.net.in_flight.append(FakeWrite(peer, list(dst), notice))
        return self.net.in_flight[-1]

    def finished(self, write: FakeWrite) -> bool:
        return write.done


@dataclass
class Pair:
    net: Net
    sender: KVSender
    receiver: KVReceiver
    pool: PagePool
    holds: PageHolds
    pages: tuple[PageId, ...]  # the prompt's, on the prefill worker
    transfers: dict[RequestId, Transfer]  # the decode worker's, as its streams hold them
    num_computed: int = 0

    def sync(self) -> None:
        """Wait until the sender's transfer thread has run every job queued so far."""
        self.sender.transfers.submit(int).result()

    def tick(self) -> None:
        """One turn of each worker's loop, a millisecond apart (the sender's in two polls:
        the first has its transfer thread look at the network, the second takes that in)."""
        for _ in range(2):
            self.sender.poll()
            self.sync()
        self.receive()
        self.net.wait(0.001)

    def receive(self) -> None:
        """The decode worker reads its notices and checks its leases."""
        self.released(self.receiver.poll(self.transfers))

    def abort(self) -> None:
        self.released(self.receiver.abort(RID, self.transfers[RID]))

    def released(self, released: list[tuple[RequestId, Release]]) -> None:
        """As the decode worker does: a released transfer is its stream's no more."""
        for rid, _ in released:
            del self.transfers[rid]
        self.net.released += released

    def chunk(self, n: int) -> None:
        """The prefill worker computes the next n prompt tokens, layer by layer."""
        self.num_computed += n
        pages = self.pages[: -(-self.num_computed // PAGE)]
        for layer in range(LAYERS):
            ready = LayerReady(torch.device("cpu"))
            stored = KVStored(RID, range(layer, layer + 1), self.num_computed, 40, pages, ready)
            self.sender.stored([stored])
            self.sync()

    def first_token(self, token: SampledToken = FIRST) -> None:
        self.sender.prompt_done(PromptDone(RID, token))
        self.sync()

    def release(self) -> Release:
        (only,) = self.net.released
        assert only[0] == RID
        return only[1]


def pair(sender_offset_s: float, receiver_offset_s: float, recompute: bool = True) -> Pair:
    clocks = [Clock(sender_offset_s), Clock(receiver_offset_s)]
    net = Net(clocks, {"prefill": [], "decode": []})
    pool = PagePool(8, PAGE)
    holds = PageHolds(pool)
    sender = KVSender(
        FakeEndpoint("prefill", net),  # type: ignore[arg-type]
        holds,
        PAGE,
        LAYERS,
        True,
        clocks[0],
    )
    terms = Terms(LEASE_S, 10 * LEASE_S, recompute)
    receiver = KVReceiver(FakeEndpoint("decode", net), terms, LAYERS, clocks[1])  # type: ignore[arg-type]
    pages = tuple(pool.allocate(3) or [])
    transfer = Transfer(inbound.waiting(terms))
    target = receiver.expect(RID, transfer, DST, 0)
    sender.start(RID, target)
    sender.transfers.submit(int).result()  # STARTED is out
    return Pair(net, sender, receiver, pool, holds, pages, {RID: transfer})


def prefill_and_land(p: Pair, token: SampledToken = FIRST) -> None:
    """The whole prompt in three chunks, each chunk's WRITEs landing at once, then DONE."""
    for n in (16, 16, 8):
        p.chunk(n)
        p.tick()
        p.net.land()
    p.first_token(token)
    while not p.net.released:
        p.tick()


SKEWS = [(0.0, 0.0), (1.7e9, 1.7e9 + 300), (1.7e9 + 300, 1.7e9), (-600.0, 5e5)]


def assert_clean(p: Pair) -> None:
    """The push is gone, its source pages are free again, and nothing is left in flight."""
    p.pool.free(p.pages)
    assert p.sender.num_pushes == 0 and not p.transfers and p.holds.num_held == 0
    assert p.pool.num_free == 8 and not p.net.in_flight


@pytest.mark.parametrize(("sender_s", "receiver_s"), SKEWS)
def test_kv_that_lands_in_time_decodes(sender_s: float, receiver_s: float) -> None:
    p = pair(sender_s, receiver_s)
    p.tick()  # STARTED -> ACK
    prefill_and_land(p)
    assert p.release() == inbound.StartDecode(FIRST)
    assert p.net.landed == 3 * LAYERS
    p.tick()
    assert_clean(p)


def test_the_first_token_reaches_the_decode_worker_as_sampled() -> None:
    """Its alternatives, and no logprob where none was asked for (the wire's NaN)."""
    token = SampledToken(5, None, ((5, -0.25), (9, -2.5)))
    p = pair(0.0, 0.0)
    p.tick()
    prefill_and_land(p, token)
    assert p.release() == inbound.StartDecode(token)


def test_a_done_without_its_first_token_is_dropped_and_the_pages_stay_reserved() -> None:
    p = pair(0.0, 0.0)
    p.tick()
    p.net.inboxes["decode"].append(Notice(NoticeKind.DONE, RID, num_writes=0))
    p.receive()
    assert not p.net.released and list(p.transfers) == [RID]


@pytest.mark.parametrize(("sender_s", "receiver_s"), SKEWS)
def test_a_long_queue_renews_the_lease_and_the_kv_still_decodes(
    sender_s: float, receiver_s: float
) -> None:
    p = pair(sender_s, receiver_s)
    for _ in range(8):  # two minutes queued on the prefill worker, four leases long
        p.tick()
        p.net.wait(LEASE_S / 2)
    prefill_and_land(p)
    assert p.release() == inbound.StartDecode(FIRST)


@pytest.mark.parametrize(("sender_s", "receiver_s"), SKEWS)
def test_a_stalled_sender_is_revoked_and_its_in_flight_writes_land_before_the_pages_go(
    sender_s: float, receiver_s: float
) -> None:
    p = pair(sender_s, receiver_s, recompute=False)
    p.tick()
    p.chunk(16)  # posted; the network is slow: in flight
    p.receive()
    p.net.wait(LEASE_S + 1)  # the prefill worker stalls in one long step
    p.receive()  # the decode worker's lease ends: REVOKE
    assert not p.net.released and len(p.transfers) == 1
    p.chunk(16)  # the stalled step ends: nothing more is posted
    p.first_token()
    assert len(p.net.in_flight) == LAYERS
    for _ in range(5):
        p.tick()  # no CANCEL while WRITEs are in flight, so the pages stay
    assert not p.net.released
    p.net.land()
    while not p.net.released:
        p.tick()
    release = p.release()
    assert isinstance(release, inbound.Fail) and "lease_s=30.0" in release.why
    assert p.sender.stats.lease_misses == 1
    p.tick()
    assert_clean(p)


@pytest.mark.parametrize(("sender_s", "receiver_s"), SKEWS)
def test_an_abort_on_the_decode_worker_revokes_and_frees_after_the_cancel(
    sender_s: float, receiver_s: float
) -> None:
    p = pair(sender_s, receiver_s)
    p.tick()
    p.chunk(16)
    p.abort()
    assert not p.net.released
    p.tick()  # REVOKE reaches the sender; its WRITEs are still in flight
    p.chunk(16)
    assert len(p.net.in_flight) == LAYERS
    p.net.land()
    while not p.net.released:
        p.tick()
    assert p.release() == inbound.FreePages()
    p.tick()
    assert_clean(p)


def test_pages_nobody_claims_are_let_go_and_a_late_claim_posts_nothing() -> None:
    p = pair(0.0, 0.0)
    p.net.inboxes["decode"].clear()  # the STARTED was lost (or came too late)
    p.net.wait(LEASE_S + 1)
    p.receive()
    assert isinstance(p.release(), inbound.Recompute)
    p.net.inboxes["decode"].append(Notice(NoticeKind.STARTED, RID, handshake=b"prefill"))
    p.tick()  # answered with REVOKE
    p.chunk(16)
    p.tick()
    assert not p.net.in_flight and p.net.landed == 0
    assert_clean(p)
