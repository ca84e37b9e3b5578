"""`splitserve plan cluster`: a discrete-event simulation of a whole cluster on a simulated
clock, running the project's own policies: the router's `route()`, the autoscaler's
`decide()`, and each worker's engine `Scheduler` and `PagePool`. Only the model's compute
is replaced, by a step cost (splitserve/step_cost.py: the hardware's roofline, or a fit
to the real engine's measured steps), and the KV transfer by bytes / link bandwidth.

The life of a request, as in the real cluster (docs/design.md, "Life of a request"):
1. It arrives; `route()` picks a decode worker and maybe a prefill worker from the
   workers' loads at that instant (the real router reads them every 100 ms and counts
   its own requests in between, which tracks the same numbers) and, under cache_aware,
   the prompt tokens each worker's page pool holds at that instant (the real router's
   prefix index learns them from KV events, up to 100 ms later).
2. Remote prefill: the decode worker `reserve`s pages for the whole prompt (FIFO, retried
   after each of its steps while it is short of pages); then the prefill worker's
   scheduler runs the prompt with max_tokens 1. Its first token is the request's first
   token. The KV not already on the decode worker then crosses the link (one transfer at
   a time per prefill worker's link); on arrival the decode worker `activate`s it.
   Local prefill (no prefill worker, or `route()` said so): the decode worker's own
   scheduler prefills it, chunked or not as configured.
3. Decode steps yield a token per running row; a request ends after its output length
   (replies run with ignore_eos); the next turn of its conversation, if any, arrives then
   with the whole conversation so far as its prompt and the session's placement as a hint.

Speed: a decode worker whose step is all decode rows, with nothing waiting, runs the same
rows until the first of them ends; those steps are simulated as one run (their times come
from `decode_run`, their pages are taken at its start) and cut short at the next step
boundary if anything reaches the worker meanwhile. The rows, tokens and pages are the
same as step by step; pages are taken a little early, so a router reading free pages
mid-run sees a few fewer.

Every tick (the autoscaler's `interval_s`, else 1 s) the decode pool's KV use is sampled.
Autoscaling (optional, per pool): every tick each phase's signals go to
`decide()`; a worker it adds is routed to `start_s` later; one it removes stops taking
requests at once and leaves when idle.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cluster.config import EngineConfig, ScalingConfig
from cluster.engine.sched.page_pool import PagePool, pages_for
from cluster.engine.sched.scheduler import Scheduler, Step
from cluster.engine.sched.sequence import Sequence
from cluster.types import BlockHash, FinishReason, RequestId, SamplingParams
from router.policy import (
    DecodeLoad,
    PolicyConfig,
    PolicyName,
    PrefillLoad,
    RouteRequest,
    SessionHint,
    Snapshot,
    route,
)
from router.prefix_index import prompt_hashes
from splitserve.autoscale import DecodeSignals, PrefillSignals, ScalerState, decide
from splitserve.serve_workload import Conversation
from splitserve.step_cost import StepCost

TICK_S = 1.0  # how often KV use is sampled when no pool autoscales
TOKEN = 0  # the id every simulated output token gets (only prefix hashes read ids)


@dataclass(frozen=True)
class Pool:
    """One phase's workers, as the simulation sees them."""

    replicas: int
    engine: EngineConfig
    num_pages: int  # KV pages per worker (from kv_cache_gb, the engine's own rule)
    cost: StepCost
    autoscale: ScalingConfig | None = None


@dataclass(frozen=True)
class Cluster:
    prefill: Pool
    decode: Pool
    policy: PolicyConfig
    kv_bytes_per_token: float
    link_gb_s: float  # prefill -> decode KV bandwidth, per prefill worker
    link_latency_s: float = 0.0001
    router_s: float = 0.001  # added to each request's first token (the router's hop)
    start_s: float = 30.0  # an added worker serves this long after the decision


@dataclass
class Request:
    conversation: int
    turn: int
    arrival: float
    prompt: list[int]
    output_len: int
    session: str
    first_token: float = np.nan
    end: float = np.nan
    tokens: int = 0
    last_token: float = 0.0
    cached_tokens: int = 0
    decode: str = ""
    prefill: str | None = None
    seq: Sequence | None = None  # the decode worker's


