"""DecodeWorker: a Ray actor that owns an engine in the decode role.

Life of a request here (the transfer's own states are cluster/transfer/inbound.py's):
1. `submit` from the prefill worker the router paired with this one (the router submits
   itself when no prefill worker takes part, or when the one it chose was lost before
   its submit landed here): unless the part of the prompt missing from this worker's
   prefix cache is at most `local_prefill_tokens` (then it prefills here, as colocated
   requests do), pages for the whole prompt are reserved before any prefill compute is
   spent, and the caller gets a KVTarget with the lease's duration, `lease_s`. No pages:
   the submit waits its turn (the machine's WAITING). TRANSFERRING (RESERVED on).
2. The prefill worker claims the pages when it admits the request (STARTED, answered
   with ACK: only then may it WRITE); the lease runs from there on this worker's own
   clock, renewed by every notice of progress (RENEW while it waits or computes, each
   WRITE's LAYERS). DONE brings the first token and the WRITE count. Once all have
   landed the request joins the running batch. RUNNING. Its deltas start after the first
   token, which the router has from the prefill worker (their first carries its text).
3. If the lease ends (or nobody claims the pages within `lease_s`), the sender cancels,
   or the caller reports the sender gone, the request is prefilled here (`recompute`)
   or fails (`fail`), per `on_timeout`; it never decodes from incomplete pages.
4. Each step's new tokens for all requests leave together, numbered, through `outputs`.
5. Finish or abort frees the pages once. A lease that ends or an abort during
   TRANSFERRING sends REVOKE and keeps the pages until no WRITE can land any more: all
   landed, the sender's CANCEL, its reported death, or `revoke_cap_s` after the REVOKE.

Where a request stands here is its transfer machine's state (waiting for pages, holding
them, aborted while holding them, or RELEASED: no transfer any more, or none ever) and,
once the engine has it, the engine's; the worker keeps no flag beside them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from functools import partial

from cluster import role_worker, worker_metrics
from cluster.config import EngineConfig, TransferConfig
from cluster.engine.engine import LLMEngine
from cluster.protocol import DecodeHandle, DecodeStats, KVEvents
from cluster.request_checks import refuse_in_flight
from cluster.transfer import inbound
from cluster.transfer.inbound import InboundStatus
from cluster.types import (
    FinishReason,
    KVTarget,
    ModelInfo,
    RequestId,
    RequestOutput,
    RequestStatus,
    Submission,
    TokenDelta,
)
from cluster.worker_loop import WorkerLoop, fail, settle
from decode_worker.outbox import Outboxes
from decode_worker.receiver import KVReceiver, Release, Transfer

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """A request here from its submit until its last delta is sent and no WRITE can land
    in its pages any more: the one place the worker keeps it (its sequence is the
    engine's). Its state is its transfer's; the rest is plain data."""

    submission: Submission  # what was asked, and whose outbox its deltas go to
    emitted: int  # output tokens sent so far (at first: those resumed)
    done: asyncio.Future[KVTarget | None]  # the submit's answer: settled once, at admission
    transfer: Transfer


class DecodeWorker:
    def __init__(self, name: str, engine: EngineConfig, transfer: TransferConfig) -> None:
        self._loop = WorkerLoop(name=f"{name}-engine")
        report = role_worker.load_reporter(name)
        self.engine = self._loop.call_blocking(lambda: LLMEngine(engine, report), None)
        self.epoch = uuid.uuid4().hex[:12]
        self.transfer = transfer
        # On the engine's thread, which drives it (and waits there for the other ranks').
        self.endpoint = self._loop.call_blocking(
            lambda: role_worker.endpoint(name, self.engine, transfer), None
        )
        terms = inbound.Terms(
            transfer.lease_s, transfer.revoke_cap_s, transfer.on_timeout == "recompute"
        )
        self.receiver = KVReceiver(self.endpoint, terms, self.engine.spec.num_layers)
        self._streams: dict[RequestId, _Stream] = {}  # in the order their submits came
        self._transfer_failures = 0
        self._outboxes = Outboxes()
        self._loop.start(self._tick)
        self.metrics_url: str | None = None  # a fixed port may be scraped before serve returns
        stats = partial(self._loop.call_blocking, self._stats, 5.0)
        self.metrics_url = worker_metrics.serve(name, self.engine.model_id, stats, engine)

    # --- actor API -----------------------------------------------------------------------

    async def submit(self, submission: Submission) -> KVTarget | None:
        """Admit a request: a leased KVTarget to prefill into elsewhere (`remote_prefill`),
        or None if it prefills here (not `remote_prefill`, a short uncached part, or
        aborted while waiting). Its deltas go to `reader`'s outbox (see `outputs`).
        `resumed`: the prompt ends with that many tokens of the request's own output (a
        migrated request, see LLMEngine.add_request); its deltas are numbered after them."""
        done: asyncio.Future[KVTarget | None] = asyncio.get_running_loop().create_future()
        s, rid = submission, submission.request_id

        def admit() -> None:
            refuse_in_flight(rid, self._streams)
            uncached = len(s.prompt_ids) - self.engine.cached_prefix_tokens(s.prompt_ids)
            local = not s.remote_prefill or uncached <= self.transfer.local_prefill_tokens
            terms = self.receiver.terms
            state = inbound.released(terms) if local else inbound.waiting(terms)
            self._streams[rid] = _Stream(s, s.resumed, done, Transfer(state))
            self._outboxes.claim(s.reader)
            try:
                if local:
                    self.engine.add_request(s.prompt_ids, s.sampling, rid, s.resumed)
                    settle(done, None)
                    return
                self._admit()
            except Exception:
                self._forget(rid)
                raise

        await self._loop.call(admit)
        return await done

    async def transfer_failed(self, request_id: RequestId, why: str) -> bool:
        """The caller knows no WRITE for this request can land any more (its sender died
        or refused): recompute or fail it now, per policy. False: the request is not
        here (never submitted, or finished)."""

        def run() -> bool:
            stream = self._streams.get(request_id)
            if stream is None or stream.transfer.state.aborted:
                return False
            self._release(self.receiver.sender_gone(request_id, stream.transfer, why))
            return True

        return await self._loop.call(run)

    async def abort(self, request_id: RequestId) -> RequestStatus | None:
        """Abort in any state; returns the state it was in (None: not here)."""
        return await self._loop.call(lambda: self._abort(request_id))

    async def evict_all(self, why: str) -> int:
        """Give up every request here (a drain past its deadline): each ends with an
        `evicted` delta saying `why`, and its router continues it on another worker. How
        many there were."""

        def run() -> int:
            rids = [r for r, stream in self._streams.items() if not stream.transfer.state.aborted]
            for rid in rids:
                self._abort(rid, why, evicted=True)
            return len(rids)

        return await self._loop.call(run)

    async def outputs(
        self, reader: str, after: int, timeout_s: float
    ) -> tuple[int, list[TokenDelta]]:
        """The deltas of requests `reader` submitted, numbered `after` and on, waiting up
        to timeout_s for one, and the number to ask from next. Asking from `after` drops
        the ones before it; a reader that went away without asking on loses nothing."""
        return await self._outboxes.read(reader, after, timeout_s)

    async def info(self) -> ModelInfo:
        return self.engine.model_info

    async def kv_events(self, epoch: str, after: int) -> KVEvents:
        """The hashes this worker's prefix cache stored and evicted since a reader's cursor
        (`epoch`, `after`), or a snapshot of all it holds (PagePool.kv_events)."""
        return await self._loop.call(lambda: self.engine.pool.kv_events(self.epoch, epoch, after))

    async def stats(self) -> DecodeStats:
        return await self._loop.call(self._stats)

    def _stats(self) -> DecodeStats:
        sched = self.engine.scheduler
        return DecodeStats(
            self.epoch,
            self.engine.num_free_pages,
            self.engine.pool.num_pages,
            self.engine.pool.page_size,
            len(sched.running),
            len(sched.waiting) + len(sched.restoring),
            sum(s.transfer.state.holding for s in self._streams.values()),
            sum(s.transfer.state.status is InboundStatus.WAITING for s in self._streams.values()),
            sum(seq.num_uncomputed for seq in (*sched.waiting, *sched.restoring)),
            self.engine.counts,
            self.receiver.pages_received,
            self.receiver.bytes_received,
            self._transfer_failures,
            self.engine.step_rate.per_token,
            self.metrics_url,
        )

    # --- the engine thread ---------------------------------------------------------------

    def _tick(self) -> float:
        self._release(self.receiver.poll({r: s.transfer for r, s in self._streams.items()}))
        self._admit()
        if not self.engine.scheduler.has_work:
            holding = any(s.transfer.state.holding for s in self._streams.values())
            return 0.001 if holding else 0.05
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("decode step failed; failing its requests")
            for rid, stream in list(self._streams.items()):
                released = stream.transfer.state.status is InboundStatus.RELEASED
                if released and self.engine.abort_request(rid, FinishReason.ERROR):
                    self._publish(self._final(rid, FinishReason.ERROR, f"engine step failed: {e}"))
            return 0.0
        self._publish(*(self._delta(out) for out in outputs))
        return 0.0

    def _admit(self) -> None:
        """Reserve pages for waiting submits, in order, while pages last."""
        waiting = [
            (r, s)
            for r, s in self._streams.items()
            if s.transfer.state.status is InboundStatus.WAITING
        ]
        for rid, stream in waiting:
            try:
                s = stream.submission
                reservation = self.engine.reserve(s.prompt_ids, s.sampling, rid, stream.emitted)
            except Exception as e:
                self._forget(rid)
                fail(stream.done, e)
                continue
            if reservation is None:
                return
            pages, num_cached = tuple(reservation.pages), reservation.num_cached_tokens
            settle(stream.done, self.receiver.expect(rid, stream.transfer, pages, num_cached))

    def _release(self, released: list[tuple[RequestId, Release]]) -> None:
        """Transfers no WRITE can land in any more: decode, recompute, fail, free or
        withdraw each."""
        for rid, release in released:
            match release:
                case inbound.StartDecode(first):
                    out = self.engine.start_decode(rid, first)
                    self._publish(self._delta(out, sent=1))
                case inbound.Recompute(why):
                    self._transfer_failures += 1
                    log.warning("request %s: %s; recomputing its prefill here", rid, why)
                    self.engine.recompute(rid)
                case inbound.Fail(why):
                    self._transfer_failures += 1
                    self.engine.abort_request(rid, FinishReason.ERROR)
                    self._publish(self._final(rid, FinishReason.ERROR, why))
                case inbound.FreePages():  # its last delta went with the abort
                    self.engine.abort_request(rid)
                    del self._streams[rid]
                case inbound.Withdraw():  # aborted while waiting for pages: none held
                    settle(self._streams.pop(rid).done, None)

    def _abort(
        self, rid: RequestId, why: str | None = None, evicted: bool = False
    ) -> RequestStatus | None:
        stream = self._streams.get(rid)
        if stream is None or stream.transfer.state.aborted:
            return None
        phase = stream.transfer.state.status
        status = (
            RequestStatus.WAITING if phase is InboundStatus.WAITING else self.engine.status(rid)
        )
        if phase is InboundStatus.RELEASED and not self.engine.abort_request(rid):
            return None
        self._publish(self._final(rid, FinishReason.ABORT, why, evicted))
        # Waiting for pages or holding them: its machine ends it now, or once no WRITE can land.
        self._release(self.receiver.abort(rid, stream.transfer))
        return status

    def _forget(self, rid: RequestId) -> None:
        """A submit refused: no delta will come."""
        self._outboxes.forget(self._streams.pop(rid).submission.reader)

    def _delta(self, out: RequestOutput, sent: int = 0) -> tuple[str, TokenDelta]:
        """The output as its reader's delta, less its first `sent` tokens (the router has
        them already: a remote prefill's first token); its text is all there, and the
        router keeps the characters it has not had."""
        rid = out.request_id
        stream = self._streams[rid]
        index = stream.emitted + sent
        if out.finished:
            del self._streams[rid]
        else:
            stream.emitted += len(out.new_token_ids)
        return stream.submission.reader, TokenDelta(
            rid,
            index,
            tuple(out.new_token_ids[sent:]),
            out.new_text,
            tuple(out.new_logprobs[sent:]),
            out.finish_reason,
            num_cached_tokens=out.num_cached_tokens,
            text_offset=out.text_offset,
            top_logprobs=tuple(out.new_top_logprobs[sent:]),
            prompt_logprobs=None if out.prompt_logprobs is None else tuple(out.prompt_logprobs),
        )

    def _final(
        self, rid: RequestId, reason: FinishReason, error: str | None, evicted: bool = False
    ) -> tuple[str, TokenDelta]:
        """Its last delta; a request still in its transfer machine stays until it releases."""
        stream = self._streams[rid]
        if stream.transfer.state.status is InboundStatus.RELEASED:
            del self._streams[rid]
        delta = TokenDelta(rid, stream.emitted, (), "", (), reason, error, evicted=evicted)
        return stream.submission.reader, delta

    def _publish(self, *deltas: tuple[str, TokenDelta]) -> None:
        self._outboxes.publish(list(deltas))


spawn = partial(role_worker.spawn, DecodeWorker, DecodeHandle)
"""Start a DecodeWorker actor: spawn(name, engine, transfer, num_cpus, num_gpus, resources)."""
