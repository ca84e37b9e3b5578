"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Life of a request here:
1. `add`: WAITING at the back of the queue.
2. `schedule` admits it when a slot, budget and pages allow: cached prefix pages are
   matched first, fresh pages cover the rest of this step's chunk. PREFILLING.
3. Later steps give it further chunks; once every prompt token's KV is computed it
   decodes one token per step. RUNNING.
4. If pages run out, the newest running request is preempted: its pages are freed
   and it goes back to the front of the queue to be recomputed. WAITING.
5. `finish` (done, stopped or aborted) frees its pages at once, exactly once.

With a KV tier behind the pool (page_pool.py, tier_index.py), admission that finds the
prefix's next pages in the tier, after those in the pool, takes fresh pages for them and
holds the request RESTORING outside the queue, running nothing for it this step; the
step's `restores` say what to copy back into which pages. The copies run beside the steps
(cluster/engine/kv_tier.py); `restored` then counts the pages that came back whole as
computed (recomputing from the first that did not) and the request prefills the rest
from its next step, as if its prefix had been in the pool.

The scheduler is where a request lives in its engine: `requests` holds each one from
`add` (or a successful `reserve`) to `finish`, the queues say where it is.

A request whose prompt KV another worker computes skips 1-3: `reserve` takes pages for
its whole prompt (cached prefix first) and holds it TRANSFERRING outside the queues
(its status is the one record of that: `transferring` is derived from it);
`activate` makes it RUNNING once the KV has landed, `requeue` sends it to the front of
the queue to be prefilled here when the KV will not come.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cluster.engine.sched.page_pool import PagePool, pages_for
from cluster.engine.sched.sequence import Sequence
from cluster.engine.sched.tier_index import TierEntry
from cluster.types import BlockHash, FinishReason, PageId, RequestId, RequestStatus

S = TypeVar("S", bound=Sequence)  # the engine's request record: a Sequence and more


@dataclass
class Step:
    """What one model step runs: (sequence, number of new tokens), decodes first."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)  # copies to start now

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


@dataclass(frozen=True)
class Restore:
    """Copy the tier's `entries` back into `pages` (in order) for `seq`, which is RESTORING."""

    seq: Sequence
    pages: list[PageId]
    entries: list[TierEntry]


