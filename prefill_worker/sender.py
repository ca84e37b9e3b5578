"""Pushes prompt KV from the prefill engine's pages into a decode worker's reserved pages:
the engine's KV sink (cluster/engine/kv_sink.py), and the adapter between the pure push
state machine (cluster/transfer/push.py, which owns the protocol) and the NIXL endpoint.

One push per request. `start` (the request was admitted to prefill) sends STARTED with
this worker's handshake; WRITEs are planned meanwhile but posted only after the
receiver's ACK. With streaming, every engine step WRITEs its new pages a run of layers
at a time (at most WRITES_PER_STEP runs) as soon as the run is computed, so the transfer
hides behind the rest of the prefill; without it, one WRITE per request carries all
layers once its prompt is done. A run's WRITE is planned from the engine's KVStored
events (each layer is queued) and posted once the device has passed its last layer's
mark, polled here: the compute stream never waits for the network. Each planned WRITE
holds its source pages through the engine's PageHolds until it completes or is dropped;
this module never sees the engine's page pool or sequences. RENEW keeps the receiver's
lease while the request waits or computes; DONE carries the first token and the WRITE
count; a push that stops (abort, REVOKE, a stall past the lease, transport error) posts
nothing more and sends CANCEL once no WRITE is in flight.

Threads: the push state, the plans and the holds are the engine thread's; the endpoint
(NIXL, UCX) is entered only from the sender's one transfer thread, in the order the
engine thread queued its jobs: connect, notices, WRITEs and the polls that read the
receivers' notices and see WRITEs finish. The engine's step only queues. A WRITE's
outcome comes back as a future that the engine thread reads at its next poll: only then
are the WRITE's pages released, so a page is never freed while a WRITE of it can land.
`close` (or leaving `with`) runs what is queued and joins the thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import NamedTuple

from cluster.engine.kv_sink import KVStored, PageHolds, PromptDone
from cluster.engine.layer_ready import LayerReady
from cluster.protocol import SendStats
from cluster.transfer import push as machine
from cluster.transfer.endpoint import KVEndpoint, Peer, TransferError, Write
from cluster.transfer.push import PushStatus, StopCause
from cluster.transfer.wire import Notice, NoticeKind
from cluster.types import KVTarget, PageId, RequestId

log = logging.getLogger(__name__)

# With streaming, a step's new pages go out in at most this many WRITEs, each a run of
# layers: a WRITE and its notice cost the engine thread ~0.6 ms on a CPU host, so one per
# layer (30 in the bundled model) added ~20 ms to a 64-token prompt's first token; what
# the transfer adds after the compute is the last run's.
WRITES_PER_STEP = 4


@dataclass(frozen=True)
class _Planned:
    """A WRITE worked out when its layers were queued, to post once they are computed."""

    ready: LayerReady
    layers: range
    src: list[PageId]  # held until the WRITE completes or is dropped
    dst: list[PageId]


class _Outcome(NamedTuple):
    """How a WRITE ended, as the transfer thread saw it."""

    ok: bool
    num_bytes: int  # 0: it was never posted
    post_s: float  # the posting call's time


@dataclass
class _Push:
    peer: Peer
    target: KVTarget
    state: machine.Push
    sent_upto: int  # leading prompt tokens whose KV (all layers) is planned
    planned: list[_Planned] = field(default_factory=list)  # in stream order
    # Posted (queued to the transfer thread), with the pages each holds until it is over.
    writes: list[tuple[Future[_Outcome], list[PageId]]] = field(default_factory=list)


class KVSender:
    def __init__(
        self,
        endpoint: KVEndpoint,
        holds: PageHolds,
        page_size: int,
        num_layers: int,
        stream_layers: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`holds`: the engine's, to keep a WRITE's source pages while it is in flight;
        `clock`: this worker's own monotonic clock; leases are durations on it."""
        self.endpoint = endpoint
        self.holds = holds
        self.page_size = page_size
        self.num_layers = num_layers
        self.stream_layers = stream_layers
        self.layers_per_write = -(-num_layers // WRITES_PER_STEP)
        self.clock = clock
        self._stats = SendStats()  # `writes`: the closed pushes' (each push counts its own)
        self.model_page_bytes = endpoint.model_page_bytes  # (a plain value: no NIXL)
        # The one thread that enters the endpoint; its jobs run in the order queued.
        self.transfers = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
        # sent with STARTED, for REVOKE and ACK
        self._handshake = self.transfers.submit(endpoint.handshake).result()
        self._pushes: dict[RequestId, _Push] = {}
        self._in_flight: list[tuple[Write, Future[_Outcome], float]] = []  # transfer thread's
        self._sent: list[tuple[RequestId, NoticeKind, Future[None]]] = []  # notices queued
        self._polling: Future[list[Notice]] | None = None  # the transfer thread's last poll
        self._notified = False  # a notice went out since the last poll

    def __enter__(self) -> KVSender:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Run the jobs already queued (their WRITEs are posted), then join the thread."""
        self.transfers.shutdown(wait=True)

    @property
    def stats(self) -> SendStats:
        """What this sender pushed since it started; its WRITEs as each push's machine
        counts them (posted), the open pushes' included."""
        open_writes = sum(p.state.num_writes for p in self._pushes.values())
        return dataclasses.replace(self._stats, writes=self._stats.writes + open_writes)

    @property
    def num_pushes(self) -> int:
        """Requests whose KV is still being pushed (or whose CANCEL is still to go)."""
        return len(self._pushes)

    def start(self, request_id: RequestId, target: KVTarget) -> None:
        """The request was admitted to prefill: connect to the target's worker (refusing an
        incompatible one), claim its pages with STARTED and track the push."""
        peer = self.transfers.submit(self.endpoint.connect, target.handshake).result()
        state = machine.start(target.lease_s, self.clock())
        self._pushes[request_id] = _Push(peer, target, state, target.num_cached_tokens)
        started = Notice(NoticeKind.STARTED, request_id, handshake=self._handshake)
        self._notify(request_id, started)

    def stored(self, events: Sequence[KVStored]) -> None:
        """A layer of an engine step is queued: plan the WRITEs of the pushed requests' new
        pages (holding them); where a run of layers ends, post those whose mark has passed."""
        for event in events:
            push = self._pushes.get(event.request_id)
            if push is not None and push.state.status in _OPEN:
                self._plan(push, event)
        stop = events[0].layers.stop if events else 0
        if stop % self.layers_per_write == 0 or stop == self.num_layers:
            if any(p.state.status is PushStatus.CLAIMING for p in self._pushes.values()):
                self._read_notices()  # an ACK that comes mid-step lets this step's WRITEs go
            self._tick()  # renewed mid-step too: a long step is no stall
            for event in events:
                self._post_ready(event.request_id)

    def _plan(self, push: _Push, event: KVStored) -> None:
        last_layer = event.layers.stop == self.num_layers
        if self.stream_layers:
            layers = event.layers
        elif last_layer and event.num_tokens >= event.num_prompt:
            layers = range(self.num_layers)  # unstreamed: one WRITE once the prompt is computed
        else:
            return
        first, last = push.sent_upto // self.page_size, len(event.pages)
        if first < last:
            src, dst = list(event.pages[first:last]), list(push.target.pages[first:last])
            run = push.planned[-1] if push.planned else None
            if run is not None and self._extends(run, layers, src):
                # The same pages one layer on, in the same run: one WRITE takes both.
                push.planned[-1] = _Planned(
                    event.ready, range(run.layers.start, layers.stop), src, dst
                )
            else:
                self.holds.hold(src)
                push.planned.append(_Planned(event.ready, layers, src, dst))
                self._on(event.request_id, machine.Planned())
        if last_layer:
            push.sent_upto = max(push.sent_upto, event.num_tokens)

    def _extends(self, run: _Planned, layers: range, src: list[PageId]) -> bool:
        """`layers` of the pages `src` continue the planned `run` within its run of layers."""
        per = self.layers_per_write
        return (
            run.src == src
            and run.layers.stop == layers.start
            and run.layers.start // per == (layers.stop - 1) // per
        )

    def prompt_done(self, event: PromptDone) -> None:
        """DONE tells the receiver the first token and how many WRITEs to expect, once
        every planned WRITE is posted (at once unless the device lags)."""
        self._post_ready(event.request_id)
        self._on(event.request_id, machine.PromptSampled(event.first))

    def stop(self, request_id: RequestId) -> None:
        """Post nothing more for this request (abort); CANCEL follows when nothing is in flight."""
        self._on(request_id, machine.Abort())

    def poll(self) -> bool:
        """Take in what the transfer thread saw (the receivers' ACKs and REVOKEs, notices that
        failed, finished WRITEs: their pages are released), post WRITEs whose layers are
        computed, renew leases, and have the transfer thread poll the transport again; True
        while any push is open or a notice is queued or just went out (it needs another
        poll soon)."""
        self._read_notices()
        self._check_sent()
        for rid in list(self._pushes):
            self._post_ready(rid)
            self._settle(rid)
        self._tick()
        notified, self._notified = self._notified, False
        return bool(self._pushes or self._sent) or notified

    def _tick(self) -> None:
        for rid in list(self._pushes):
            self._on(rid, machine.Tick())

    def _read_notices(self) -> None:
        """The notices the transfer thread's last poll read, if it is over; then the next."""
        if self._polling is not None and not self._polling.done():
            return
        polling, self._polling = self._polling, self.transfers.submit(self._drive)
        notices = [] if polling is None else polling.result()
        for notice in notices:
            rid, kind = notice.request_id, notice.kind
            if rid not in self._pushes or kind not in (NoticeKind.ACK, NoticeKind.REVOKE):
                log.debug("%s notice for %s, which is not being pushed: dropped", kind.name, rid)
                continue
            self._on(rid, machine.Acked() if kind is NoticeKind.ACK else machine.Revoked())
            self._post_ready(rid)

    def _drive(self) -> list[Notice]:
        """On the transfer thread: see which WRITEs finished, and read the notices."""
        still = []
        for write, outcome, post_s in self._in_flight:
            try:
                finished, ok = self.endpoint.finished(write), True
            except TransferError as e:
                log.warning("%s", e)
                finished, ok = True, False
            if finished:
                outcome.set_result(_Outcome(ok, write.num_bytes, post_s))
            else:
                still.append((write, outcome, post_s))
        self._in_flight = still
        return self.endpoint.notices()

    def _check_sent(self) -> None:
        """A notice that failed makes its push's receiver unreachable (a lost CANCEL is left
        to the receiver's cap)."""
        still = []
        for rid, kind, sent in self._sent:
            if not sent.done():
                still.append((rid, kind, sent))
                continue
            self._notified = True
            error = sent.exception()
            if error is not None:
                log.warning("request %s: %s", rid, error)
                if kind is not NoticeKind.CANCEL:
                    self._on(rid, machine.Unreachable())
        self._sent = still

    def _settle(self, rid: RequestId) -> None:
        """Release the source pages of WRITEs the transfer thread saw finish or fail."""
        push = self._pushes.get(rid)
        if push is None:
            return
        still = []
        for outcome, pages in push.writes:
            if not outcome.done():
                still.append((outcome, pages))
                continue
            ok, num_bytes, post_s = outcome.result()
            self.holds.release(pages)
            if num_bytes:
                self._stats.bytes += num_bytes
                self._stats.post_s += post_s
            self._on(rid, machine.WriteDone(ok))
        push.writes = still

    def _post_ready(self, rid: RequestId) -> None:
        """Post planned WRITEs, in order, whose layers the device has computed, while the
        receiver's ACK holds. Never waits on the device."""
        push = self._pushes.get(rid)
        while (
            push is not None
            and push.planned
            and push.state.status is PushStatus.PUSHING
            and push.planned[0].ready.done()
        ):
            self._on(rid, machine.Ready())

    def _on(self, rid: RequestId, event: machine.Event) -> None:
        """Feed one event to the request's push and apply what it says to do."""
        push = self._pushes.get(rid)
        if push is None:
            return
        push.state, actions = machine.on_event(push.state, event, self.clock())
        for action in actions:
            self._apply(rid, push, action)

    def _apply(self, rid: RequestId, push: _Push, action: machine.Action) -> None:
        """Do one action (a failed WRITE or notice comes back at a later poll)."""
        match action:
            case machine.Post():
                self._post(rid, push, push.planned.pop(0))
            case machine.Drop():
                for planned in push.planned:
                    self.holds.release(planned.src)
                push.planned.clear()
            case machine.Stop(cause):
                if cause in (StopCause.REVOKED, StopCause.LAPSED):
                    self._stats.lease_misses += 1
                log.log(
                    logging.DEBUG if cause is StopCause.ABORT else logging.WARNING,
                    "request %s: push stopped (%s)",
                    rid,
                    cause.value,
                )
            case machine.SendRenew():
                self._notify(rid, Notice(NoticeKind.RENEW, rid))
            case machine.SendDone(num_writes, first):
                done = Notice(NoticeKind.DONE, rid, num_writes=num_writes, first=first)
                self._notify(rid, done)
            case machine.SendCancel():
                self._notify(rid, Notice(NoticeKind.CANCEL, rid))
            case machine.Close():
                self._stats.writes += push.state.num_writes
                del self._pushes[rid]

    def _notify(self, rid: RequestId, notice: Notice) -> None:
        """Queue the notice; one that fails comes back to `_check_sent`."""
        sent = self.transfers.submit(self.endpoint.notify, self._pushes[rid].peer, notice)
        self._sent.append((rid, notice.kind, sent))

    def _post(self, rid: RequestId, push: _Push, planned: _Planned) -> None:
        """Queue the WRITE; it holds its pages until its outcome is in (`_settle`)."""
        src, dst, layers = planned.src, planned.dst, planned.layers
        nbytes = 2 * len(src) * len(layers) * self.model_page_bytes
        notice = Notice(NoticeKind.LAYERS, rid, layers.start, layers.stop, tuple(dst), nbytes)
        outcome: Future[_Outcome] = Future()
        self.transfers.submit(self._write, push.peer, layers, src, dst, notice, outcome)
        push.writes.append((outcome, src))
        if layers.stop == self.num_layers:
            self._stats.pages += len(src)

    def _write(
        self,
        peer: Peer,
        layers: range,
        src: list[PageId],
        dst: list[PageId],
        notice: Notice,
        outcome: Future[_Outcome],
    ) -> None:
        """On the transfer thread: post the WRITE; `_drive` sees it finish."""
        started = time.perf_counter()
        try:
            write = self.endpoint.write(peer, layers, src, dst, notice)
        except Exception as e:  # TransferError, or a bug: either way its pages must come back
            log.warning("request %s: %s", notice.request_id, e, exc_info=e)
            outcome.set_result(_Outcome(False, 0, 0.0))
            return
        self._in_flight.append((write, outcome, time.perf_counter() - started))


_OPEN = (PushStatus.CLAIMING, PushStatus.PUSHING)
