"""sample(): greedy rows, filtered seeded draws, batch independence and logprobs, and
what it costs the host."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cluster.engine.sampler import History, _filtered_probs, adjust, sample, top_logprobs
from cluster.types import GREEDY_TEMPERATURE, SamplingParams
from splitserve.bench.step_budget import counting

GREEDY = SamplingParams()


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=seeded(seed)) * scale


def draw(logits_row: torch.Tensor, params: SamplingParams, seeds: range) -> list[int]:
    """One token per seed, each from a fresh generator, for a one-row batch."""
    return [sample(logits_row[None], [params], [seeded(s)])[0][0] for s in seeds]


def test_greedy_takes_the_argmax_of_every_row() -> None:
    logits = random_logits(4, 50)
    tokens, logprobs = sample(logits, [GREEDY] * 4, [None] * 4)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs is None


def test_a_seeded_row_picks_the_same_token_alone_and_in_any_batch() -> None:
    logits = random_logits(4, 32, scale=1.0)
    row = logits[1]
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, min_p=0.01, seed=7)
    neighbours = [
        GREEDY,
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=0.5, top_k=3, min_p=0.2),
    ]
    alone, batched = [], []
    for seed in range(30):
        alone.append(sample(row[None], [params], [seeded(seed)])[0][0])
        tokens, _ = sample(
            logits,
            [neighbours[0], params, neighbours[1], neighbours[2]],
            [None, seeded(seed), seeded(1000 + seed), seeded(2000 + seed)],
        )
        batched.append(tokens[1])
    assert batched == alone
    assert len(set(alone)) > 1  # really sampled, not collapsed to one token


def test_a_rows_filtered_distribution_does_not_depend_on_its_neighbours() -> None:
    # What a top_p=1 row draws from must be its own softmax, even next to a top_p row.
    # (The effect on drawn tokens is too rare to show by sampling, so look at the probs.)
    plain = SamplingParams(temperature=1.0)
    nucleus = SamplingParams(temperature=1.0, top_p=0.5)
    for seed in range(10):
        logits = random_logits(2, 1000, seed=seed, scale=3.0)
        alone = _filtered_probs(logits[:1], [plain])
        batched = _filtered_probs(logits, [plain, nucleus])[:1]
        zeroed = int(((batched == 0) & (alone > 0)).sum())
        assert zeroed == 0, f"logits seed {seed}: {zeroed} tokens dropped by a neighbour's top_p"
        assert torch.equal(batched, alone)


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(1, 64)
    tokens = draw(logits[0], SamplingParams(temperature=1.0, top_k=1), range(20))
    assert set(tokens) == {int(logits[0].argmax())}


def test_a_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = random_logits(1, 64)
    tokens = draw(logits[0], SamplingParams(temperature=1.0, top_p=1e-6), range(20))
    assert set(tokens) == {int(logits[0].argmax())}


def test_top_k_keeps_only_the_k_most_likely_tokens() -> None:
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -1.0, 2.7])
    tokens = draw(logits, SamplingParams(temperature=1.0, top_k=3), range(200))
    assert set(tokens) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    filtered = draw(logits, SamplingParams(temperature=1.0, min_p=0.5), range(200))
    unfiltered = draw(logits, SamplingParams(temperature=1.0), range(200))
    assert set(filtered) == {0, 1}  # 0.15 and 0.05 are under 0.5 * 0.5
    assert set(unfiltered) == {0, 1, 2, 3}


def test_logprobs_are_the_log_softmax_at_the_chosen_tokens() -> None:
    logits = random_logits(3, 40)
    params = [
        SamplingParams(logprobs=True),
        SamplingParams(temperature=0.7, logprobs=True),
        SamplingParams(temperature=1.0, top_k=5),
    ]
    tokens, logprobs = sample(logits, params, [None, seeded(1), seeded(2)])
    assert logprobs is not None
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(3), torch.tensor(tokens)]
    assert torch.allclose(torch.tensor(logprobs), expected)


def test_draws_follow_softmax_of_logits_over_temperature() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    temperature = 0.7
    n = 4000
    generator = seeded(0)
    tokens, _ = sample(
        logits.repeat(n, 1), [SamplingParams(temperature=temperature)] * n, [generator] * n
    )
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / n
    expected = torch.softmax(logits / temperature, dim=-1)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_unseeded_rows_draw_together_and_follow_the_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    n = 4000
    torch.manual_seed(0)
    tokens, _ = sample(logits.repeat(n, 1), [SamplingParams(temperature=0.7)] * n, [None] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / n
    assert torch.allclose(freq, torch.softmax(logits / 0.7, dim=-1), atol=0.03), freq


def test_a_temperature_near_zero_picks_the_argmax_and_below_the_epsilon_is_greedy() -> None:
    # Logits a whole unit apart: from 1e-3 down, every draw is the argmax; from 1e-37 down
    # float32 logits / temperature overflow, so those must never reach the draw.
    logits = torch.arange(50, dtype=torch.float32).flip(0)[None].repeat(3, 1) * 0.5
    logits[1] = logits[1].roll(17)
    logits[2] = -logits[2]
    for temperature in (1e-3, 1e-4, 2e-5, 1e-5, 1e-6, 1e-20, 1e-38, 1e-40, 1e-45, 1e-300, 0.0):
        params = SamplingParams(temperature=temperature, seed=1)
        assert params.greedy == (temperature <= GREEDY_TEMPERATURE)
        tokens, _ = sample(logits, [params] * 3, [seeded(s) for s in range(3)])
        assert tokens == logits.argmax(dim=-1).tolist(), temperature


def test_an_all_greedy_batch_is_one_argmax_and_one_copy_back() -> None:
    logits = random_logits(8, 50)
    with counting() as budget:
        tokens, _ = sample(logits, [GREEDY] * 8, [None] * 8)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert (budget.ops, budget.syncs) == (1, ["tolist"])


class _Copies(TorchDispatchMode):
    """The copies ops make to another device, with their non_blocking flags."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.device, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and "device" in kwargs:
            self.copies.append((kwargs["device"], kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


def test_the_rows_parameters_reach_the_device_without_the_host_waiting() -> None:
    """On a device the host does not hold (meta: shapes only, no data) every value the
    sampler sends over shows as a copy: the sampled rows, their temperatures, top-k, top-p
    and min-p, each non-blocking. The copy back of the tokens is the step's one wait."""
    meta = torch.device("meta")
    params = [GREEDY, SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1)] * 2
    mode = _Copies()
    with pytest.raises(NotImplementedError, match="meta tensor"), mode:
        sample(torch.empty(4, 50, device=meta), params, [None] * 4)  # fails copying back
    to_meta = [blocking for device, blocking in mode.copies if device == meta]
    assert to_meta == [True] * 5
    assert mode.copies[-1] == (torch.device("cpu"), False)  # the tokens, to the host


# --- adjust: logit_bias, min_tokens and the penalties --------------------------------------


def history(prompt: list[int], output: list[int], stop_ids: tuple[int, ...] = ()) -> History:
    return History(prompt + output, len(prompt), frozenset(stop_ids))


def reference(logits: torch.Tensor, p: SamplingParams, h: History) -> torch.Tensor:
    """One row adjusted token by token, as vLLM documents it."""
    row = logits.clone()
    for token, bias in p.logit_bias:
        row[token] += bias
    output = h.token_ids[h.output_from :]
    if len(output) < p.min_tokens:
        for token in h.stop_ids:
            row[token] = float("-inf")
    for token in set(h.token_ids):
        if row[token] > 0:
            row[token] /= p.repetition_penalty
        else:
            row[token] *= p.repetition_penalty
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


def test_adjust_matches_the_per_row_reference_and_leaves_other_rows_alone() -> None:
    logits = random_logits(4, 40, seed=3)
    params = [
        GREEDY,
        SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(logit_bias=((7, -100.0), (9, 5.0)), min_tokens=3),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=-1.0),
    ]
    histories = [
        history([1, 2], [3]),
        history([4, 5, 6], [7, 7, 8, 4]),
        history([1], [2], stop_ids=(0, 11)),
        history([10, 11, 12], []),
    ]
    adjusted = adjust(logits, params, histories)
    assert torch.equal(adjusted[0], logits[0])
    for i in (1, 2, 3):
        assert torch.allclose(adjusted[i], reference(logits[i], params[i], histories[i])), i
    assert adjusted[2, 0] == adjusted[2, 11] == float("-inf")
    assert adjust(logits, [GREEDY] * 4, histories) is logits  # nothing asked: no copy


