"""The engine's two disaggregated roles, in one process with no transport: a prefill
engine's prompt KV, copied by its KV sink into a decode engine's reserved pages, decodes
to the same tokens as one engine doing both (the page-ownership contract, without Ray or
UCX); and the sink seam itself on the real model."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

import pytest

from cluster.engine.engine import LLMEngine, Reservation
from cluster.engine.kv_sink import KVStored, PromptDone
from cluster.engine.sched.page_pool import pages_for
from cluster.types import (
    FinishReason,
    InvalidRequestError,
    PageId,
    RequestId,
    RequestStatus,
    SampledToken,
    SamplingParams,
)
from tests.integration.conftest import INVARIANT


class CopySink:
    """Copies each layer's prompt KV into a reservation's pages as soon as it is stored."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, reservation: Reservation) -> None:
        self.src, self.dst, self.reservation = prefill.cache, decode.cache, reservation
        self.first = reservation.num_cached_tokens // decode.pool.page_size
        self.done: list[PromptDone] = []

    def stored(self, events: Seq[KVStored]) -> None:
        for e in events:
            src = list(e.pages[self.first :])
            dst = self.reservation.pages[self.first : len(e.pages)]
            for layer in e.layers:
                self.dst.k[layer, dst] = self.src.k[layer, src]
                self.dst.v[layer, dst] = self.src.v[layer, src]

    def prompt_done(self, event: PromptDone) -> None:
        self.done.append(event)


def handoff(prefill: LLMEngine, decode: LLMEngine, ids: list[int], sp: SamplingParams) -> list[int]:
    rid = RequestId("handoff")
    reservation = decode.reserve(ids, sp, rid)
    assert reservation is not None
    assert decode.status(rid) is RequestStatus.TRANSFERRING
    sink = CopySink(prefill, decode, reservation)
    prefill.add_request(ids, dataclasses.replace(sp, max_tokens=1), rid)
    (first,) = prefill.step(sink)
    assert first.finish_reason is not None and not prefill.has_unfinished()
    assert sink.done == [PromptDone(rid, SampledToken(first.new_token_ids[0], None))]
    out = decode.start_decode(rid, sink.done[0].first)
    tokens = list(out.new_token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    return tokens


@pytest.mark.parametrize(
    "sp",
    [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.9, seed=5)],
    ids=["greedy", "seeded"],
)
def test_kv_copied_into_reserved_pages_decodes_like_one_engine(
    make_engine: Any, prompts: list[list[int]], sp: SamplingParams
) -> None:
    prefill = make_engine("handoff-prefill", **INVARIANT, kv_cache_gb=0.05, prefix_caching=False)
    decode = make_engine("handoff-decode", **INVARIANT, kv_cache_gb=0.05, prefix_caching=False)
    both = make_engine("handoff-both", **INVARIANT, kv_cache_gb=0.05)
    for ids in (prompts[7], prompts[9]):
        (expected,) = both.generate([ids], sp)
        assert handoff(prefill, decode, ids, sp) == expected.token_ids


def test_each_engine_counts_the_prompts_it_prefilled_and_the_tokens_it_sampled(
    make_engine: Any, prompts: list[list[int]]
) -> None:
    prefill = make_engine("handoff-prefill", **INVARIANT, kv_cache_gb=0.05, prefix_caching=False)
    decode = make_engine("handoff-decode", **INVARIANT, kv_cache_gb=0.05, prefix_caching=False)
    both = make_engine("handoff-both", **INVARIANT, kv_cache_gb=0.05)
    ids, sp = prompts[7], SamplingParams(max_tokens=6)
    p, d, b = prefill.counts, decode.counts, both.counts
    tokens = handoff(prefill, decode, ids, sp)
    assert len(tokens) == 6
    # the prompt and the first token where the prompt was computed, the rest where decoded
    assert prefill.counts.prompt_tokens - p.prompt_tokens == len(ids)
    assert prefill.counts.generation_tokens - p.generation_tokens == 1
    assert decode.counts.prompt_tokens - d.prompt_tokens == 0
    assert decode.counts.generation_tokens - d.generation_tokens == 5
    # One engine doing both counts both; asked again, it finds the prompt's full pages
    # cached (the first ask may too: the module's earlier tests share this engine).
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    both.generate([ids], sp)
    once = both.counts
    both.generate([ids], sp)
    assert both.counts.prompt_tokens - b.prompt_tokens == 2 * len(ids)
    assert both.counts.generation_tokens - b.generation_tokens == 2 * 6
    full = (len(ids) - 1) // 16 * 16  # the last prompt token is always computed
    assert both.counts.prefix_queries - once.prefix_queries == full
    assert both.counts.prefix_hits - once.prefix_hits == full


def test_recompute_drops_the_reservation_and_prefills_locally(
    make_engine: Any, prompts: list[list[int]]
) -> None:
    decode = make_engine("handoff-decode", **INVARIANT, kv_cache_gb=0.05, prefix_caching=False)
    sp = SamplingParams(max_tokens=8, temperature=0.9, seed=11)
    (expected,) = decode.generate([prompts[2]], sp)
    rid = RequestId("late")
    assert decode.reserve(prompts[2], sp, rid) is not None
    decode.recompute(rid)
    tokens: list[int] = []
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
    assert tokens == expected.token_ids


def test_a_reservation_fails_cleanly_when_pages_are_short(
    make_engine: Any, prompts: list[list[int]]
) -> None:
    decode = make_engine("handoff-tiny", **INVARIANT, kv_cache_gb=0.002, prefix_caching=False)
    pages = decode.pool.num_pages
    long_prompt = (prompts[7] * 8)[: pages * decode.pool.page_size - 8]
    assert decode.reserve(long_prompt, SamplingParams(max_tokens=4), RequestId("a")) is not None
    assert decode.reserve(prompts[0], SamplingParams(max_tokens=4), RequestId("b")) is None
    assert decode.status(RequestId("b")) is None
    assert decode.abort_request(RequestId("a"), FinishReason.ERROR)


