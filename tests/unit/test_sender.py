"""KVSender over a fake endpoint, fed KV events as the engine makes them (the engine's
side played by the test over a real PagePool): STARTED claims the pages and no WRITE goes
before the receiver's ACK, a layer's WRITE is posted only once the device has passed the
layer's mark, in stream order, DONE follows the last WRITE, a WRITE's source pages stay
held in the engine until it completes, an abort or a REVOKE drops planned WRITEs and
releases their pages, and nothing on the WRITE path waits on a stream. The endpoint is
entered only from the sender's transfer thread; the test waits for that thread (`sync`)
before it looks at what was posted."""

from __future__ import annotations

import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from cluster.engine.kv_sink import KVStored, PageHolds, PromptDone
from cluster.engine.layer_ready import LayerReady
from cluster.engine.sched.page_pool import PagePool
from cluster.transfer.endpoint import KVEndpoint
from cluster.transfer.wire import Notice, NoticeKind
from cluster.types import KVTarget, PageId, RequestId, SampledToken
from prefill_worker.sender import WRITES_PER_STEP, KVSender

LAYERS, PAGE = 3, 16
RID = RequestId("r")


@dataclass
class FakeWrite:
    layers: range
    src: list[PageId]
    done: bool = False
    num_bytes: int = 0


@dataclass
class FakeEndpoint:
    """Records what the sender posts, and the thread of every call; a WRITE finishes when
    the test says so, and is seen finished once `seen` is set."""

    model_page_bytes: int = 64
    writes: list[FakeWrite] = field(default_factory=list)
    posted: list[Notice] = field(default_factory=list)  # sent
    inbox: list[Notice] = field(default_factory=list)  # from the receiver, not yet read
    threads: set[int] = field(default_factory=set)  # that called in
    seen: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.seen.set()

    def handshake(self) -> bytes:
        self.threads.add(threading.get_ident())
        return b"prefill-hs"

    def connect(self, handshake: bytes) -> str:
        self.threads.add(threading.get_ident())
        return "peer"

    def write(self, peer: str, layers: range, src: Any, dst: Any, notice: Notice) -> FakeWrite:
        self.threads.add(threading.get_ident())
        self.writes.append(FakeWrite(layers, list(src)))
        self.posted.append(notice)
        return self.writes[-1]

    def finished(self, write: FakeWrite) -> bool:
        self.threads.add(threading.get_ident())
        self.seen.wait()
        return write.done

    def notify(self, peer: str, notice: Notice) -> None:
        self.threads.add(threading.get_ident())
        self.posted.append(notice)

    def notices(self) -> list[Notice]:
        self.threads.add(threading.get_ident())
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

    passed: bool = False

    def done(self) -> bool:
        return self.passed