class Scheduler(Generic[S]):
    def __init__(
        self,
        pool: PagePool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
    ) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.requests: dict[RequestId, S] = {}  # every request in flight, by id
        self.waiting: deque[S] = deque()
        self.running: list[S] = []
        self.restoring: list[S] = []
        self.num_preemptions = 0

    @property
    def transferring(self) -> list[S]:
        """Requests whose prompt KV another worker writes into their reserved pages."""
        return [s for s in self.requests.values() if s.status is RequestStatus.TRANSFERRING]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.restoring)

    def cached_prefix(self, seq: Sequence) -> int:
        """Prompt tokens of seq whose KV is in the prefix cache now (the last token never is)."""
        ps = self.pool.page_size
        return self.pool.count_prefix(seq.page_hashes((seq.num_prompt - 1) // ps, ps)) * ps

    def reserve(self, seq: S) -> bool:
        """Pages for seq's whole prompt, cached prefix first; False (nothing held) if short."""
        if len(self.running) + len(self.transferring) >= self.max_num_seqs:
            return False
        ps = self.pool.page_size
        hashes = seq.page_hashes((seq.num_prompt - 1) // ps, ps)
        cached = self.pool.match_prefix(hashes)
        fresh = self.pool.allocate(pages_for(seq.num_prompt, ps) - len(cached))
        if fresh is None:
            self.pool.free(cached)
            return False
        self.pool.count_lookup(len(hashes), len(cached))
        seq.pages = cached + fresh
        seq.num_computed = seq.num_cached = len(cached) * ps
        seq.num_registered = len(cached)
        seq.status = RequestStatus.TRANSFERRING
        self.requests[seq.request_id] = seq
        return True

    def activate(self, seq: S) -> None:
        """seq's prompt KV is all in its pages: it decodes from the next step."""
        assert seq.status is RequestStatus.TRANSFERRING, seq.status
        self.commit(seq, seq.num_prompt - seq.num_computed)
        self.running.append(seq)

    def requeue(self, seq: S) -> None:
        """seq's KV will not arrive: free its reserved pages and prefill it here, first."""
        assert seq.status is RequestStatus.TRANSFERRING, seq.status
        self.pool.free(seq.pages)
        seq.pages = []
        seq.num_computed = seq.num_registered = 0
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)

    def add(self, seq: S) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> Step:
        step = Step()
        budget = self.token_budget
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is RequestStatus.WAITING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed, budget)
            if not self._grow(seq, n, step):
                continue  # seq itself was preempted
            budget -= n
            self._add_to_step(step, seq, n)
        if not step.preempted:
            budget = self._admit(step, budget)
        return step

    def _admit(self, step: Step, budget: int) -> int:
        while self.waiting and len(self.running) + len(self.restoring) < self.max_num_seqs:
            if budget == 0:
                break
            seq = self.waiting[0]
            ps = self.pool.page_size
            # The prompt's logprobs are computed, never taken from the cache.
            cacheable = seq.sampling.prompt_logprobs is None
            hashes = seq.page_hashes((len(seq.token_ids) - 1) // ps, ps) if cacheable else []
            cached = self.pool.match_prefix(hashes)
            tier = self.pool.tier
            tiered = [] if tier is None else tier.take(hashes[len(cached) :])
            if tiered:
                if not self._restore(seq, hashes, cached, tiered, step):
                    break
                continue
            need = len(seq.token_ids) - len(cached) * ps
            whole_step = budget == self.token_budget  # an unchunked prompt may overrun alone
            if not self.chunked_prefill and need > budget and not whole_step:
                self.pool.free(cached)
                break
            n = need if not self.chunked_prefill else min(need, budget)
            fresh = self.pool.allocate(pages_for(len(cached) * ps + n, ps) - len(cached))
            if fresh is None:
                self.pool.free(cached)
                break
            self._take_waiting(seq, hashes, cached, fresh, 0)
            seq.status = RequestStatus.PREFILLING
            self.running.append(seq)
            self._add_to_step(step, seq, n)
            budget = max(0, budget - n)
        return budget

    def _restore(
        self,
        seq: S,
        hashes: list[BlockHash],
        cached: list[PageId],
        tiered: list[TierEntry],
        step: Step,
    ) -> bool:
        """Admit seq to have `tiered` copied back into fresh pages; False (nothing held) if
        the pages are short."""
        fresh = self.pool.allocate(len(tiered))
        if fresh is None:
            self.pool.free(cached)
            return False
        self._take_waiting(seq, hashes, cached, fresh, len(tiered))
        seq.status = RequestStatus.RESTORING
        self.restoring.append(seq)
        step.restores.append(Restore(seq, fresh, tiered))
        return True

    def _take_waiting(
        self,
        seq: S,
        hashes: list[BlockHash],
        cached: list[PageId],
        fresh: list[PageId],
        num_tiered: int,
    ) -> None:
        """seq leaves the queue holding `cached` (computed) and `fresh` pages."""
        ps = self.pool.page_size
        self.waiting.popleft()
        self.pool.count_lookup(len(hashes), len(cached))
        if self.pool.tier is not None:
            self.pool.tier.count_lookup((len(hashes) - len(cached)) * ps, num_tiered * ps)
        seq.pages = cached + fresh
        seq.num_computed = len(cached) * ps
        seq.num_registered = len(cached)
        if seq.num_preemptions == 0:  # first admission, not a recompute
            seq.num_cached = seq.num_computed

    def restored(self, seq: S, num_pages: int) -> None:
        """The first `num_pages` pages of seq's restore came back whole (the rest are
        recomputed): it prefills from after them. Nothing if seq ended meanwhile."""
        if seq not in self.restoring:
            return
        self.restoring.remove(seq)
        seq.status = RequestStatus.PREFILLING
        self.commit(seq, num_pages * self.pool.page_size)
        if seq.num_preemptions == 0:
            seq.num_cached = seq.num_computed
        self.running.append(seq)

    def _grow(self, seq: S, n: int, step: Step) -> bool:
        """Give seq pages for n more tokens, preempting the newest others; False if seq itself."""
        need = pages_for(seq.num_computed + n, self.pool.page_size) - len(seq.pages)
        while need > 0:
            fresh = self.pool.allocate(need)
            if fresh is not None:
                seq.pages.extend(fresh)
                return True
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: S, step: Step) -> None:
        self.num_preemptions += 1
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.pool.free(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)
        step.preempted.append(seq)
        if seq in step.decodes:
            step.decodes.remove(seq)
        step.prefills = [(s, n) for s, n in step.prefills if s is not seq]

    @staticmethod
    def _add_to_step(step: Step, seq: Sequence, n: int) -> None:
        if n == 1:
            step.decodes.append(seq)  # one query token: attends like a decode
        else:
            step.prefills.append((seq, n))

    def commit(self, seq: Sequence, n: int) -> None:
        """n more tokens of seq now have KV in its pages; record newly full pages."""
        seq.num_computed += n
        ps = self.pool.page_size
        full = seq.num_computed // ps
        if full > seq.num_registered:
            hashes = seq.page_hashes(full, ps)
            for i in range(seq.num_registered, full):
                self.pool.register(seq.pages[i], hashes[i])
            seq.num_registered = full
        if seq.num_computed >= seq.num_prompt:
            seq.status = RequestStatus.RUNNING

    def finish(self, seq: S, reason: FinishReason) -> None:
        """End seq: free its pages once, whatever state it is in."""
        del self.requests[seq.request_id]
        for queue in (self.running, self.waiting, self.restoring):
            if seq in queue:
                queue.remove(seq)
        self.pool.free(seq.pages)
        seq.pages = []
        seq.finish_reason = reason
        seq.status = (
            RequestStatus.ABORTED
            if reason is FinishReason.ABORT
            else (RequestStatus.FAILED if reason is FinishReason.ERROR else RequestStatus.FINISHED)
        )
