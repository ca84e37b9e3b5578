"""The Python API the router and the benchmarks call: run a request on the workers chosen
for it, stream its tokens back, abort it.

1. `generate` makes one call per request: with a prefill worker chosen, to it, naming
   the decode worker; the prefill worker submits the request there itself (the decode
   worker reserves pages, or keeps a short uncached prompt to prefill itself) and
   prefills into the reserved pages; its first token comes back as the call's result
   and is streamed at once, before the KV has landed. Without one, to the decode worker
   (colocated).
2. The decode worker's per-step batches carry the rest. One task per decode worker
   long-polls those batches and hands them out DELIVER_SLICE streams per turn of the
   event loop. Its deltas start after the first token: one that arrives before the
   prefill worker's reply waits for it, and if the call ends without one (the prefill
   worker died after sending its KV), the stream is lost (WorkerLost, the worker not
   dead) and the router moves the request.
3. A request the decode worker refuses (a field, the context) fails with its error,
   through either call.
4. A prefill worker that dies or cannot be reached: if the request never reached the
   decode worker, it is submitted there to prefill itself; if it did, the decode worker
   hears that no WRITE can land (a dead worker; an unreachable one is left to its lease)
   and recomputes or fails the request per its policy.
5. The stream ends with a delta that has a finish reason; leaving the stream early
   aborts the request on both workers. If the decode worker dies or gives the request
   up (drained), the stream raises WorkerLost instead: the caller may continue the
   request on other workers from what it delivered (its `Progress`), and the continued
   stream picks up after the last token and character the caller got.

The workers know each accepted request by an id of its own, the caller's id plus a
random suffix, never by the caller's id alone: a client may reuse its id the moment
it cancels, and the first use's late abort and ABORT delta must not reach the second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.protocol import DecodeHandle, PrefillHandle
from cluster.request_checks import refuse_in_flight
from cluster.types import (
    FirstToken,
    InFlightError,
    RequestId,
    SamplingParams,
    Submission,
    TokenDelta,
)
from router import attempt

log = logging.getLogger(__name__)

# A decode step's deltas wake this many streams per turn of the event loop, so that a
# new request (its admission, or its refusal) waits behind a slice of a step's token
# delivery, not behind all of it (hundreds of streams' framing and writes).
DELIVER_SLICE = 4


@dataclass
class Progress:
    """What one request's stream has done so far, over all its attempts: what it handed
    its caller, and when it passed each point (time.monotonic()). Filled in by `generate`."""

    token_ids: list[int] = field(default_factory=list)  # delivered to the caller
    chars: int = 0  # characters of output text delivered
    admitted_at: float | None = None  # the decode worker took it (pages reserved)
    first_token_at: float | None = None  # the first token reached the caller
    kv_ready_at: float | None = None  # the decode worker began decoding it
    num_cached_tokens: int = 0  # prompt tokens the prefilling worker's cache held
    # A prefill worker computed the prompt: its own time, from its engine's admission to
    # the first token (None: the decode worker prefilled it).
    prefill_s: float | None = None
    prefill_worker: str | None = None  # the workers of the attempt under way, by name
    decode_worker: str | None = None

    @property
    def remote_prefill(self) -> bool:
        return self.prefill_s is not None

    @property
    def stage(self) -> str:
        """Where the request is: admitting (no decode worker has taken it yet), prefilling
        (taken, no token yet: its prompt is computed, or its KV moved) or decoding. With a
        prefill worker the router hears of the reservation with the first token: until
        then it reads admitting."""
        if self.first_token_at is not None:
            return "decoding"
        return "admitting" if self.admitted_at is None else "prefilling"


class WorkerLost(Exception):
    """The decode worker running the request died (`dead`) or gave it up (drained)."""

    def __init__(self, why: str, dead: bool) -> None:
        super().__init__(why)
        self.dead = dead


@dataclass
class _Stream:
    """One attempt of a request: the one place the Dispatcher keeps it; where the attempt
    is, its machine's state (router/attempt.py)."""

    rid: RequestId  # the id the workers know it by
    # A str: the decode worker is gone, and why. An error: the request was refused. None:
    # the prefill worker's call has ended.
    queue: asyncio.Queue[TokenDelta | str | Exception | None]
    decode: DecodeHandle
    prefill: PrefillHandle | None
    progress: Progress
    # What the workers are asked to run (the prompt ends with `resumed` tokens delivered).
    prompt_ids: list[int]
    sampling: SamplingParams
    resumed: int
    state: attempt.Attempt = field(init=False)

    def __post_init__(self) -> None:
        self.state = attempt.start(prefill=self.prefill is not None)

    def step(self, event: attempt.Event) -> list[attempt.Action]:
        """The machine's actions on `event`; the ones that end the stream raise here:
        WorkerLost, or the worker's refusal."""
        self.state, actions = attempt.on_event(self.state, event)
        for action in actions:
            if isinstance(action, attempt.Lose):
                raise WorkerLost(action.why, action.dead) from None
            if isinstance(action, attempt.Raise):
                raise action.error
        return actions