class Prefill:
    """One 40-token prompt (3 pages of a real pool) pushed to pages 7, 8, 9; the test
    plays the engine, reporting each layer as the engine's KV sink seam does."""

    def __init__(self, acked: bool = True, stream: bool = True, layers: int = LAYERS) -> None:
        self.pool = PagePool(8, PAGE)
        self.holds = PageHolds(self.pool)
        self.endpoint = FakeEndpoint()
        self.sender = KVSender(self.endpoint, self.holds, PAGE, layers, stream)  # type: ignore[arg-type]
        self.pages = tuple(self.pool.allocate(3) or [])
        self.marks: list[FakeMark] = []
        target = KVTarget(b"hs", tuple(PageId(p) for p in (7, 8, 9)), 0, 60.0)
        self.sender.start(RID, target)
        self.sync()
        if acked:
            self.endpoint.inbox.append(Notice(NoticeKind.ACK, RID))
            self.poll()

    def sync(self) -> None:
        """Wait until the transfer thread has run every job queued so far."""
        self.sender.transfers.submit(int).result()

    def poll(self) -> bool:
        """A poll of the worker's loop, its transfer thread's jobs run, and the next poll,
        which takes in what they saw."""
        self.sender.poll()
        self.sync()
        busy = self.sender.poll()
        self.sync()
        return busy

    def layer(self, i: int, num_tokens: int = 40, passed: bool = False) -> None:
        """Layer i of the first `num_tokens` tokens is queued; the device is past it if
        `passed`."""
        self.marks.append(FakeMark(passed))
        pages = self.pages[: -(-num_tokens // PAGE)]
        ready: Any = self.marks[-1]
        self.sender.stored([KVStored(RID, range(i, i + 1), num_tokens, 40, pages, ready)])
        self.sync()

    def done(self) -> None:
        self.sender.prompt_done(PromptDone(RID, SampledToken(5, -0.5)))
        self.sync()

    def finish(self) -> None:
        """The engine ends the request: its own references go; held pages stay."""
        self.pool.free(self.pages)

    def assert_clean(self) -> None:
        assert self.sender.num_pushes == 0 and self.holds.num_held == 0
        assert self.pool.num_free == 8


def test_a_layers_write_is_posted_once_the_device_passes_its_mark() -> None:
    p = Prefill()
    for layer in range(LAYERS):
        p.layer(layer)
    p.done()
    p.finish()
    assert p.endpoint.writes == [] and p.endpoint.sent() == []  # the device has run nothing
    assert p.holds.num_held == 3 * LAYERS and p.pool.num_free == 5  # held for the WRITEs
    p.marks[0].passed = True
    assert p.poll()
    assert [w.layers for w in p.endpoint.writes] == [range(0, 1)]
    p.marks[1].passed = p.marks[2].passed = True
    p.poll()
    assert [w.layers for w in p.endpoint.writes] == [range(0, 1), range(1, 2), range(2, 3)]
    assert p.endpoint.sent() == [NoticeKind.LAYERS] * 3 + [NoticeKind.DONE]
    done = p.endpoint.posted[-1]
    assert done.num_writes == 3 and done.first == SampledToken(5, -0.5)
    assert p.sender.stats.writes == 3  # the open push's count
    for w in p.endpoint.writes[:2]:
        w.done = True
    p.poll()
    assert p.holds.num_held == 3 and p.pool.num_free == 5  # the last WRITE still reads them
    p.endpoint.writes[2].done = True
    p.poll()
    p.assert_clean()
    assert p.sender.stats.writes == 3  # the closed push's count, kept


def test_each_chunk_writes_only_its_new_pages() -> None:
    p = Prefill()
    for n in (16, 32, 40):
        for layer in range(LAYERS):
            p.layer(layer, n, passed=True)
    srcs = [w.src for w in p.endpoint.writes if w.layers == range(0, 1)]
    assert srcs == [list(p.pages[:1]), list(p.pages[1:2]), list(p.pages[2:3])]


def test_a_deep_models_step_goes_in_a_few_writes_each_a_run_of_layers() -> None:
    """Twice WRITES_PER_STEP layers: each step's new pages go in runs of two layers, a run's
    WRITE posted once its last layer is computed (a WRITE per layer cost ~0.6 ms each)."""
    layers = 2 * WRITES_PER_STEP
    p = Prefill(layers=layers)
    p.layer(0, 16, passed=True)
    assert p.endpoint.writes == []  # its run is not done
    for layer in range(1, layers):
        p.layer(layer, 16, passed=True)
    for layer in range(layers):
        p.layer(layer, 40, passed=True)
    p.done()
    runs = [range(i, i + 2) for i in range(0, layers, 2)]
    first, rest = list(p.pages[:1]), list(p.pages[1:])
    want = [(r, first) for r in runs] + [(r, rest) for r in runs]
    assert [(w.layers, w.src) for w in p.endpoint.writes] == want
    assert p.endpoint.posted[-1].num_writes == 2 * WRITES_PER_STEP
    p.finish()
    for w in p.endpoint.writes:
        w.done = True
    p.poll()
    p.assert_clean()


def test_unstreamed_one_write_carries_every_layer_once_the_prompt_is_computed() -> None:
    p = Prefill(stream=False)
    for n in (24, 40):
        for layer in range(LAYERS):
            p.layer(layer, n, passed=True)
    assert [(w.layers, w.src) for w in p.endpoint.writes] == [(range(LAYERS), list(p.pages))]


def test_marks_pass_in_stream_order_a_later_layer_never_overtakes() -> None:
    p = Prefill()
    p.layer(0)
    p.layer(1)
    p.marks[1].passed = True  # cannot happen on one stream; the sender still keeps order
    p.poll()
    assert p.endpoint.writes == []


def test_an_abort_drops_planned_writes_and_releases_their_pages() -> None:
    p = Prefill()
    p.layer(0)
    p.layer(1)
    p.sender.stop(RID)
    p.poll()
    assert p.sender.num_pushes == 0 and p.endpoint.writes == []
    assert p.endpoint.sent() == [NoticeKind.CANCEL]
    p.finish()
    p.assert_clean()


def test_no_write_goes_before_the_ack_and_planned_ones_go_once_it_comes() -> None:
    p = Prefill(acked=False)
    p.layer(0, passed=True)
    p.layer(1, passed=True)
    assert p.endpoint.writes == [] and p.endpoint.sent() == []
    p.endpoint.inbox.append(Notice(NoticeKind.ACK, RID))
    p.poll()
    assert [w.layers for w in p.endpoint.writes] == [range(0, 1), range(1, 2)]


def test_a_revoke_posts_nothing_more_and_cancels_once_the_in_flight_write_completes() -> None:
    p = Prefill()
    p.layer(0, passed=True)  # posted: in flight
    p.endpoint.inbox.append(Notice(NoticeKind.REVOKE, RID))
    p.poll()
    p.layer(1, passed=True)
    p.done()
    p.finish()
    assert len(p.endpoint.writes) == 1 and p.endpoint.sent() == [NoticeKind.LAYERS]
    p.endpoint.writes[0].done = True
    p.poll()
    assert p.endpoint.sent() == [NoticeKind.LAYERS, NoticeKind.CANCEL]
    assert p.sender.stats.lease_misses == 1
    p.assert_clean()


def test_on_cpu_each_layer_is_written_as_soon_as_it_is_reached() -> None:
    p = Prefill()
    ready = LayerReady(torch.device("cpu"))
    assert ready.done()
    p.sender.stored([KVStored(RID, range(0, 1), 40, 40, p.pages, ready)])
    p.sync()
    assert [w.layers for w in p.endpoint.writes] == [range(0, 1)]


def test_the_engine_thread_never_enters_the_endpoint() -> None:
    p = Prefill()
    for layer in range(LAYERS):
        p.layer(layer, passed=True)
    p.done()
    p.finish()
    for w in p.endpoint.writes:
        w.done = True
    p.poll()
    p.assert_clean()
    transfer = p.sender.transfers.submit(threading.get_ident).result()
    assert p.endpoint.threads == {transfer} != {threading.get_ident()}
    assert p.endpoint.sent() == [NoticeKind.LAYERS] * LAYERS + [NoticeKind.DONE]
    p.sender.close()


def test_a_writes_pages_stay_held_until_the_transfer_thread_sees_it_over() -> None:
    p = Prefill()
    p.layer(0, passed=True)
    assert len(p.endpoint.writes) == 1
    p.endpoint.seen.clear()  # the transfer thread's next look at the WRITE waits here
    p.endpoint.writes[0].done = True
    p.sender.poll()  # its transfer thread is stuck in `finished`
    p.sender.poll()
    assert p.holds.num_held == 3  # done in the transport, but not yet seen done
    p.endpoint.seen.set()
    p.sync()
    p.sender.poll()
    assert p.holds.num_held == 0


def test_closing_posts_what_is_queued_and_joins_the_transfer_thread() -> None:
    p = Prefill()
    thread = p.sender.transfers.submit(threading.current_thread).result()
    with p.sender:
        p.endpoint.seen.clear()
        p.sender.poll()  # the transfer thread waits in `finished`...
        p.sender.stored([KVStored(RID, range(0, 1), 40, 40, p.pages, FakeMark(True))])  # type: ignore[arg-type]
        p.endpoint.seen.set()  # ...and the WRITE queued behind it still goes
    assert [w.layers for w in p.endpoint.writes] == [range(0, 1)]
    assert not thread.is_alive()


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
        KVSender.stored,
        KVSender._plan,
        KVSender.prompt_done,
        KVSender.poll,
        KVSender._post_ready,
        KVSender._on,
        KVSender._apply,
        KVSender._post,
        KVSender._write,
        KVSender._drive,
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