def outputs(engine: LLMEngine, ids: list[int], sp: SamplingParams, resumed: int = 0) -> list[Any]:
    rid = engine.add_request(ids, sp, resumed=resumed)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def joined(text: str, outs: list[Any]) -> str:
    """`text` followed by the outputs' text, each from its offset on (what a reader keeps)."""
    for o in outs:
        text += o.new_text[max(0, len(text) - o.text_offset) :]
    return text


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True, logprobs=True),
    ],
    ids=["greedy", "seeded", "seeded-logprobs"],
)
def test_a_request_resumed_after_k_tokens_goes_on_as_if_never_moved(
    make_engine: Any, prompts: list[list[int]], sp: SamplingParams
) -> None:
    """A migrated request: the prompt plus its first k tokens, `resumed=k`, yields the
    rest of the tokens, logprobs and text it would have yielded in one place."""
    engine = make_engine("resume", kv_cache_gb=0.05)
    whole = outputs(engine, prompts[3], sp)
    tokens = [o.new_token_ids[0] for o in whole]
    text = joined("", whole)
    assert len(tokens) == 24 and text
    for k in (1, 9, 23):
        rest = outputs(
            engine,
            prompts[3] + tokens[:k],
            dataclasses.replace(sp, max_tokens=sp.max_tokens - k),
            resumed=k,
        )
        assert tokens[:k] + [o.new_token_ids[0] for o in rest] == tokens
        # The continuation's first logprob comes from a prefill, not a decode step: equal
        # to float32 rounding.
        expected = [lp for o in whole[k:] for lp in o.new_logprobs]
        assert [lp for o in rest for lp in o.new_logprobs] == pytest.approx(expected, abs=1e-4)
        assert joined(joined("", whole[:k]), rest) == text


def test_a_stop_string_across_the_move_still_stops_the_request(
    make_engine: Any, prompts: list[list[int]]
) -> None:
    engine = make_engine("resume", kv_cache_gb=0.05)
    free = outputs(engine, prompts[3], SamplingParams(max_tokens=24, ignore_eos=True))
    text = joined("", free)
    # A stop string that starts in token 9's text and ends in a later token's.
    start = len(joined("", free[:9])) - 1
    stop = text[start : start + 4]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))
    whole = outputs(engine, prompts[3], sp)
    tokens = [o.new_token_ids[0] for o in whole]
    assert whole[-1].finish_reason is FinishReason.STOP and len(tokens) < 24
    assert joined("", whole) == text[: text.index(stop)]
    k = 9
    rest = outputs(
        engine, prompts[3] + tokens[:k], dataclasses.replace(sp, max_tokens=24 - k), resumed=k
    )
    assert tokens[:k] + [o.new_token_ids[0] for o in rest] == tokens
    assert rest[-1].finish_reason is FinishReason.STOP
    assert joined(joined("", whole[:k]), rest) == joined("", whole)


def test_resumed_must_leave_a_prompt(make_engine: Any, prompts: list[list[int]]) -> None:
    engine = make_engine("resume", kv_cache_gb=0.05)
    with pytest.raises(InvalidRequestError, match="resumed: must be in"):
        engine.add_request(prompts[3][:4], SamplingParams(max_tokens=4), resumed=4)
    assert not engine.has_unfinished()


class HoldAll:
    """A sink that holds every page it is told of, as a sender with every WRITE in flight."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.events: list[KVStored] = []
        self.done: list[PromptDone] = []

    def stored(self, events: Seq[KVStored]) -> None:
        for e in events:
            self.engine.holds.hold(e.pages)
        self.events += events

    def prompt_done(self, event: PromptDone) -> None:
        self.done.append(event)

    def release(self) -> None:
        for e in self.events:
            self.engine.holds.release(e.pages)


def test_the_sink_hears_every_layer_and_prompt_and_held_pages_outlive_their_requests(
    make_engine: Any, prompts: list[list[int]]
) -> None:
    engine = make_engine(
        "sink", **INVARIANT, kv_cache_gb=0.05, prefix_caching=False, max_num_batched_tokens=32
    )
    free, ps, layers = engine.num_free_pages, engine.pool.page_size, engine.spec.num_layers
    sp = SamplingParams(max_tokens=3, logprobs=True, ignore_eos=True)
    ids = {engine.add_request(p, sp): p for p in (prompts[7], prompts[1])}
    sink = HoldAll(engine)
    outs: dict[RequestId, list[Any]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step(sink):
            outs[out.request_id].append(out)
    for rid, prompt in ids.items():
        mine = [e for e in sink.events if e.request_id == rid]
        tokens = [e.num_tokens for e in mine]
        assert tokens == sorted(tokens) and tokens[-1] == len(prompt) + sp.max_tokens - 1
        assert len(mine) % layers == 0 and len(mine) > layers  # chunked: more than one step
        assert all(len(e.pages) == pages_for(e.num_tokens, ps) for e in mine)
        assert [e.layers.start for e in mine[:layers]] == list(range(layers))
        first = outs[rid][0]
        done = [d for d in sink.done if d.request_id == rid]
        token = SampledToken(first.new_token_ids[0], first.new_logprobs[0])
        assert done == [PromptDone(rid, token)]
    held = {PageId(p) for e in sink.events for p in e.pages}
    assert engine.num_free_pages == free - len(held)  # the requests are done, not the sink
    sink.release()
    assert engine.holds.num_held == 0 and engine.num_free_pages == free
