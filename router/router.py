"""The router: one prepared request in, its token stream out, placed by the policy.

Life of a request here:
1. Past `max_pending` requests in flight, or past `max_pending_per_client` of its
   client's (a key, else an address, as the front door names it), it is refused at once
   (Overloaded, naming the limit). A front door takes the request's slot (`in_flight`)
   before it tokenizes the input, so a flood of long inputs is refused there too instead
   of piling up work.
2. Its session's placement is read from Redis (a hint; Redis down means no hint).
3. The policy picks a decode worker and maybe a prefill worker from the last loads.
4. The Dispatcher runs it on them and streams its deltas; the request's Progress records
   what the client has, when it was admitted, when its first token came and when its KV
   was ready for decode.
5. If its decode worker dies or is drained past its deadline mid-stream, the request
   moves: it is routed again as its prompt plus the tokens already streamed and goes
   on from there on another decode worker (after waiting up to `migration_wait_s` for
   one), the client seeing no gap and no duplicate. Greedy and seeded requests yield
   exactly the tokens they would have. Past `max_migrations` moves, or with no decode
   worker, it ends Unavailable saying why.
6. On a normal finish the session's placement is written back (in the background),
   and the last delta goes out with usage and timing. A failed or aborted request
   raises RequestFailed instead: it never ends as if it had finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from cluster.types import FinishReason, SamplingParams, TokenDelta
from router import lifecycle
from router.dispatch import Dispatcher, Progress, WorkerLost, seeded
from router.errors import Overloaded, RequestFailed, Unavailable
from router.placement import Placement, PlacementStore
from router.policy import (
    NoWorkerError,
    PolicyConfig,
    PolicyName,
    Route,
    RouteRequest,
    SessionHint,
    route,
)
from router.request import Prepared
from router.workers import WorkerRegistry

log = logging.getLogger(__name__)


_FAILED = (FinishReason.ERROR, FinishReason.ABORT)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Timing:
    """Milliseconds; see the proto's Timing for what each one spans."""

    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    first_token_ms: float
    total_ms: float


@dataclass(frozen=True)
class Final:
    """What the last message of a stream carries besides its tokens."""

    usage: Usage
    timing: Timing
    route: Route  # the last one, after any migration
    migrations: int = 0  # times the request moved to another decode worker


