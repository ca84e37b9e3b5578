"""Pushes prompt KV from the prefill engine's pages into a decode worker's reserved pages.

One push per request. With streaming, every engine step WRITEs each layer's new pages
as soon as that layer is computed, so the transfer hides behind the rest of the
prefill; without it, one WRITE per request carries all layers once its prompt is done.
A layer's WRITE is planned when the engine has queued the layer (marked by a
LayerReady) and posted once the device has passed that mark, polled here: the compute
stream never waits for the network. Each planned WRITE holds a reference on its source
pages until it completes or is dropped. After the last WRITE is posted, a DONE notice
carries the first token and the WRITE count; a push that stops early (abort, lease end,
transport error) sends CANCEL once nothing is in flight.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from cluster.engine.page_pool import PagePool, pages_for
from cluster.engine.scheduler import Step
from cluster.protocol import SendStats
from cluster.transfer.endpoint import KVEndpoint, Peer, TransferError, Write
from cluster.transfer.layer_ready import LayerReady
from cluster.transfer.wire import Notice, NoticeKind
from cluster.types import KVTarget, PageId, RequestId

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Planned:
    """A WRITE worked out when its layers were queued, to post once they are computed."""

    ready: LayerReady
    layers: range
    src: list[PageId]  # retained until the WRITE completes or is dropped
    dst: list[PageId]


@dataclass
class _Push:
    peer: Peer
    target: KVTarget
    sent_upto: int  # leading prompt tokens whose KV (all layers) is planned
    planned: list[_Planned] = field(default_factory=list)  # in stream order
    writes: list[tuple[Write, list[PageId]]] = field(default_factory=list)
    num_writes: int = 0
    first: tuple[int, float] | None = None  # the first token, for DONE once all is posted
    stopped: bool = False  # no further WRITE; CANCEL once the in-flight ones finish
    done: bool = False  # DONE sent


class KVSender:
    def __init__(
        self,
        endpoint: KVEndpoint,
        pool: PagePool,
        num_layers: int,
        stream_layers: bool,
        write_margin_s: float,
        device: torch.device,
    ) -> None:
        self.endpoint = endpoint
        self.pool = pool
        self.num_layers = num_layers
        self.stream_layers = stream_layers
        self.write_margin_s = write_margin_s
        self.device = device  # where the engine computes the KV
        self.stats = SendStats()
        self._pushes: dict[RequestId, _Push] = {}
        self._notified = False  # a notice went out since the last poll

    @property
    def num_pushes(self) -> int:
        """Requests whose KV is still being pushed (or whose CANCEL is still to go)."""
        return len(self._pushes)

    def start(self, request_id: RequestId, target: KVTarget) -> None:
        """Connect to the target's worker (refusing an incompatible one) and track the push."""
        peer = self.endpoint.connect(target.handshake)
        self._pushes[request_id] = _Push(peer, target, target.num_cached_tokens)

    def on_layer(self, step: Step, layer: int) -> None:
        """Engine hook: layer `layer` of `step` is queued; plan its WRITEs, post the ready."""
        if not self.stream_layers and layer != self.num_layers - 1:
            return
        layers = range(layer, layer + 1) if self.stream_layers else range(self.num_layers)
        ready = LayerReady(self.device)
        ps = self.pool.page_size
        for seq, n in [*step.prefills, *((s, 1) for s in step.decodes)]:
            push = self._pushes.get(seq.request_id)
            if push is None or push.stopped:
                continue
            end = seq.num_computed + n
            if not self.stream_layers and end < seq.num_prompt:
                continue  # unstreamed: one WRITE once the whole prompt is computed
            first, last = push.sent_upto // ps, pages_for(end, ps)
            if first < last:
                src, dst = seq.pages[first:last], list(push.target.pages[first:last])
                self.pool.retain(src)
                push.planned.append(_Planned(ready, layers, src, dst))
            if layer == self.num_layers - 1:
                push.sent_upto = max(push.sent_upto, end)
            self._post_ready(seq.request_id, push)

    def first_token(self, request_id: RequestId, token: int, logprob: float) -> None:
        """The prompt is done: DONE tells the receiver the token and how many WRITEs to
        expect, once every planned WRITE is posted (at once unless the device lags)."""
        push = self._pushes.get(request_id)
        if push is None or push.stopped:
            return
        push.first = (token, logprob)
        self._post_ready(request_id, push)
        self._send_done(request_id, push)

    def stop(self, request_id: RequestId) -> None:
        """Post nothing more for this request (abort); CANCEL follows when nothing is in flight."""
        push = self._pushes.get(request_id)
        if push is not None and not push.done:
            push.stopped = True

    def poll(self) -> bool:
        """Drive the transport, post WRITEs whose layers are computed, and settle finished
        ones (releasing their pages); True while any push is open or a notice just went
        out (it needs another progress call soon)."""
        self.endpoint.progress()
        for rid, push in list(self._pushes.items()):
            self._post_ready(rid, push)
            self._send_done(rid, push)
            still = []
            for write, pages in push.writes:
                try:
                    finished = self.endpoint.finished(write)
                except TransferError as e:
                    log.warning("request %s: %s", rid, e)
                    push.stopped, finished = not push.done, True
                if finished:
                    self.pool.free(pages)
                else:
                    still.append((write, pages))
            push.writes = still
            if push.writes or push.planned:
                continue
            if push.stopped:
                try:
                    self.endpoint.notify(push.peer, Notice(NoticeKind.CANCEL, rid))
                    self._notified = True
                except TransferError as e:  # the receiver's lease covers a lost CANCEL
                    log.warning("request %s: %s", rid, e)
                del self._pushes[rid]
            elif push.done:
                del self._pushes[rid]
        notified, self._notified = self._notified, False
        return bool(self._pushes) or notified

    def _post_ready(self, rid: RequestId, push: _Push) -> None:
        """Post planned WRITEs, in order, whose layers the device has computed; a stopped
        push drops its planned WRITEs instead. Never waits on the device."""
        while push.planned and (push.stopped or push.planned[0].ready.done()):
            planned = push.planned.pop(0)
            if push.stopped:
                self.pool.free(planned.src)
            else:
                self._post(rid, push, planned)

    def _send_done(self, rid: RequestId, push: _Push) -> None:
        if push.first is None or push.planned or push.stopped or push.done:
            return
        token, logprob = push.first
        notice = Notice(
            NoticeKind.DONE,
            rid,
            num_writes=push.num_writes,
            first_token=token,
            first_logprob=logprob,
        )
        try:
            self.endpoint.notify(push.peer, notice)
        except TransferError as e:
            log.warning("request %s: %s", rid, e)
            push.stopped = True
            return
        push.done = self._notified = True

    def _post(self, rid: RequestId, push: _Push, planned: _Planned) -> None:
        src, dst, layers = planned.src, planned.dst, planned.layers
        if time.time() > push.target.lease_expires_at - self.write_margin_s:
            log.warning("request %s: lease over, KV not sent", rid)
            self.pool.free(src)
            self.stats.lease_misses += 1
            push.stopped = True
            return
        nbytes = 2 * len(src) * len(layers) * self.endpoint.page_bytes
        notice = Notice(NoticeKind.LAYERS, rid, layers.start, layers.stop, tuple(dst), nbytes)
        started = time.perf_counter()
        try:
            write = self.endpoint.write(push.peer, layers, src, dst, notice)
        except TransferError as e:
            self.pool.free(src)
            log.warning("request %s: %s", rid, e)
            push.stopped = True
            return
        self.stats.post_s += time.perf_counter() - started
        push.writes.append((write, src))
        push.num_writes += 1
        self.stats.writes += 1
        if layers.stop == self.num_layers:
            self.stats.pages += len(src)
        self.stats.bytes += write.num_bytes