@dataclass
class Result:
    requests: list[Request]
    itl: np.ndarray  # every inter-token gap, seconds
    itl_weight: np.ndarray  # how many tokens had that gap
    transfer_bytes: int
    ticks: list[tuple[float, int, int, float]]  # (time, prefill workers, decode workers, kv use)
    preemptions: int

    def latencies(self) -> dict[str, np.ndarray]:
        done = [r for r in self.requests if not np.isnan(r.end)]
        ttft = np.array([r.first_token - r.arrival for r in done])
        e2e = np.array([r.end - r.arrival for r in done])
        n = np.array([r.output_len for r in done])
        tpot = (e2e - ttft)[n > 1] / (n[n > 1] - 1)
        return {"ttft": ttft, "tpot": tpot, "e2e": e2e}


def weighted_percentile(values: np.ndarray, weights: np.ndarray, p: float) -> float:
    """The p-th percentile (0..100) of values repeated `weights` times, interpolated
    between closest ranks as numpy's default does for the repeated array."""
    order = np.argsort(values)
    v, w = values[order], weights[order]
    ends = np.cumsum(w)  # the last rank (1-based) each value covers
    rank = p / 100 * (ends[-1] - 1)
    lo = int(np.searchsorted(ends, np.floor(rank) + 1))
    hi = int(np.searchsorted(ends, min(np.floor(rank) + 2, ends[-1])))
    return float(v[lo] + (v[hi] - v[lo]) * (rank - np.floor(rank)))


@dataclass
class _Run:
    """The step or steps a worker is running: `ends` are their end times."""

    step: Step
    ends: np.ndarray


@dataclass
class _Worker:
    name: str
    phase: str  # "prefill" or "decode"
    pool: Pool
    pages: PagePool
    sched: Scheduler
    run: _Run | None = None
    version: int = 0  # bumps when the pending step-end event changes
    inbound: deque[Request] = field(default_factory=deque)  # decode: waiting for pages
    queued_tokens: int = 0  # prefill: prompt tokens not computed yet
    link_free: float = 0.0  # prefill: when its link is free
    cordoned: bool = False

    @classmethod
    def new(cls, name: str, phase: str, pool: Pool) -> _Worker:
        e = pool.engine
        pages = PagePool(pool.num_pages, e.page_size, e.prefix_caching)
        return cls(
            name,
            phase,
            pool,
            pages,
            Scheduler[Sequence](pages, e.max_num_seqs, e.max_num_batched_tokens, e.chunked_prefill),
        )

    @property
    def idle(self) -> bool:
        s = self.sched
        return self.run is None and not (s.running or s.waiting or s.transferring or self.inbound)


