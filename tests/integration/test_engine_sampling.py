"""Sampling on the real model: seeds make output batch-independent; stops and limits hold."""

from __future__ import annotations

from typing import Any

import torch

from cluster.engine.engine import LLMEngine
from cluster.types import FinishReason, SamplingParams
from tests.helpers import needs_native_bf16


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(
    engine: LLMEngine, prompts: list[list[int]]
):
    seeded = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = engine.generate([prompts[2]], seeded)[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.0, seed=7)
    batch = engine.generate(
        [prompts[0], prompts[2], prompts[7]], [others, seeded, SamplingParams(max_tokens=12)]
    )
    assert batch[1].token_ids == alone
    different_seed = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=99)
    assert engine.generate([prompts[2]], different_seed)[0].token_ids != alone


def test_stop_string_cuts_the_text_before_it(engine: LLMEngine):
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7,"
    full = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert " 9" in full.text, full.text
    stopped = engine.generate([prompt], SamplingParams(max_tokens=16, stop=(" 9",)))[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == full.text[: full.text.index(" 9")]


def test_stop_token_ids_and_max_tokens(engine: LLMEngine):
    prompt = "The capital of France is"
    full = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert full.finish_reason is FinishReason.LENGTH and len(full.token_ids) == 8
    stop_at = full.token_ids[3]
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=8, stop_token_ids=(stop_at,), ignore_eos=True)
    )[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(stop_at) + 1]


def test_logprobs_of_chosen_tokens(engine: LLMEngine):
    done = engine.generate(
        ["The capital of France is"], SamplingParams(max_tokens=5, logprobs=True)
    )
    assert len(done[0].logprobs) == len(done[0].token_ids) == 5
    assert all(lp <= 0.0 for lp in done[0].logprobs)
    assert done[0].logprobs[0] > -1.0  # " Paris" is a confident greedy choice


def test_abort_frees_pages_in_every_state(engine: LLMEngine, prompts: list[list[int]]):
    free = engine.num_free_pages
    waiting = engine.add_request(prompts[7], SamplingParams(max_tokens=8))
    assert engine.abort_request(waiting)
    running = engine.add_request(prompts[7], SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.num_free_pages < free
    assert engine.abort_request(running)
    assert not engine.abort_request(running)
    assert engine.num_free_pages == free


@needs_native_bf16
def test_bfloat16_engine_answers(make_engine: Any):
    engine = make_engine("bf16", dtype="bfloat16", kv_cache_gb=0.25)
    chat = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    done = engine.generate([chat], SamplingParams(max_tokens=16))[0]
    assert "Paris" in done.text
    assert engine.cache.k.dtype is torch.bfloat16


def test_generate_leaves_other_requests_running(engine: LLMEngine):
    other = engine.add_request("Once upon a time", SamplingParams(max_tokens=40))
    done = engine.generate(["The capital of France is"], SamplingParams(max_tokens=4))
    assert len(done[0].token_ids) == 4
    assert engine.abort_request(other)


def test_a_temperature_at_or_under_the_epsilon_gives_the_greedy_tokens(
    engine: LLMEngine, prompts: list[list[int]]
):
    # 1e-38 and less once drew NaN probabilities and answered token 0 every step.
    greedy = engine.generate([prompts[0]], SamplingParams(max_tokens=8))[0].token_ids
    assert len(set(greedy)) > 1
    tiny = [1e-5, 1e-6, 1e-20, 1e-38, 1e-40, 1e-45, 1e-300, 0.0]
    outs = engine.generate(
        [prompts[0]] * len(tiny), [SamplingParams(max_tokens=8, temperature=t) for t in tiny]
    )
    assert {t: o.token_ids for t, o in zip(tiny, outs, strict=True)} == dict.fromkeys(tiny, greedy)


def _first_output(engine: LLMEngine, prompt: list[int], sp: SamplingParams) -> Any:
    rid = engine.add_request(prompt, sp)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                engine.abort_request(rid)
                return out


def test_prompt_logprobs_are_each_prefix_s_next_token_distribution(
    make_engine: Any, prompts: list[list[int]]
) -> None:
    """Position j's entry is the distribution after the prompt's first j tokens: the same
    as the first-token alternatives of a request whose prompt ends there; chunked or
    whole, and with the prompt's pages in the prefix cache, the same."""
    chunked = make_engine("chunked-16", max_num_batched_tokens=16)
    prompt = (prompts[0] * 10)[:40]
    sp = SamplingParams(max_tokens=1, prompt_logprobs=3)
    whole = _first_output(chunked, prompt, sp).prompt_logprobs
    again = _first_output(chunked, prompt, sp).prompt_logprobs  # its pages cached by now
    assert whole is not None and [t for t, _, _ in whole] == prompt
    assert whole[0][1:] == (None, ())
    assert again == whole
    for j in (1, 17, 39):
        _, lp, top = whole[j]
        assert lp is not None
        ref = _first_output(chunked, prompt[:j], SamplingParams(max_tokens=1, top_logprobs=3))
        want = ref.new_top_logprobs[0]
        assert [t for t, _ in top] == [t for t, _ in want]
        got, expected = torch.tensor([v for _, v in top]), torch.tensor([v for _, v in want])
        assert torch.allclose(got, expected, atol=1e-4)
        assert lp <= top[0][1] + 1e-6
    later = _first_output(chunked, prompt, SamplingParams(max_tokens=1))
    assert later.prompt_logprobs is None  # not asked for, not computed