@dataclass(frozen=True)
class InFlight:
    """A request in flight as the lab's live view shows it (router/lab.py)."""

    request_id: str
    stage: str  # Progress.stage
    prefill_worker: str | None
    decode_worker: str | None
    tokens: int  # delivered to the caller so far


class Dispatcher:
    """Used from one asyncio event loop. Each Dispatcher reads its own requests' deltas
    from each decode worker (its outbox there), so several routers can share workers."""

    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        self._streams: dict[RequestId, _Stream] = {}  # by the caller's id
        self._pollers: dict[DecodeHandle, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.reader = uuid.uuid4().hex  # this Dispatcher's outbox on each decode worker

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        decode: DecodeHandle,
        prefill: PrefillHandle | None = None,
        request_id: RequestId | None = None,
        progress: Progress | None = None,
    ) -> AsyncGenerator[TokenDelta, None]:
        """Deltas of one request in order; the last one has a finish reason. `progress`,
        if given, is filled in as the request passes each point and its deltas go out.
        Deltas carry `request_id` (a random one when not given); the workers know the
        request by `worker_id`.

        With tokens already in `progress`, the request continues after them (a
        migration): the workers get them as the prompt's end, the stream's first delta
        follows them. A sampled request must then keep its seed."""
        caller = request_id or RequestId(uuid.uuid4().hex)
        refuse_in_flight(caller, self._streams)
        rid = RequestId(f"{caller}.{uuid.uuid4().hex[:12]}")
        sampling = seeded(sampling)
        done = progress or Progress()
        resumed = len(done.token_ids)
        assert resumed < sampling.max_tokens, "a request that has all its tokens is finished"
        prompt = prompt_ids + done.token_ids
        sampling = dataclasses.replace(sampling, max_tokens=sampling.max_tokens - resumed)
        if sampling.prompt_logprobs is not None:
            # Computed where the prompt is: the decode worker prefills it itself. A resumed
            # request delivered them with its first token.
            prefill = None
            if resumed:
                sampling = dataclasses.replace(sampling, prompt_logprobs=None)
        stream = _Stream(rid, asyncio.Queue(), decode, prefill, done, prompt, sampling, resumed)
        self._streams[caller] = stream
        self._poll(decode)
        try:
            if prefill is None:
                try:
                    await decode.submit.remote(self._submission(stream, remote_prefill=False))
                except RayActorError as e:
                    stream.step(attempt.SubmitDied(f"decode worker failed: {e}"))  # raises
                except Exception as e:
                    stream.step(attempt.Refused(e))  # raises it again
                done.admitted_at = done.admitted_at or time.monotonic()
            else:
                self._spawn(self._prefill(stream))
            while stream.state.phase is not attempt.Phase.ENDED:
                delta = _unseen(await self._next(stream), caller, done)
                if delta is None:
                    continue
                if done.first_token_at is None and delta.token_ids:
                    done.first_token_at = time.monotonic()
                yield delta
        finally:
            del self._streams[caller]
            if attempt.Abort() in stream.step(attempt.Closed()):
                self._spawn(self._abort(stream))

    async def _next(self, stream: _Stream) -> TokenDelta:
        """The stream's next delta in order (the decode worker's wait for the prefill
        worker's first token); WorkerLost or the refusal's error instead."""
        delivered = len(stream.progress.token_ids)
        (action,) = stream.step(attempt.Next(delivered))
        while isinstance(action, attempt.Take):
            (action,) = stream.step(_event(await stream.queue.get(), delivered))
        assert isinstance(action, attempt.Deliver)
        return action.delta

    def in_flight(self) -> list[InFlight]:
        """This Dispatcher's requests in flight, where each is and what it has delivered."""
        return [
            InFlight(
                caller,
                s.progress.stage,
                s.progress.prefill_worker,
                s.progress.decode_worker,
                len(s.progress.token_ids),
            )
            for caller, s in self._streams.items()
        ]

    async def close(self) -> None:
        """Stop reading from the decode workers (after the last stream has ended)."""
        tasks = [*self._pollers.values(), *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def worker_id(self, request_id: RequestId) -> RequestId | None:
        """The id the workers know the caller's request in flight by (None: not in flight)."""
        stream = self._streams.get(request_id)
        return None if stream is None else stream.rid

    async def abort(self, request_id: RequestId) -> None:
        """Stop the caller's request in flight on its workers; its stream ends with an
        ABORT delta."""
        stream = self._streams.get(request_id)
        if stream is not None:
            await self._abort(stream)

    def prefill_died(self, prefill: PrefillHandle, why: str) -> None:
        """Ray says `prefill` is dead: tell the decode worker of each request whose KV it
        may still have been pushing (its first token may have come back long before) that
        no WRITE can land, so it recomputes now instead of waiting out the lease."""
        for stream in self._streams.values():
            if stream.prefill != prefill:
                continue
            if attempt.TransferFailed() in stream.step(attempt.PrefillDied()):
                self._spawn(self._transfer_failed(stream.rid, stream.decode, why))

    async def _transfer_failed(self, rid: RequestId, decode: DecodeHandle, why: str) -> None:
        with contextlib.suppress(RayActorError):  # if gone too, its reader ends the stream
            await decode.transfer_failed.remote(rid, why)

    async def _abort(self, stream: _Stream) -> None:
        """Abort on both workers, the decode worker first: it revokes the transfer and
        keeps its pages until the prefill worker's CANCEL (had the prefill worker's abort
        come first, its CANCEL would make the decode worker start a recompute). One that
        is gone has nothing left to abort."""
        for worker in (stream.decode, stream.prefill):
            if worker is not None:
                try:
                    await worker.abort.remote(stream.rid)
                except RayActorError as e:
                    log.debug("request %s: abort on a dead worker: %s", stream.rid, e)

    async def _prefill(self, stream: _Stream) -> None:
        """The request's one call: its prefill worker submits it to its decode worker and
        prefills it; the first token goes on the stream, then None (the call has ended)."""
        try:
            await self._first_token(stream)
        finally:
            stream.queue.put_nowait(None)

    async def _first_token(self, stream: _Stream) -> None:
        assert stream.prefill is not None
        rid, asked, resumed, done = stream.rid, time.monotonic(), stream.resumed, stream.progress
        try:
            first: FirstToken | None = await stream.prefill.prefill.remote(
                self._submission(stream, remote_prefill=True), stream.decode
            )
        except RayActorError as e:
            await self._prefill_lost(stream, e)
            return
        except Exception as e:  # refused by the decode worker
            stream.queue.put_nowait(e)
            return
        if done.admitted_at is None:
            done.admitted_at = time.monotonic() if first is None else asked + first.waited_s
        if first is not None:
            if not resumed:
                done.num_cached_tokens = first.num_cached_tokens
                done.prefill_s = first.computed_s
            token = first.token
            lps = () if token.logprob is None else (token.logprob,)
            # With stop strings the prefill worker's text could end in a stop string's
            # start, which it cannot hold back (its part ends here): the decode worker's
            # deltas carry the text instead.
            text = "" if stream.sampling.stop else first.text
            tops = (token.top_logprobs,) if token.top_logprobs else ()
            delta = TokenDelta(rid, resumed, (token.token_id,), text, lps, top_logprobs=tops)
            stream.queue.put_nowait(dataclasses.replace(delta, text_offset=first.text_offset))

    async def _prefill_lost(self, stream: _Stream, error: RayActorError) -> None:
        """The prefill worker died or cannot be reached: the decode worker prefills the
        request itself if it never got it; if it did, it hears that no WRITE can land (a
        dead prefill worker; an unreachable one, maybe alive, is left to the lease)."""
        rid, why = stream.rid, f"prefill worker failed: {error}"
        log.warning("request %s: %s", rid, why)
        try:
            await stream.decode.submit.remote(self._submission(stream, remote_prefill=False))
            return
        except RayActorError:  # gone too: its reader ends the stream
            return
        except InFlightError:  # the prefill worker's submit reached it
            pass
        except Exception as e:
            stream.queue.put_nowait(e)
            return
        if not isinstance(error, ActorUnavailableError):
            await self._transfer_failed(rid, stream.decode, why)

    def _submission(self, stream: _Stream, remote_prefill: bool) -> Submission:
        """The attempt's message to a worker: `remote_prefill` to a prefill worker."""
        return Submission(
            request_id=stream.rid,
            prompt_ids=stream.prompt_ids,
            sampling=stream.sampling,
            remote_prefill=remote_prefill,
            reader=self.reader,
            resumed=stream.resumed,
        )

    def _poll(self, decode: DecodeHandle) -> None:
        # Ray's handles to one actor are equal (and hash alike): one reader per worker.
        if decode not in self._pollers or self._pollers[decode].done():
            self._pollers[decode] = asyncio.create_task(self._read(decode))

    async def _read(self, decode: DecodeHandle) -> None:
        """Hand each request its deltas from one decode worker, batch by batch."""
        cursor = 0
        while True:
            try:
                cursor, deltas = await decode.outputs.remote(self.reader, cursor, self.poll_s)
            except Exception as e:  # the worker is gone: its requests' streams end
                lost = [(r, s) for r, s in self._streams.items() if s.decode == decode]
                # None lost: it was drained and removed, nothing to report.
                log.log(logging.ERROR if lost else logging.DEBUG, "decode worker gone: %s", e)
                for _, stream in lost:
                    stream.queue.put_nowait(f"decode worker failed: {e}")
                return
            for i, delta in enumerate(deltas):
                if i and i % DELIVER_SLICE == 0:
                    await asyncio.sleep(0)  # the front doors get the loop between slices
                to = self._streams.get(_caller(delta.request_id))
                if to is None or to.rid != delta.request_id:  # an earlier use of the id's
                    continue
                began = attempt.Decoding() in to.step(attempt.Arrived())  # the attempt's first
                if began and to.progress.kv_ready_at is None:  # the request's first
                    to.progress.kv_ready_at = time.monotonic()
                    if not to.progress.remote_prefill:
                        to.progress.num_cached_tokens = delta.num_cached_tokens
                to.queue.put_nowait(delta)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def seeded(
    sampling: SamplingParams, bits: Callable[[int], int] = random.getrandbits
) -> SamplingParams:
    """A sampled request with a seed (`bits(63)` if it has none): every worker that
    takes part in it, in any attempt, must draw alike."""
    if sampling.greedy or sampling.seed is not None:
        return sampling
    return dataclasses.replace(sampling, seed=bits(63))


def _event(got: TokenDelta | str | Exception | None, delivered: int) -> attempt.Event:
    """The stream's machine's event for an item off its queue."""
    if got is None:  # the prefill worker's call ended, its first token queued
        return attempt.CallEnded()
    if isinstance(got, str):
        return attempt.DecodeGone(got)
    if isinstance(got, Exception):
        return attempt.Refused(got)
    return attempt.Got(got, delivered)


def _caller(rid: RequestId) -> RequestId:
    """The caller's id within the workers' (`generate` appends a dot and a suffix)."""
    return RequestId(rid.rpartition(".")[0])


def _unseen(delta: TokenDelta, caller: RequestId, done: Progress) -> TokenDelta | None:
    """The part of a worker's delta the caller has not had, under the caller's id, with
    `done` updated; None when nothing is new. Tokens and text may come twice: the first
    token from both workers, a continued request's text again from its new worker."""
    skip = max(0, len(done.token_ids) - delta.index)
    cut = max(0, done.chars - delta.text_offset)
    if skip >= len(delta.token_ids) and cut >= len(delta.text) and delta.finish_reason is None:
        return None
    fresh = dataclasses.replace(
        delta,
        request_id=caller,
        index=delta.index + skip,
        token_ids=delta.token_ids[skip:],
        logprobs=delta.logprobs[skip:],
        top_logprobs=delta.top_logprobs[skip:],
        text=delta.text[cut:],
        text_offset=delta.text_offset + cut,
    )
    done.token_ids.extend(fresh.token_ids)
    done.chars = max(done.chars, delta.text_offset + len(delta.text))
    return fresh
