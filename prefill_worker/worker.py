"""PrefillWorker: a Ray actor that owns an engine in the prefill role.

Life of a request here (the push's own states are cluster/transfer/push.py's):
1. `prefill` arrives naming the decode worker the router paired with this one: the
   worker submits the request there itself, which reserves pages for the whole prompt
   before any compute is spent here (or keeps a short uncached prompt to prefill itself:
   then nothing more happens here). With the KVTarget back (the reserved pages, and the
   lease as a duration) it connects to that decode worker, claims the pages with STARTED,
   which starts the lease there, and queues the prompt in its engine with max_tokens 1.
   WAITING; RENEW notices keep the lease while the request waits. A decode worker this
   worker cannot serve (incompatible, unreachable over UCX) hears so at once and
   recomputes or fails the request, per its policy.
2. The engine batches prompts under its token budget, long ones in chunks, reusing
   cached prefix pages. PREFILLING. The sender is the engine's KV sink: once the decode
   worker's ACK is in, after each layer it WRITEs the layer's new pages into the
   reserved pages (all layers at once when streaming is off); each WRITE renews the
   lease.
3. The last chunk samples the first token: `prefill` returns it to the router at once
   (the one copy of it the router gets), and a DONE notice tells the decode worker how
   many WRITEs to expect. TRANSFERRING.
4. Each WRITE holds its source pages in the engine until it completes; then they stay
   in the prefix cache. An abort, the decode worker's REVOKE (its lease ended there), or
   a stall of this worker for a whole lease stops the push: nothing more is posted, and
   CANCEL goes out once no WRITE is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from functools import partial

from ray.exceptions import RayActorError

from cluster import role_worker, worker_metrics
from cluster.config import EngineConfig, TransferConfig
from cluster.engine.engine import LLMEngine
from cluster.protocol import DecodeHandle, KVEvents, PrefillHandle, PrefillStats
from cluster.request_checks import refuse_in_flight
from cluster.types import (
    FirstToken,
    ModelInfo,
    RequestId,
    RequestStatus,
    Submission,
)
from cluster.worker_loop import WorkerLoop, settle
from prefill_worker.sender import KVSender

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Request:
    """A request here from its `prefill` call to its first token: the one place the worker
    keeps it (the push's state is the sender's, the sequence the engine's). Added and
    removed by `prefill` on the actor's event loop; the engine thread reads it and clears
    `waiting` once it has settled it."""

    aborted: bool = False  # while its submit to the decode worker was out
    # From the decode worker's target to the first token (the engine thread then clears
    # it): the future `prefill` returns.
    waiting: asyncio.Future[FirstToken | None] | None = None
    held: int = 0  # prompt tokens the target already holds
    waited_s: float = 0.0  # for the decode worker's reservation
    admitted_at: float = 0.0  # queued in the engine (time.monotonic(), the engine thread's)


class PrefillWorker:
    def __init__(self, name: str, engine: EngineConfig, transfer: TransferConfig) -> None:
        self._loop = WorkerLoop(name=f"{name}-engine")
        report = role_worker.load_reporter(name)
        self.engine = self._loop.call_blocking(lambda: LLMEngine(engine, report), None)
        self.epoch = uuid.uuid4().hex[:12]
        # On the engine's thread, which drives it (and waits there for the other ranks').
        self.endpoint = self._loop.call_blocking(
            lambda: role_worker.endpoint(name, self.engine, transfer), None
        )
        self.sender = KVSender(
            self.endpoint,
            self.engine.holds,
            engine.page_size,
            self.engine.spec.num_layers,
            transfer.stream_layers,
        )
        self._requests: dict[RequestId, _Request] = {}
        self._recomputed_tokens = 0
        self._loop.start(self._tick)
        self.metrics_url: str | None = None  # a fixed port may be scraped before serve returns
        stats = partial(self._loop.call_blocking, self._stats, 5.0)
        self.metrics_url = worker_metrics.serve(name, self.engine.model_id, stats, engine)

    async def prefill(self, submission: Submission, decode: DecodeHandle) -> FirstToken | None:
        """Submit the request to `decode` as it is (its deltas go to its reader's outbox
        there, see DecodeWorker.submit), then prefill the prompt into the pages reserved
        there. The first token; None if the decode worker prefills the request itself (not
        `remote_prefill`, a short uncached part, or this worker could not serve it), is
        gone (its reader ends the request's stream), or the request was aborted. A request
        the decode worker refuses raises its error here. `resumed`: the prompt ends with
        that many tokens of the request's own output (a migrated request, see
        LLMEngine.add_request)."""
        refuse_in_flight(submission.request_id, self._requests)
        request = self._requests[submission.request_id] = _Request()
        try:
            return await self._prefill(submission, request, decode)
        finally:
            del self._requests[submission.request_id]

    async def _prefill(
        self, submission: Submission, request: _Request, decode: DecodeHandle
    ) -> FirstToken | None:
        asked, request_id, sampling = time.monotonic(), submission.request_id, submission.sampling
        try:
            target = await decode.submit.remote(submission)
        except RayActorError as e:
            log.warning("request %s: decode worker gone: %s", request_id, e)
            return None
        if request.aborted:  # while it was being submitted: it ends there too
            with contextlib.suppress(RayActorError):
                await decode.abort.remote(request_id)
            return None
        if target is None:
            return None
        done: asyncio.Future[FirstToken | None] = asyncio.get_running_loop().create_future()
        request.waiting, request.held = done, target.num_cached_tokens
        request.waited_s = time.monotonic() - asked

        def admit() -> None:
            self.sender.start(request_id, target)
            try:
                one = dataclasses.replace(sampling, max_tokens=1)
                self.engine.add_request(submission.prompt_ids, one, request_id, submission.resumed)
            except Exception:
                self.sender.stop(request_id)
                raise
            request.admitted_at = time.monotonic()

        try:
            await self._loop.call(admit)
        except Exception as e:  # no WRITE will come: the decode worker's policy decides now
            log.warning("request %s: refused the decode worker's target: %s", request_id, e)
            with contextlib.suppress(RayActorError):
                await decode.transfer_failed.remote(request_id, f"prefill worker refused: {e}")
            return None
        return await done

    async def abort(self, request_id: RequestId) -> None:
        """Stop the request in any state; one still waiting for its reservation has it
        aborted on the decode worker once it comes back."""
        request = self._requests.get(request_id)
        if request is not None:
            request.aborted = True
        await self._loop.call(lambda: self._abort(request_id))

    async def abort_all(self) -> int:
        """Stop every prefill and push here (each decode worker hears CANCEL and recomputes
        or fails the request, per its on_timeout); how many there were. Pushes past their
        first token just finish; one still waiting for its reservation is aborted there
        once it comes back."""
        count = len(self._requests)
        for request in self._requests.values():
            request.aborted = True
        await self._loop.call(self._abort_waiting)
        return count

    def _abort_waiting(self) -> None:
        """Abort every request between its target and its first token."""
        for rid, request in list(self._requests.items()):
            if request.waiting is not None:
                self._abort(rid)

    def _abort(self, request_id: RequestId) -> None:
        self.engine.abort_request(request_id)
        self.sender.stop(request_id)
        self._settle(request_id, None)

    async def status(self, request_id: RequestId) -> RequestStatus | None:
        """The request's state in this worker's engine (None: not in it)."""
        return await self._loop.call(lambda: self.engine.status(request_id))

    async def info(self) -> ModelInfo:
        return self.engine.model_info

    async def kv_events(self, epoch: str, after: int) -> KVEvents:
        """The hashes this worker's prefix cache stored and evicted since a reader's cursor
        (`epoch`, `after`), or a snapshot of all it holds (PagePool.kv_events)."""
        return await self._loop.call(lambda: self.engine.pool.kv_events(self.epoch, epoch, after))

    async def stats(self) -> PrefillStats:
        return await self._loop.call(self._stats)

    def _stats(self) -> PrefillStats:
        sched = self.engine.scheduler
        queued = [*sched.waiting, *sched.running]
        return PrefillStats(
            self.epoch,
            self.engine.num_free_pages,
            self.engine.pool.num_pages,
            self.engine.pool.page_size,
            len(queued),
            len(sched.running),
            sum(seq.num_uncomputed for seq in queued),
            self.sender.num_pushes,
            self.sender.stats,
            self._recomputed_tokens,
            self.engine.counts,
            self.engine.step_rate.per_token,
            self.metrics_url,
        )

    def _tick(self) -> float:
        busy = self.engine.has_unfinished()
        if busy:
            try:
                outputs = self.engine.step(self.sender)  # DONE goes out from within
            except Exception:
                log.exception("prefill step failed; failing its requests")
                self._abort_waiting()
                outputs = []
            for out in outputs:
                if out.finished:
                    request = self._requests.get(out.request_id) or _Request()
                    self._recomputed_tokens += max(request.held - out.num_cached_tokens, 0)
                    first = FirstToken(
                        out.first,
                        out.new_text,
                        out.num_cached_tokens,
                        out.text_offset,
                        request.waited_s,
                        time.monotonic() - request.admitted_at if request.admitted_at else 0.0,
                    )
                    self._settle(out.request_id, first)
        pending = self.sender.poll()
        if busy:
            return 0.0
        return 0.001 if pending else 0.05

    def _settle(self, request_id: RequestId, result: FirstToken | None) -> None:
        request = self._requests.get(request_id)
        if request is not None and request.waiting is not None:
            settle(request.waiting, result)
            request.waiting = None


spawn = partial(role_worker.spawn, PrefillWorker, PrefillHandle)
"""Start a PrefillWorker actor: spawn(name, engine, transfer, num_cpus, num_gpus, resources)."""