def test_min_tokens_bars_the_stop_ids_only_until_the_output_is_long_enough() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 2] = 5.0  # EOS is the argmax
    params = [SamplingParams(min_tokens=2)]
    short = adjust(logits, params, [history([1], [4], stop_ids=(2,))])
    assert sample(short, params, [None])[0] != [2]
    enough = adjust(logits, params, [history([1], [4, 5], stop_ids=(2,))])
    assert sample(enough, params, [None])[0] == [2]


def test_a_bias_of_minus_100_removes_the_argmax_and_plus_100_forces_a_token() -> None:
    logits = random_logits(2, 30, seed=5)
    top = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(logit_bias=((top[0], -100.0),)),
              SamplingParams(logit_bias=((17, 100.0),))]  # fmt: skip
    tokens, _ = sample(adjust(logits, params, [history([1], [])] * 2), params, [None] * 2)
    assert tokens[0] != top[0] and tokens[1] == 17


def test_a_resumed_requests_delivered_tokens_count_as_output() -> None:
    # Migrated: prompt [1, 2], then 3, 3 delivered before the move, then 4 generated here.
    logits = torch.zeros(1, 10)
    p = [SamplingParams(frequency_penalty=1.0)]
    resumed = adjust(logits, p, [History([1, 2, 3, 3, 4], 2, frozenset())])
    assert resumed[0].tolist() == [0, 0, 0, -2, -1, 0, 0, 0, 0, 0]


def test_top_logprobs_are_each_rows_k_most_likely_in_order() -> None:
    logits = random_logits(3, 40, seed=9)
    params = [SamplingParams(top_logprobs=3), GREEDY, SamplingParams(top_logprobs=1)]
    tops = top_logprobs(logits, params)
    want = torch.log_softmax(logits, dim=-1).topk(3, dim=-1)
    assert [t for t, _ in tops[0]] == want.indices[0].tolist()
    assert torch.allclose(torch.tensor([v for _, v in tops[0]]), want.values[0])
    assert tops[1] == () and [t for t, _ in tops[2]] == [int(logits[2].argmax())]
    assert top_logprobs(logits, [GREEDY] * 3) == [(), (), ()]
