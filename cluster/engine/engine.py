"""The engine: add requests, step, abort, read per-step outputs; `generate` on top.

One step: the scheduler picks a batch, the runner computes logits, the sampler
picks tokens, and each request's text, stop conditions and pages are settled. A KV
sink given to `step` hears where each layer's KV went and when a prompt is done, and
holds pages through `holds` (cluster/engine/kv_sink.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cluster.config import ConfigError, EngineConfig
from cluster.engine.build import (
    describe_modes,
    kv_pages,
    load_model,
    pick_device,
    pick_dtype,
    pick_quantization,
)
from cluster.engine.kernels.attention import resolve_backend
from cluster.engine.kernels.kv_cache import KVCache, KVLayout, kv_dtype
from cluster.engine.kv_sink import KVSink, PageHolds, PromptDone, layer_hook
from cluster.engine.kv_tier import KVTier
from cluster.engine.memory import device_memory
from cluster.engine.model.checkpoint import ModelSpec, Progress, read_sampling_defaults
from cluster.engine.model.model_files import model_name, model_path
from cluster.engine.model.tokenizer import TextStream, Tokenizer
from cluster.engine.output import Request, append, record_prompt_logprobs
from cluster.engine.runner import build_runner, prompt_rows, workspace_bytes
from cluster.engine.sampler import History, adjust, sample, skip_draws, top_logprobs
from cluster.engine.sched.page_pool import PagePool
from cluster.engine.sched.scheduler import Scheduler
from cluster.engine.sched.sequence import Sequence
from cluster.engine.sched.step_rate import StepRate
from cluster.protocol import EngineCounts
from cluster.request_checks import refuse_in_flight, refuse_long_prompt, refuse_past_context
from cluster.types import (
    Completion,
    FinishReason,
    InvalidRequestError,
    ModelInfo,
    PageId,
    PromptLogprob,
    RequestId,
    RequestOutput,
    RequestStatus,
    SampledToken,
    SamplingParams,
    TopLogprobs,
)

if TYPE_CHECKING:  # xgrammar loads only for structured output, torch.distributed for TP
    from cluster.engine.grammar import Grammars
    from cluster.engine.model.tensor_parallel import Rank, Ranks, TensorGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reservation:
    """Pages held for a request whose prompt KV is written from elsewhere (page table order)."""

    pages: list[PageId]
    num_cached_tokens: int  # the prefix already here; the writer fills the pages after it


class LLMEngine:
    def __init__(
        self, config: EngineConfig, progress: Progress | None = None, rank: Rank | None = None
    ) -> None:
        """`progress` hears of each checkpoint tensor read while the weights load.

        With `tensor_parallel_size` > 1 this engine is rank 0 of its model's ranks: it
        starts the others (Ray actors on this node, tensor_parallel.Ranks) and drives them
        step by step; `rank` is given to those others, which `follow` it."""
        self.config = config
        self.ranks: Ranks | None = None  # rank 0's hold on the others
        if config.cpu_cores is not None:  # threads started from here on inherit it
            os.sched_setaffinity(0, config.cpu_cores)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        path = model_path(config.model, config.revision, config.download_dir, config.download)
        self.model_id = model_name(config.model, path)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.quantization = pick_quantization(config.quantization, path, self.device)
        dtype = getattr(torch, self.dtype)
        kv = kv_dtype(config.kv_cache_dtype, dtype)
        started = time.perf_counter()
        memory = device_memory(self.device)  # before the weights: what other processes left
        split = None
        if config.tensor_parallel_size > 1:
            from cluster.engine.model.tensor_parallel import join

            def split(spec: ModelSpec) -> TensorGroup:
                group, self.ranks = join(
                    config, spec, self.quantization, self.device, rank, LLMEngine
                )
                return group

        self.spec, self.model = load_model(
            path, self.quantization, dtype, self.device, progress, split
        )
        group = self.model.group
        self.tokenizer = Tokenizer.load(path)
        self.sampling_defaults = read_sampling_defaults(path, config.generation_config)
        spec = self.spec
        self.max_model_len = min(config.max_model_len or spec.max_position, spec.max_position)
        self.layout = KVLayout.of(self.model.spec, config.page_size, kv)  # its heads
        backend = resolve_backend(
            config.attention_backend,
            self.device,
            self.dtype,
            config.kv_cache_dtype,
            plain=not spec.sandwich_norms,
        )
        workspace = workspace_bytes(
            self.model.spec,
            dtype.itemsize,
            backend,
            self.device,
            config.max_num_seqs,
            config.max_num_batched_tokens,
        )
        num_pages = kv_pages(
            config, self.layout, self.device, memory, self.model.weight_bytes, workspace, group
        )
        if num_pages * config.page_size < self.max_model_len:
            # One request must fit the whole cache (vLLM refuses to start here instead).
            log.warning(
                "context capped to %d tokens, what the KV cache holds (the model's: %d); "
                "raise kv_cache_gb to serve it whole",
                num_pages * config.page_size,
                self.max_model_len,
            )
            self.max_model_len = num_pages * config.page_size
        self.cache = KVCache(self.layout, num_pages, self.device)
        offload_slots = self.layout.pages_for(config.kv_offload_gb * 2**30)
        if config.kv_offload_gb and not offload_slots:
            raise ConfigError(
                f"kv_offload_gb: {config.kv_offload_gb:g} GiB holds no page of KV "
                f"({self.layout.bytes_per_page} bytes a page here)"
            )
        self.pool = PagePool(
            num_pages, config.page_size, config.prefix_caching, offload_slots=offload_slots
        )
        self.tier = KVTier(self.pool, self.cache) if offload_slots else None
        self.step_rate = StepRate()  # seconds per token of this engine's steps
        self._unsynced = (0.0, 0)  # seconds, tokens of the steps since the last that sampled
        self.holds = PageHolds(self.pool)  # pages a KV sink keeps past their step
        self.scheduler = Scheduler[Request](
            self.pool, config.max_num_seqs, config.max_num_batched_tokens, config.chunked_prefill
        )
        self.runner = build_runner(
            self.model,
            self.cache,
            backend,
            config.max_num_seqs,
            self.max_model_len,
            config.max_num_batched_tokens,
            self.device,
        )
        if self.ranks is not None:
            self.ranks.follow()
        self._ids = itertools.count()
        self._prompt_tokens = 0  # prompts whose prefill finished here, whole (EngineCounts)
        self._generated_tokens = 0  # tokens sampled here
        self._grammars: Grammars | None = None  # built by the first structured request
        log.info(
            "loaded %s (%s, %s, %s attention%s%s%s) in %.1fs: weights %.1f MiB resident",
            self.spec.name,
            describe_modes(config, self.dtype, self.quantization, self.device.type),
            self.device,
            backend,
            ", CUDA-graph decode" if self.runner.graphs else "",
            ", layers in one C call a step" if self.runner.loop else "",
            "" if group is None else f", {group.shard.describe()}",
            time.perf_counter() - started,
            self.model.weight_bytes / 2**20,
        )
        log.info("%s", self.layout.capacity_report(num_pages, self.max_model_len))
        if offload_slots:
            log.info(
                "KV tier: %d pages (%.2f GiB) in %shost memory behind the pool",
                offload_slots,
                offload_slots * self.layout.bytes_per_page / 2**30,
                "pinned " if self.device.type == "cuda" else "",
            )

    # --- the API ---------------------------------------------------------------------------

    def follow(self) -> None:
        """Ranks > 0: run rank 0's steps on this rank's shard until it closes."""
        self.runner.follow()

    def close(self) -> None:
        """Stop this engine's KV tier's copies and its other ranks (a model on one rank has
        none)."""
        if self.tier is not None:
            self.tier.close()
        if self.ranks is None:
            return
        from cluster.engine.model.tensor_parallel import GroupLost

        ranks, self.ranks = self.ranks, None
        try:
            self.runner.stop_followers()
        except GroupLost:  # a rank is gone already: the rest are ended below
            log.warning("closing an engine whose group lost a rank", exc_info=True)
        finally:
            ranks.close()

    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        request_id: RequestId | None = None,
        resumed: int = 0,
    ) -> RequestId:
        """Queue a request; InvalidRequestError (naming the field) leaves the engine untouched.

        `resumed`: the prompt's last `resumed` tokens are the request's own output so far,
        generated elsewhere (a migrated request). Its text and seeded draws continue after
        them, so it yields the tokens it would have yielded in one place; `max_tokens`
        counts the tokens after them. Text offsets (RequestOutput.text_offset) count their
        text too.
        """
        req = self._new(prompt, sampling, request_id, resumed)
        self.scheduler.add(req)
        return req.request_id

    def cached_prefix_tokens(self, prompt_ids: list[int]) -> int:
        """Leading prompt tokens whose KV this engine's prefix cache holds now."""
        seq = Sequence(RequestId(""), prompt_ids, len(prompt_ids), SamplingParams())
        return self.scheduler.cached_prefix(seq)

    def reserve(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        request_id: RequestId,
        resumed: int = 0,
    ) -> Reservation | None:
        """Hold pages for a request whose prompt KV another worker will write into them.

        Page ownership: the engine owns the pages until the request ends. The writer may
        fill `pages[num_cached_tokens // page_size:]` until the caller ends the transfer
        with `start_decode` (the KV landed), `recompute` or `abort_request`; the caller
        must not end it while a WRITE can still land. None: too few pages, nothing held.
        """
        req = self._new(prompt_ids, sampling, request_id, resumed)
        self._settle_tier()  # an idle worker steps no more: its copies' pages free here
        if not self.scheduler.reserve(req):
            return None
        return Reservation(list(req.pages), req.num_computed)

    def start_decode(self, request_id: RequestId, first: SampledToken) -> RequestOutput:
        """The prompt's KV has landed and another worker sampled its first token: decode on."""
        req = self.scheduler.requests[request_id]
        if req.generator is not None:  # that worker drew the first token from this seed
            skip_draws(req.generator, self.spec.vocab_size, 1)
        self.scheduler.activate(req)
        logprob = first.logprob if req.sampling.logprobs else None
        return self._output(req, first.token_id, logprob, first.top_logprobs)

    def recompute(self, request_id: RequestId) -> None:
        """The prompt's KV will not arrive: drop the reserved pages and prefill it here."""
        self.scheduler.requeue(self.scheduler.requests[request_id])

    def abort_request(
        self, request_id: RequestId, reason: FinishReason = FinishReason.ABORT
    ) -> bool:
        """Stop a request in any state and free its pages; False if it is not in flight."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, reason)
        return True

    def status(self, request_id: RequestId) -> RequestStatus | None:
        """The request's state, or None if it is not in flight."""
        req = self.scheduler.requests.get(request_id)
        return None if req is None else req.status

    def has_unfinished(self) -> bool:
        """Requests in flight, or copies to the KV tier holding pages (a step settles them)."""
        return bool(self.scheduler.requests) or (self.tier is not None and self.tier.busy)

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def kv_heads(self) -> range:
        """The model's KV heads this rank's cache holds (all of them on one rank)."""
        group = self.model.group
        return range(self.spec.num_kv_heads) if group is None else range(*group.shard.kv_heads)

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            self.model_id,
            self.max_model_len,
            self.spec.vocab_size,
            self.pool.page_size,
            self.sampling_defaults,
        )

    @property
    def counts(self) -> EngineCounts:
        return EngineCounts(
            self._prompt_tokens,
            self._generated_tokens,
            self.pool.prefix_queries,
            self.pool.prefix_hits,
            self.scheduler.num_preemptions,
            None if self.tier is None else self.tier.counts,
        )

    def _time_step(self, started: float, tokens: int, synced: bool) -> None:
        """Feed step_rate. A step that samples ends with the device done (its tokens reach
        the host); the steps before it that did not (prompt chunks, whose device work may
        still be queued) are timed together with it, as one step."""
        seconds, n = self._unsynced
        seconds, n = seconds + time.perf_counter() - started, n + tokens
        if synced:
            self.step_rate.observe(seconds, n)
            seconds, n = 0.0, 0
        self._unsynced = (seconds, n)

    def step(self, sink: KVSink | None = None) -> list[RequestOutput]:
        """Run one batch; an output for every request that produced tokens or finished.

        `sink` hears of each layer's KV as soon as it is queued into the cache, and of
        each prompt done in this step (cluster/engine/kv_sink.py).
        """
        self._settle_tier()
        step = self.scheduler.schedule()
        if self.tier is not None:
            self.tier.restore(step.restores)
        if step.empty:
            if self.scheduler.restoring:  # nothing to run until a restore is done
                self._settle_tier(wait=True)
            return []
        started = time.perf_counter()
        ps = self.pool.page_size
        on_layer = None if sink is None else layer_hook(step, ps, self.device, sink)
        prompt_parts = prompt_rows(step)  # before the commit moves num_computed
        sampled, logits = self.runner.run(step, on_layer)
        if prompt_parts:
            record_prompt_logprobs(prompt_parts, logits[len(sampled) :], self.scheduler.requests)
            logits = logits[: len(sampled)]
        for seq in step.decodes:
            self.scheduler.commit(seq, 1)
        for seq, n in step.prefills:
            self.scheduler.commit(seq, n)
        if self.tier is not None:
            self.tier.spill()  # the pages this step filled, copied while the next one runs
        if not sampled:
            self._time_step(started, step.num_tokens, synced=False)
            return []
        firsts = [len(s.token_ids) == s.num_prompt for s in sampled]  # before the append
        reqs = [self.scheduler.requests[s.request_id] for s in sampled]
        params = [s.sampling for s in sampled]
        if any(p.adjusts_logits for p in params):
            histories = [History(r.token_ids, r.output_from, r.stop_ids) for r in reqs]
            logits = adjust(logits, params, histories)
        masking = [(i, m) for i, r in enumerate(reqs) if (m := r.matcher) is not None and m.masks]
        if masking:
            assert self._grammars is not None
            rows, held = zip(*masking, strict=True)
            logits = self._grammars.mask(logits, list(rows), held)
        tokens, logprobs = sample(logits, params, [r.generator for r in reqs])
        tops = top_logprobs(logits, params)
        self._time_step(started, step.num_tokens, synced=True)
        self._prompt_tokens += sum(
            s.num_prompt for s, first in zip(sampled, firsts, strict=True) if first
        )
        self._generated_tokens += len(tokens)
        outputs = [
            self._output(r, tok, logprobs[i] if logprobs else None, tops[i])
            for i, (r, tok) in enumerate(zip(reqs, tokens, strict=True))
        ]
        if sink is not None:
            for out, first in zip(outputs, firsts, strict=True):
                if first:
                    sink.prompt_done(PromptDone(out.request_id, out.first))
        return outputs

    def generate(
        self, prompts: Seq[str | list[int]], sampling: SamplingParams | Seq[SamplingParams]
    ) -> list[Completion]:
        """Run prompts to completion together (continuous batching); results in prompt order.

        Drives the engine itself: outputs of requests added elsewhere are dropped.
        """
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else sampling
        rids: list[RequestId] = []
        try:
            for p, s in zip(prompts, params, strict=True):
                rids.append(self.add_request(p, s))
        except InvalidRequestError:
            for rid in rids:  # all or nothing: no request left behind unread
                self.abort_request(rid)
            raise
        seqs = {r: self.scheduler.requests[r] for r in rids}
        texts: dict[RequestId, list[str]] = {r: [] for r in rids}
        done: dict[RequestId, Completion] = {}
        while len(done) < len(rids):
            for out in self.step():
                if out.request_id not in texts:
                    continue
                texts[out.request_id].append(out.new_text)
                if out.finish_reason is not None:
                    seq = seqs[out.request_id]
                    done[out.request_id] = Completion(
                        request_id=seq.request_id,
                        prompt_token_ids=seq.token_ids[: seq.num_prompt],
                        token_ids=seq.output_ids,
                        text="".join(texts[out.request_id]),
                        finish_reason=out.finish_reason,
                        logprobs=seq.logprobs,
                        num_cached_tokens=seq.num_cached,
                    )
        while self.tier is not None and self.tier.busy:  # the copies still holding pages
            self._settle_tier(wait=True)
        return [done[r] for r in rids]

    # --- internals ---------------------------------------------------------------------------

    def _settle_tier(self, wait: bool = False) -> None:
        """Settle the KV tier's finished copies: restored requests prefill on (KVTier.settle)."""
        if self.tier is None:
            return
        for seq, whole in self.tier.settle(wait):
            req = self.scheduler.requests.get(seq.request_id)
            if req is seq:
                self.scheduler.restored(req, whole)

    def _new(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        request_id: RequestId | None,
        resumed: int,
    ) -> Request:
        rid = request_id or RequestId(f"req-{next(self._ids)}")
        refuse_in_flight(rid, self.scheduler.requests)
        ids = self._prompt_ids(prompt)
        if not 0 <= resumed < len(ids):
            raise InvalidRequestError(
                f"resumed: must be in [0, {len(ids)}) for a {len(ids)}-token prompt, got {resumed}"
            )
        refuse_past_context("max_tokens", len(ids), sampling.max_tokens, self.max_model_len)
        generator = None
        if not sampling.greedy and sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(self._seed(sampling.seed))
            skip_draws(generator, self.spec.vocab_size, resumed)
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(self.spec.eos_token_ids)
        output_from = len(ids) - resumed
        text = TextStream(
            self.tokenizer, ids[:output_from], sampling.stop, sampling.include_stop_str_in_output
        )
        for token in ids[output_from:]:
            text.add(token)  # no stop string in them: the request would have ended there
        matcher = None
        if sampling.structured is not None:
            matcher = self._grammar().matcher(sampling.structured, ids[output_from:])
        prompt_lps: list[PromptLogprob] | None = None
        if sampling.prompt_logprobs is not None and not resumed:
            prompt_lps = [(token, None, ()) for token in ids]
        return Request(
            rid,
            list(ids),
            len(ids),
            sampling,
            text=text,
            generator=generator,
            stop_ids=frozenset(stop_ids),
            output_from=output_from,
            matcher=matcher,
            prompt_logprobs=prompt_lps,
        )

    def _grammar(self) -> Grammars:
        if self._grammars is None:  # xgrammar is loaded by the first request that needs it
            from cluster.engine.grammar import Grammars

            eos = self.spec.eos_token_ids
            self._grammars = Grammars(self.tokenizer, self.spec.vocab_size, eos)
        return self._grammars

    def _seed(self, seed: int) -> int:
        """A request's seed as its generator takes it: torch's seeds are 64 bits unsigned
        (a negative one is 2^64 above), and the CPU's mt19937 reads only the low 32, so
        there the high 32 are mixed in, lest seeds that differ only above bit 31 draw alike."""
        seed %= 2**64
        if self.device.type == "cpu":
            seed = (seed + (seed >> 32) * 0x9E3779B9) & 0xFFFFFFFF
        return seed

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt: must not be empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt: token id {bad[0]!r} is outside the vocabulary [0, "
                    f"{self.spec.vocab_size})"
                )
        if not ids:
            raise InvalidRequestError("prompt: must not be empty")
        refuse_long_prompt("prompt", len(ids), self.max_model_len)
        return ids

    def _output(
        self, req: Request, token: int, logprob: float | None, top: TopLogprobs = ()
    ) -> RequestOutput:
        """`token` appended to `req`; a request it ends is finished (its pages freed)."""
        out = append(req, token, logprob, top)
        if out.finish_reason is not None:
            self.scheduler.finish(req, out.finish_reason)
        return out