class Simulation:
    def __init__(
        self,
        cluster: Cluster,
        conversations: Seq[Conversation],
        arrivals: Seq[float],
    ) -> None:
        self.c = cluster
        self.conversations = conversations
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._names = itertools.count()
        self.prefill: dict[str, _Worker] = {}
        self.decode: dict[str, _Worker] = {}
        for _ in range(cluster.prefill.replicas):
            self._add("prefill")
        for _ in range(cluster.decode.replicas):
            self._add("decode")
        self.requests: list[Request] = []
        self._live: dict[RequestId, Request] = {}  # by the id both workers' sequences carry
        self._hints: dict[str, SessionHint] = {}
        self._turn = 0
        self._itl: list[np.ndarray] = []
        self._itl_weight: list[np.ndarray] = []
        self._transfer_bytes = 0
        self._ticks: list[tuple[float, int, int, float]] = []
        self._scalers = {"prefill": ScalerState(), "decode": ScalerState()}
        self._finished_since_tick: list[Request] = []
        self._starting = {"prefill": 0, "decode": 0}
        for i, t in enumerate(arrivals):
            self._push(t, self._arrive, i, 0, [])

    # --- the event loop ---------------------------------------------------------------------

    def run(self) -> Result:
        self._push(0.0, self._tick)
        while self._events:
            now, _, handler, args = heapq.heappop(self._events)
            if handler == self._tick and not self._events:
                break  # nothing else will ever happen
            handler(now, *args)
        w = np.concatenate(self._itl_weight) if self._itl_weight else np.zeros(0)
        return Result(
            self.requests,
            np.concatenate(self._itl) if self._itl else np.zeros(0),
            w,
            self._transfer_bytes,
            self._ticks,
            sum(w.sched.num_preemptions for w in [*self.prefill.values(), *self.decode.values()]),
        )

    def _push(self, t: float, handler: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._order), handler, args))

    # --- the router -------------------------------------------------------------------------

    def _arrive(self, now: float, conv: int, turn: int, history: list[int]) -> None:
        c = self.conversations[conv]
        spec = c.turns[turn]
        r = Request(conv, turn, now, [*history, *spec.user], spec.output_len, c.session_id)
        self.requests.append(r)
        hint = self._hints.get(r.session) if r.session else None
        snapshot = Snapshot(
            tuple(
                DecodeLoad(
                    w.name,
                    "0",
                    w.pages.num_free,
                    w.pages.num_pages,
                    w.pages.page_size,
                    len(w.sched.running),
                    len(w.sched.waiting) + len(w.sched.transferring) + len(w.inbound),
                )
                for w in self.decode.values()
                if not w.cordoned
            ),
            tuple(
                PrefillLoad(w.name, "0", w.queued_tokens)
                for w in self.prefill.values()
                if not w.cordoned
            ),
        )
        cached = self._cached(r.prompt) if self.c.policy.name is PolicyName.CACHE_AWARE else {}
        request = RouteRequest(len(r.prompt), r.output_len, hint, self._turn, cached)
        chosen = route(self.c.policy, snapshot, request)
        self._turn += 1
        r.decode, r.prefill = chosen.decode, chosen.prefill
        d = self.decode[chosen.decode]
        r.seq = Sequence(
            RequestId(str(len(self.requests))),
            list(r.prompt),
            len(r.prompt),
            SamplingParams(max_tokens=r.output_len, ignore_eos=True),
        )
        self._live[r.seq.request_id] = r
        if r.prefill is None:
            d.sched.add(r.seq)
            self._poke(d, now)
        else:
            d.inbound.append(r)
            self._admit_inbound(d, now)

    def _cached(self, prompt: list[int]) -> dict[int, frozenset[str]]:
        """As the router's prefix index answers: prompt tokens held -> the live workers
        holding that many."""
        held: dict[int, set[str]] = {}
        chains: dict[int, list[BlockHash]] = {}  # by page size
        for w in [*self.decode.values(), *self.prefill.values()]:
            ps = w.pages.page_size
            chain = chains.get(ps) or chains.setdefault(ps, prompt_hashes(prompt, ps))
            if not w.cordoned and (n := w.pages.count_prefix(chain) * ps):
                held.setdefault(n, set()).add(w.name)
        return {n: frozenset(ws) for n, ws in held.items()}

    def _admit_inbound(self, d: _Worker, now: float) -> None:
        """Reserve decode pages for remote prefills, in order, while they fit."""
        while d.inbound:
            r = d.inbound[0]
            assert r.seq is not None and r.prefill is not None
            if not d.sched.reserve(r.seq):
                return
            d.inbound.popleft()
            r.cached_tokens = r.seq.num_computed
            p = self.prefill[r.prefill]
            pseq = Sequence(
                r.seq.request_id,
                list(r.prompt),
                len(r.prompt),
                SamplingParams(max_tokens=1, ignore_eos=True),
            )
            p.sched.add(pseq)
            p.queued_tokens += len(r.prompt)
            self._poke(p, now)

    def _first_token(self, r: Request, now: float) -> None:
        r.first_token = now + self.c.router_s
        r.last_token = now
        r.tokens = 1

    def _finish(self, d: _Worker, r: Request, now: float) -> None:
        """r's last token came out of decode worker d at `now`."""
        assert r.seq is not None
        d.sched.finish(r.seq, FinishReason.LENGTH)
        del self._live[r.seq.request_id]
        r.end = now + self.c.router_s
        if r.prefill is None:
            r.cached_tokens = r.seq.num_cached
        self._finished_since_tick.append(r)
        if r.session:
            self._hints[r.session] = SessionHint(
                r.decode, "0", r.prefill, len(r.prompt) + r.output_len
            )
        conv = self.conversations[r.conversation]
        if r.turn + 1 < len(conv.turns):
            history = [*r.prompt, *([TOKEN] * r.output_len)]
            self._push(r.end, self._arrive, r.conversation, r.turn + 1, history)

    # --- workers ----------------------------------------------------------------------------

    def _poke(self, w: _Worker, now: float) -> None:
        """Something new reached w: start a step if idle, or end a multi-step run at the
        step now in progress so the next step sees it."""
        if w.run is None:
            self._start(w, now)
            return
        ends = w.run.ends
        cut = int(np.searchsorted(ends, now, side="right")) + 1
        if cut < len(ends):
            w.run.ends = ends[:cut]
            w.version += 1
            self._push(float(ends[cut - 1]), self._step_end, w, w.version)

    def _start(self, w: _Worker, now: float) -> None:
        step = w.sched.schedule()
        if step.empty:
            w.run = None
            return
        cost = w.pool.cost
        rows = step.decodes
        prompts = step.prefills or any(s.num_computed < s.num_prompt for s in rows)
        if rows and not prompts and not w.sched.waiting:
            k = self._run_length(w, rows)
            contexts = sum(s.num_computed + 1 for s in rows)
            durations = cost.decode_run(len(rows), contexts, k)
        else:
            contexts_list = [s.num_computed + 1 for s in rows]
            chunks = [(n, s.num_computed) for s, n in step.prefills]
            durations = np.array([cost.seconds(contexts_list, chunks)])
        w.run = _Run(step, now + np.cumsum(durations))
        w.version += 1
        self._push(float(w.run.ends[-1]), self._step_end, w, w.version)

    def _run_length(self, w: _Worker, rows: list[Sequence]) -> int:
        """Steps until the first row ends, or fewer if their pages would not fit; the
        pages for them are taken now (step 1's already are)."""
        k = min(s.sampling.max_tokens - (len(s.token_ids) - s.num_prompt) for s in rows)
        ps = w.pages.page_size

        def need(k: int) -> int:
            return sum(max(pages_for(s.num_computed + k, ps) - len(s.pages), 0) for s in rows)

        lo, hi = 1, k
        while lo < hi:  # the longest run whose pages are free
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid) <= w.pages.num_free else (lo, mid - 1)
        for s in rows:
            extra = pages_for(s.num_computed + lo, ps) - len(s.pages)
            if extra > 0:
                fresh = w.pages.allocate(extra)
                assert fresh is not None
                s.pages.extend(fresh)
        return lo

    def _step_end(self, now: float, w: _Worker, version: int) -> None:
        if version != w.version or w.run is None:
            return  # superseded by a cut
        step, ends = w.run.step, w.run.ends
        w.run = None
        # A prompt's last chunk of one token is scheduled as a decode row.
        last = [(s, 1) for s in step.decodes if s.num_computed < s.num_prompt]
        self._decoded(w, [s for s in step.decodes if s.num_computed >= s.num_prompt], ends)
        for seq, n in [*step.prefills, *last]:  # a run of several steps has none
            w.sched.commit(seq, n)
            w.queued_tokens -= n
            if seq.num_computed == len(seq.token_ids):  # the prompt is done: a token
                self._prompt_done(w, seq, now)
        if w.phase == "decode":
            self._admit_inbound(w, now)
        if w.cordoned and w.idle:
            self._workers(w.phase).pop(w.name)
            return
        self._start(w, now)

    def _decoded(self, w: _Worker, rows: list[Sequence], ends: np.ndarray) -> None:
        """Each row made one token per step of the run."""
        k = len(ends)
        if not rows:
            return
        if k > 1:
            self._itl.append(np.diff(ends))
            self._itl_weight.append(np.full(k - 1, len(rows)))
        first = np.empty(len(rows))
        for i, seq in enumerate(rows):
            r = self._live[seq.request_id]
            seq.token_ids.extend([TOKEN] * k)
            w.sched.commit(seq, k)
            first[i] = ends[0] - r.last_token
            r.last_token = float(ends[-1])
            r.tokens += k
            if r.tokens >= r.output_len:
                self._finish(w, r, float(ends[-1]))
        self._itl.append(first)
        self._itl_weight.append(np.ones(len(rows), dtype=np.int64))

    def _prompt_done(self, w: _Worker, seq: Sequence, now: float) -> None:
        r = self._live[seq.request_id]
        seq.token_ids.append(TOKEN)
        self._first_token(r, now)
        if w.phase == "decode":  # local prefill: decode goes on here
            if r.output_len == 1:
                self._finish(w, r, now)
            return
        w.sched.finish(seq, FinishReason.LENGTH)
        assert r.seq is not None
        size = round((r.seq.num_prompt - r.seq.num_computed) * self.c.kv_bytes_per_token)
        start = max(now, w.link_free)
        w.link_free = start + size / (self.c.link_gb_s * 1e9)
        self._transfer_bytes += size
        self._push(w.link_free + self.c.link_latency_s, self._landed, r)

    def _landed(self, now: float, r: Request) -> None:
        assert r.seq is not None
        d = self.decode[r.decode]
        d.sched.activate(r.seq)
        r.seq.token_ids.append(TOKEN)
        if r.output_len == 1:
            self._finish(d, r, now)
            return
        self._poke(d, now)

    # --- autoscaling ------------------------------------------------------------------------

    def _workers(self, phase: str) -> dict[str, _Worker]:
        return self.prefill if phase == "prefill" else self.decode

    def _add(self, phase: str) -> None:
        pool = self.c.prefill if phase == "prefill" else self.c.decode
        name = f"{phase}-{next(self._names)}"
        self._workers(phase)[name] = _Worker.new(name, phase, pool)

    def _ready(self, now: float, phase: str) -> None:
        self._starting[phase] -= 1
        self._add(phase)

    def _tick(self, now: float) -> None:
        decode = [w for w in self.decode.values() if not w.cordoned]
        prefill = [w for w in self.prefill.values() if not w.cordoned]
        usage = [1 - w.pages.num_free / w.pages.num_pages for w in decode]
        self._ticks.append((now, len(prefill), len(decode), float(np.mean(usage))))
        done, self._finished_since_tick = self._finished_since_tick, []
        ttft = [r.first_token - r.arrival for r in done]
        tpot = [(r.end - r.first_token) / (r.output_len - 1) for r in done if r.output_len > 1]
        for phase, pool, workers in (
            ("prefill", self.c.prefill, prefill),
            ("decode", self.c.decode, decode),
        ):
            if pool.autoscale is None:
                continue
            n = len(workers) + self._starting[phase]
            signals: PrefillSignals | DecodeSignals
            if phase == "prefill":
                signals = PrefillSignals(
                    n,
                    sum(w.queued_tokens for w in workers),
                    float(np.percentile(ttft, 90)) if ttft else None,
                )
            else:
                signals = DecodeSignals(
                    n,
                    float(np.mean(usage)),
                    sum(len(w.sched.waiting) + len(w.inbound) for w in workers),
                    float(np.percentile(tpot, 90)) if tpot else None,
                )
            decision = decide(pool.autoscale, signals, self._scalers[phase], now)
            self._scalers[phase] = decision.state
            for _ in range(decision.replicas - n):
                self._starting[phase] += 1
                self._push(now + self.c.start_s, self._ready, phase)
            if decision.replicas < n and workers:
                victim = workers[-1]
                victim.cordoned = True
                if victim.idle:
                    self._workers(phase).pop(victim.name)
        scaling = self.c.decode.autoscale or self.c.prefill.autoscale
        self._push(now + (scaling.interval_s if scaling else TICK_S), self._tick)
