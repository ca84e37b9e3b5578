"""The decode worker's side of KV transfers: the adapter between the pure receiving state
machine (cluster/transfer/inbound.py, which owns the protocol) and the NIXL endpoint.

It turns the senders' notices, ticks, aborts and the router's reports into events,
answers senders itself (ACK, REVOKE, over the endpoint, to the handshake each sender's
STARTED carries), and hands back each transfer's one release (decode, recompute, fail,
free, withdraw) for the worker to apply to its engine. Only the engine touches the pages.
It keeps no request: each request's `Transfer` (its machine's state from submit to end)
is held by its record in the worker, which passes them in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cluster.transfer import inbound as machine
from cluster.transfer.endpoint import KVEndpoint, Peer, TransferError
from cluster.transfer.inbound import RELEASES, Terms
from cluster.transfer.wire import Notice, NoticeKind
from cluster.types import KVTarget, PageId, RequestId

log = logging.getLogger(__name__)

Release = (
    machine.StartDecode | machine.Recompute | machine.Fail | machine.FreePages | machine.Withdraw
)

_EVENTS: dict[NoticeKind, machine.Event] = {
    NoticeKind.STARTED: machine.Started(),
    NoticeKind.RENEW: machine.Renew(),
    NoticeKind.LAYERS: machine.Layers(),
    NoticeKind.CANCEL: machine.Cancel(),
}


@dataclass
class Transfer:
    """One request's inbound transfer: waiting for pages, held, or RELEASED (over, or none:
    the request prefills here)."""

    state: machine.Inbound
    pages: frozenset[PageId] = frozenset()  # the reservation, for checking each LAYERS notice
    sender: Peer | None = None  # known from its STARTED


class KVReceiver:
    """Not thread-safe: the decode worker's engine thread drives it."""

    def __init__(
        self,
        endpoint: KVEndpoint,
        terms: Terms,
        num_layers: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: this worker's own monotonic clock; leases are durations on it."""
        self.endpoint = endpoint
        self.terms = terms
        self.num_layers = num_layers
        self.clock = clock
        self.pages_received = self.bytes_received = 0
        self._handshake = endpoint.handshake()

    def expect(
        self, rid: RequestId, transfer: Transfer, pages: tuple[PageId, ...], num_cached: int
    ) -> KVTarget:
        """Pages were reserved for rid, which waited for them: the KVTarget a prefill
        worker claims them with."""
        transfer.pages = frozenset(pages)
        released = self._on(rid, transfer, machine.Reserved())
        assert not released and transfer.state.holding, (rid, transfer.state)
        return KVTarget(self._handshake, pages, num_cached, self.terms.lease_s)

    def poll(self, transfers: Mapping[RequestId, Transfer]) -> list[tuple[RequestId, Release]]:
        """Read the senders' notices and check every lease: the transfers released."""
        released: list[tuple[RequestId, Release]] = []
        for notice in self.endpoint.notices():
            released += self._on_notice(notice, transfers.get(notice.request_id))
        for rid, transfer in transfers.items():
            released += self._on(rid, transfer, machine.Tick())
        return released

    def abort(self, rid: RequestId, transfer: Transfer) -> list[tuple[RequestId, Release]]:
        """The request was aborted; its pages wait until no WRITE can land."""
        return self._on(rid, transfer, machine.Abort())

    def sender_gone(
        self, rid: RequestId, transfer: Transfer, why: str
    ) -> list[tuple[RequestId, Release]]:
        """The caller knows no WRITE for rid can land any more (its sender died or refused)."""
        return self._on(rid, transfer, machine.SenderGone(why))

    def _on_notice(
        self, notice: Notice, transfer: Transfer | None
    ) -> list[tuple[RequestId, Release]]:
        rid, kind = notice.request_id, notice.kind
        if transfer is None:  # released (or never reserved here): the machine's RELEASED
            transfer = Transfer(machine.released(self.terms))
        if kind is NoticeKind.STARTED:
            transfer.sender = self._connect(notice)
            if transfer.sender is None:
                return []
        if kind is NoticeKind.LAYERS:
            if not transfer.pages.issuperset(notice.pages):
                log.error("request %s: a peer wrote pages outside its reservation", rid)
            elif notice.layer_end == self.num_layers:
                self.pages_received += len(notice.pages)
            self.bytes_received += notice.num_bytes
        event = _EVENTS.get(kind)
        if kind is NoticeKind.DONE:
            if notice.first is None:
                log.warning("request %s: a DONE notice without its first token: dropped", rid)
                return []
            event = machine.Done(notice.num_writes, notice.first)
        if event is None:
            log.warning("request %s: a sender sent %s, a receiver's notice: dropped", rid, kind)
            return []
        return self._on(rid, transfer, event)

    def _on(
        self, rid: RequestId, transfer: Transfer, event: machine.Event
    ) -> list[tuple[RequestId, Release]]:
        """Feed one event to rid's transfer and apply what the machine says: answer the
        sender, hand the pages on (once: a released transfer is RELEASED for good)."""
        transfer.state, actions = machine.on_event(transfer.state, event, self.clock())
        released: list[tuple[RequestId, Release]] = []
        for action in actions:
            if isinstance(action, RELEASES):
                released.append((rid, action))
            else:  # Ack or Revoke: the machine answers only a transfer that was STARTED
                assert transfer.sender is not None, (rid, action)
                kind = NoticeKind.ACK if isinstance(action, machine.Ack) else NoticeKind.REVOKE
                self._notify(transfer.sender, Notice(kind, rid))
        return released

    def _connect(self, notice: Notice) -> Peer | None:
        try:
            return self.endpoint.connect(notice.handshake)
        except Exception as e:  # a bad handshake, another model, or NIXL's own errors
            rid = notice.request_id
            log.warning("request %s: a STARTED from a sender we cannot answer: %s", rid, e)
            return None

    def _notify(self, peer: Peer, notice: Notice) -> None:
        try:
            self.endpoint.notify(peer, notice)
        except TransferError as e:  # an ACK lost: the sender lapses; a REVOKE: the cap
            log.warning("request %s: %s", notice.request_id, e)
