"""KVSender over a fake endpoint: STARTED claims the pages and no WRITE goes before the
receiver's ACK, a layer's WRITE is posted only once the device has passed the layer's
mark, in stream order, DONE follows the last WRITE, an abort or a REVOKE drops planned
WRITEs and releases their pages, and nothing on the WRITE path waits on a stream."""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import prefill_worker.sender as sender_module
from cluster.engine.page_pool import PagePool
from cluster.engine.scheduler import Step
from cluster.engine.sequence import Sequence
from cluster.transfer.endpoint import KVEndpoint
from cluster.transfer.layer_ready import LayerReady
from cluster.transfer.wire import Notice, NoticeKind
from cluster.types import KVTarget, PageId, RequestId, SamplingParams
from prefill_worker.sender import KVSender

LAYERS, PAGE = 3, 16


@dataclass
class FakeWrite:
    layers: range
    src: list[PageId]
    done: bool = False
    num_bytes: int = 0


@dataclass
class FakeEndpoint:
    """Records what the sender posts; a WRITE finishes when the test says so."""

    page_bytes: int = 64
    writes: list[FakeWrite] = field(default_factory=list)
    posted: list[Notice] = field(default_factory=list)  # sent
    inbox: list[Notice] = field(default_factory=list)  # from the receiver, not yet read

    def handshake(self) -> bytes:
        return b"prefill-hs"

    def connect(self, handshake: bytes) -> str:
        return "peer"

    def write(self, peer: str, layers: range, src: Any, dst: Any, notice: Notice) -> FakeWrite:
        self.writes.append(FakeWrite(layers, list(src)))
        self.posted.append(notice)
        return self.writes[-1]

    def finished(self, write: FakeWrite) -> bool:
        return write.done

    def notify(self, peer: str, notice: Notice) -> None:
        self.posted.append(notice)

    def notices(self) -> list[Notice]:
        out, self.inbox = self.inbox, []
        return out

    def sent(self) -> list[NoticeKind]:
        """The kinds of notice sent after STARTED."""
        assert self.posted[0].kind is NoticeKind.STARTED
        assert self.posted[0].handshake == self.handshake()
        return [n.kind for n in self.posted[1:]]


@dataclass
class FakeMark:
    """A LayerReady whose device is as far along as the test says."""

    device: torch.device
    passed: bool = False

    def done(self) -> bool:
        return self.passed


@pytest.fixture
def marks(monkeypatch: pytest.MonkeyPatch) -> list[FakeMark]:
    made: list[FakeMark] = []

    def mark(device: torch.device) -> FakeMark:
        made.append(FakeMark(device))
        return made[-1]

    monkeypatch.setattr(sender_module, "LayerReady", mark)
    return made


def _prefill(
    pool: PagePool, endpoint: FakeEndpoint, device: str = "cuda", acked: bool = True
) -> tuple[KVSender, Sequence, Step]:
    sender = KVSender(endpoint, pool, LAYERS, True, torch.device(device))  # type: ignore[arg-type]
    seq = Sequence(RequestId("r"), list(range(40)), 40, SamplingParams())
    seq.pages = pool.allocate(3) or []
    target = KVTarget(b"hs", tuple(PageId(p) for p in (7, 8, 9)), 0, 60.0)
    sender.start(seq.request_id, target)
    if acked:
        endpoint.inbox.append(Notice(NoticeKind.ACK, seq.request_id))
    return sender, seq, Step(prefills=[(seq, 40)])


def test_a_layers_write_is_posted_once_the_device_passes_its_mark(marks: list[FakeMark]) -> None:
    pool, endpoint = PagePool(8, PAGE), FakeEndpoint()
    sender, seq, step = _prefill(pool, endpoint)
    for layer in range(LAYERS):
        sender.on_layer(step, layer)
    sender.first_token(seq.request_id, 5, -0.5)
    assert endpoint.writes == [] and endpoint.sent() == []  # the device has run nothing
    marks[0].passed = True
    assert sender.poll()
    assert [w.layers for w in endpoint.writes] == [range(0, 1)]
    marks[1].passed = marks[2].passed = True
    sender.poll()
    assert [w.layers for w in endpoint.writes] == [range(0, 1), range(1, 2), range(2, 3)]
    assert endpoint.sent() == [NoticeKind.LAYERS] * 3 + [NoticeKind.DONE]
    assert endpoint.posted[-1].num_writes == 3 and endpoint.posted[-1].first_token == 5
    for w in endpoint.writes:
        w.done = True
    sender.poll()
    pool.free(seq.pages)
    assert sender.num_pushes == 0 and pool.num_free == 8