class Router:
    def __init__(
        self,
        policy: PolicyConfig,
        workers: WorkerRegistry,
        placements: PlacementStore | None,
        max_pending: int,
        dispatcher: Dispatcher | None = None,
        max_migrations: int = 3,
        migration_wait_s: float = 30.0,
        max_pending_per_client: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.policy = policy
        self.workers = workers
        self.placements = placements
        self.max_pending = max_pending
        self.max_pending_per_client = max_pending_per_client
        self.clients: Counter[str] = Counter()  # requests in flight per client
        self.max_migrations = max_migrations
        self.migration_wait_s = migration_wait_s
        self.dispatcher = dispatcher or Dispatcher()
        # The seeds of sampled requests that bring none: from `seed` (vLLM's --seed) the
        # same sequence on every start, else random.
        self._seeds = random.Random(seed)
        self.pending = 0
        self._turn = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    def full(self) -> bool:
        """No `max_pending` slot is free: a new request would be refused."""
        return self.pending >= self.max_pending

    def overloaded(self) -> Overloaded:
        """The refusal of a request past `max_pending`, naming it."""
        why = f"max_pending: {self.pending} requests in flight, the router's limit"
        return Overloaded("max_pending", why)

    @contextlib.contextmanager
    def in_flight(self, client: str = "") -> Iterator[None]:
        """Hold one of the `max_pending` in-flight slots for the block, one of `client`'s
        `max_pending_per_client`; Overloaded naming the limit if there is none."""
        if self.full():
            raise self.overloaded()
        mine, most = self.clients[client], self.max_pending_per_client
        if most is not None and mine >= most:
            raise Overloaded(
                "max_pending_per_client",
                f"max_pending_per_client: {mine} requests of this client in flight, its limit",
            )
        self.pending += 1
        self.clients[client] += 1
        try:
            yield
        finally:
            self.pending -= 1
            self.clients[client] -= 1
            if not self.clients[client]:
                del self.clients[client]

    async def generate(
        self, p: Prepared, admitted: bool = False
    ) -> AsyncIterator[tuple[TokenDelta, Final | None]]:
        """The request's deltas in order; the last one comes with its Final. `admitted`:
        the caller already holds this request's `in_flight` slot."""
        with contextlib.nullcontext() if admitted else self.in_flight():
            async for item in self._generate(p, time.monotonic()):
                yield item

    async def _generate(
        self, p: Prepared, arrived: float
    ) -> AsyncIterator[tuple[TokenDelta, Final | None]]:
        """Adapter of router/lifecycle.py: routes, streams and moves the request as its
        view's actions say, turning what routing and the stream report into events. The
        request lives in two places here: its view, and its Progress (what the client
        has, and when each point passed) in the Dispatcher's stream."""
        # a moved request draws on from the same seed
        sampling = seeded(p.sampling, self._seeds.getrandbits)
        progress = Progress()
        policy = lifecycle.MovePolicy(self.max_migrations, self.migration_wait_s)
        view = lifecycle.View(policy, await self._session(p.session_id))
        actions: list[lifecycle.Action] = [lifecycle.Route()]
        while actions:
            action = actions.pop(0)
            event: lifecycle.Event | None = None
            if isinstance(action, lifecycle.Route):
                event = self._route(p, view.hint, progress)
            elif isinstance(action, lifecycle.Wait):
                await asyncio.sleep(self.workers.interval_s)
                actions.append(lifecycle.Route())
            elif isinstance(action, lifecycle.MarkDead):
                self.workers.mark_dead(action.worker, action.why)
            elif isinstance(action, lifecycle.Unavailable):
                raise Unavailable(action.why)
            elif isinstance(action, lifecycle.Fail):
                raise RequestFailed(action.reason, action.why)
            else:
                try:
                    async for delta, usage in self._attempt(
                        p, sampling, action, view.hint, progress
                    ):
                        if delta.finish_reason in _FAILED:  # the attempt's last
                            event = lifecycle.Failed(delta.finish_reason, delta.error or "aborted")
                            continue
                        view, _ = lifecycle.on_event(
                            view, lifecycle.Tokens(len(delta.token_ids)), time.monotonic()
                        )
                        if usage is None:
                            yield delta, None
                            continue
                        view, _ = lifecycle.on_event(view, lifecycle.Finished(), time.monotonic())
                        timing = _timing(progress, arrived)
                        yield delta, Final(usage, timing, action.route, view.moves)
                except WorkerLost as e:
                    log.warning(
                        "request %s: %s after %d tokens", p.request_id, e, len(progress.token_ids)
                    )
                    event = lifecycle.Lost(str(e), e.dead)
            if event is not None:
                view, more = lifecycle.on_event(view, event, time.monotonic())
                actions += more

    def _route(
        self, p: Prepared, hint: SessionHint | None, progress: Progress
    ) -> lifecycle.Routed | lifecycle.NoWorker:
        """Where the request (or what is left of it) goes, or why nowhere."""
        self._turn += 1
        done = len(progress.token_ids)
        prompt = [*p.prompt_ids, *progress.token_ids]
        aware = self.policy.name is PolicyName.CACHE_AWARE
        cached = self.workers.cached_tokens(prompt) if aware else {}
        request = RouteRequest(len(prompt), p.sampling.max_tokens - done, hint, self._turn, cached)
        snapshot = self.workers.snapshot()
        try:
            chosen = route(self.policy, snapshot, request)
        except NoWorkerError as e:
            return lifecycle.NoWorker(str(e))
        epoch = next(w.epoch for w in snapshot.decode if w.worker == chosen.decode)
        return lifecycle.Routed(chosen, epoch)

    async def _attempt(
        self,
        p: Prepared,
        sampling: SamplingParams,
        submit: lifecycle.Submit,
        hint: SessionHint | None,
        progress: Progress,
    ) -> AsyncIterator[tuple[TokenDelta, Usage | None]]:
        """The request's deltas from the workers `submit` names, resumed after its
        `resumed` tokens; the last one with its usage. The prefill worker's load counts the
        prompt until the attempt's first token."""
        chosen, resumed = submit.route, submit.resumed
        assert resumed == len(progress.token_ids), "the stream goes on from what was delivered"
        decode = self.workers.decode_handle(chosen.decode)
        prefill = None if chosen.prefill is None else self.workers.prefill_handle(chosen.prefill)
        progress.prefill_worker, progress.decode_worker = chosen.prefill, chosen.decode
        prompt_tokens = len(p.prompt_ids) + resumed
        stream = self.dispatcher.generate(
            p.prompt_ids, sampling, decode, prefill, p.request_id, progress
        )
        self.workers.routed(chosen.decode, chosen.prefill, prompt_tokens)
        try:
            async for delta in stream:
                if chosen.prefill is not None and delta.token_ids and delta.index == resumed:
                    self.workers.prefilled(chosen.prefill, prompt_tokens)
                if delta.finish_reason is None or delta.finish_reason in _FAILED:
                    yield delta, None
                    continue
                completion = len(progress.token_ids)
                if p.session_id is not None:
                    # A local prefill leaves the session's prefix where it was prefilled before.
                    prefill_worker = chosen.prefill or (hint.prefill_worker if hint else None)
                    # The last sampled token was never fed back: its KV is not there.
                    cached = len(p.prompt_ids) + completion - 1
                    placement = Placement(
                        chosen.decode, submit.epoch, prefill_worker, cached, time.time()
                    )
                    self._remember(p.session_id, placement)
                yield delta, Usage(len(p.prompt_ids), progress.num_cached_tokens, completion)
        finally:
            await stream.aclose()
            if chosen.prefill is not None and len(progress.token_ids) == resumed:
                self.workers.prefilled(chosen.prefill, prompt_tokens)
            self.workers.finished(chosen.decode)

    async def _session(self, session_id: str | None) -> SessionHint | None:
        """Where the session's KV was left, as Redis remembers it (None: no hint)."""
        if session_id is None or self.placements is None:
            return None
        placement = await self.placements.get(session_id)
        if placement is None:
            return None
        return SessionHint(
            placement.decode_worker,
            placement.decode_epoch,
            placement.prefill_worker,
            placement.cached_tokens,
        )

    def _remember(self, session_id: str, placement: Placement) -> None:
        """Write the session's placement back without holding up the reply."""
        if self.placements is None:
            return
        task = asyncio.create_task(self.placements.put(session_id, placement))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _timing(progress: Progress, arrived: float) -> Timing:
    now = time.monotonic()
    admitted = progress.admitted_at or now
    first = progress.first_token_at or now
    transfer = 0.0
    if progress.remote_prefill and progress.kv_ready_at is not None:
        transfer = max(0.0, progress.kv_ready_at - first)
    return Timing(
        queue_ms=1e3 * (admitted - arrived),
        prefill_ms=1e3 * max(0.0, first - admitted),
        transfer_ms=1e3 * transfer,
        first_token_ms=1e3 * (first - arrived),
        total_ms=1e3 * (now - arrived),
    )