def test_marks_pass_in_stream_order_a_later_layer_never_overtakes(
    marks: list[FakeMark],
) -> None:
    pool, endpoint = PagePool(8, PAGE), FakeEndpoint()
    sender, _, step = _prefill(pool, endpoint)
    sender.on_layer(step, 0)
    sender.on_layer(step, 1)
    marks[1].passed = True  # cannot happen on one stream; the sender still keeps order
    sender.poll()
    assert endpoint.writes == []


def test_an_abort_drops_planned_writes_and_releases_their_pages(marks: list[FakeMark]) -> None:
    pool, endpoint = PagePool(8, PAGE), FakeEndpoint()
    sender, seq, step = _prefill(pool, endpoint)
    sender.on_layer(step, 0)
    sender.on_layer(step, 1)
    sender.stop(seq.request_id)
    sender.poll()
    assert sender.num_pushes == 0 and endpoint.writes == []
    assert endpoint.sent() == [NoticeKind.CANCEL]
    pool.free(seq.pages)
    assert pool.num_free == 8


def test_no_write_goes_before_the_ack_and_planned_ones_go_once_it_comes() -> None:
    pool, endpoint = PagePool(8, PAGE), FakeEndpoint()
    sender, seq, step = _prefill(pool, endpoint, "cpu", acked=False)
    sender.on_layer(step, 0)
    sender.on_layer(step, 1)
    assert endpoint.writes == [] and endpoint.sent() == []
    endpoint.inbox.append(Notice(NoticeKind.ACK, seq.request_id))
    sender.poll()
    assert [w.layers for w in endpoint.writes] == [range(0, 1), range(1, 2)]


def test_a_revoke_posts_nothing_more_and_cancels_once_the_in_flight_write_completes() -> None:
    pool, endpoint = PagePool(8, PAGE), FakeEndpoint()
    sender, seq, step = _prefill(pool, endpoint, "cpu")
    sender.on_layer(step, 0)  # posted: in flight
    endpoint.inbox.append(Notice(NoticeKind.REVOKE, seq.request_id))
    sender.poll()
    sender.on_layer(step, 1)
    sender.first_token(seq.request_id, 5, -0.5)
    assert len(endpoint.writes) == 1 and endpoint.sent() == [NoticeKind.LAYERS]
    endpoint.writes[0].done = True
    sender.poll()
    assert endpoint.sent() == [NoticeKind.LAYERS, NoticeKind.CANCEL]
    assert sender.num_pushes == 0 and sender.stats.lease_misses == 1
    pool.free(seq.pages)
    assert pool.num_free == 8


def test_on_cpu_each_layer_is_written_as_soon_as_it_is_reached() -> None:
    pool, endpoint = PagePool(8, PAGE), FakeEndpoint()
    sender, _, step = _prefill(pool, endpoint, "cpu")
    sender.on_layer(step, 0)
    assert [w.layers for w in endpoint.writes] == [range(0, 1)]
    assert LayerReady(torch.device("cpu")).done()


def _code_names(fn: Any) -> set[str]:
    """Every attribute and global name a function's bytecode uses, nested functions too."""
    names: set[str] = set()
    todo = [fn.__code__]
    while todo:
        code = todo.pop()
        names.update(code.co_names)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def test_nothing_on_the_write_path_waits_on_a_stream_or_the_device() -> None:
    path = [
        KVEndpoint.write,
        KVSender.on_layer,
        KVSender.first_token,
        KVSender.poll,
        KVSender._post_ready,
        KVSender._on,
        KVSender._apply,
        KVSender._post,
        LayerReady.done,
    ]
    for fn in path:
        assert not {"synchronize", "wait"} & _code_names(fn), fn.__qualname__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_mark_passes_once_the_work_queued_before_it_has_run() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = x @ x / 4096
    mark = LayerReady(x.device)
    deadline = time.monotonic() + 30
    while not mark.done():
        assert time.monotonic() < deadline
    assert torch.isfinite(x).all()
