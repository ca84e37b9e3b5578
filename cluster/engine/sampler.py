"""Next-token choice for a batch of logits rows.

`adjust` first applies each row's logit_bias, min_tokens and penalties. Greedy rows
take the argmax together. Sampled rows are filtered together
(temperature, top-k, top-p, min-p) and draw together; only a seeded row draws from
its own request's generator, so it picks the same tokens alone or in any batch.

On a GPU the host waits only once, for the tokens: the rows' parameters reach the device
from pinned memory without blocking (a copy from pageable memory, as `torch.tensor(...,
device=cuda)` or indexing with a list makes, first waits for the whole forward pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.types import SamplingParams, TopLogprobs


def sample(
    logits: torch.Tensor,  # [rows, vocab] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[float] | None]:
    """Token per row and, when any row asked for them, the chosen tokens' logprobs."""
    tokens = logits.argmax(dim=-1)  # every row: greedy ones are done, sampled ones redrawn
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = to_device(sampled, torch.long, logits.device)
        probs = _filtered_probs(logits.index_select(0, rows), [params[i] for i in sampled])
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one draw per token.
        noise = torch.empty_like(probs)
        own = [(row, g) for row, i in enumerate(sampled) if (g := generators[i]) is not None]
        if len(own) < len(sampled):  # unseeded rows: one draw from torch's own generator
            noise.exponential_()
        for row, g in own:  # seeded rows (all of them when served): in place, no copy
            noise[row].exponential_(generator=g)
        tokens.index_copy_(0, rows, (probs / noise).argmax(dim=-1))
    # Everything above stays on the logits' device; one copy brings the results back.
    if not any(p.logprobs for p in params):
        return tokens.tolist(), None
    chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    ids, logprobs = torch.stack((tokens.double(), chosen.double())).tolist()  # ids exact < 2^53
    return [int(t) for t in ids], logprobs


@dataclass(frozen=True)
class History:
    """What a row's logit adjustments read: its token ids (prompt, then output; the
    sequence's own list, not a copy), where its output starts (a resumed request's
    delivered tokens count as output), and the ids that would end it (EOS unless ignored,
    and stop_token_ids)."""

    token_ids: list[int]
    output_from: int
    stop_ids: frozenset[int]


def adjust(
    logits: torch.Tensor,  # [rows, vocab] float32
    params: Sequence[SamplingParams],
    histories: Sequence[History],
) -> torch.Tensor:
    """The logits each row samples from, in vLLM's order: logit_bias added, the stop ids
    barred while the output is shorter than min_tokens, then the repetition penalty (on
    prompt and output tokens), the frequency and the presence penalties (on output tokens).
    Rows asking for none are untouched; the rest are adjusted together, one op per kind."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    device = logits.device
    ps = [params[i] for i in rows]
    hs = [histories[i] for i in rows]
    index = to_device(rows, torch.long, device)
    sub = logits.index_select(0, index)

    def at(cells: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        r, t = zip(*cells, strict=True)
        return to_device(list(r), torch.long, device), to_device(list(t), torch.long, device)

    def scatter(target: torch.Tensor, cells: list[tuple[int, int]], values: torch.Tensor) -> None:
        target.index_put_(at(cells), values, accumulate=True)

    bias = [(r, t, b) for r, p in enumerate(ps) for t, b in p.logit_bias]
    if bias:
        values = to_device([b for _, _, b in bias], torch.float32, device)
        scatter(sub, [(r, t) for r, t, _ in bias], values)
    barred = [
        (r, t)
        for r, (p, h) in enumerate(zip(ps, hs, strict=True))
        if len(h.token_ids) - h.output_from < p.min_tokens
        for t in h.stop_ids
    ]
    if barred:
        sub.index_put_(at(barred), torch.tensor(float("-inf"), device=device))
    penalised = [
        r for r, p in enumerate(ps)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1
    ]  # fmt: skip
    if penalised:
        counts = torch.zeros_like(sub)  # each token's count in the row's output
        out = [(r, t) for r in penalised for t in hs[r].token_ids[hs[r].output_from :]]
        if out:
            scatter(counts, out, torch.ones(len(out), device=device))
        if any(p.repetition_penalty != 1 for p in ps):
            repetition = to_device([p.repetition_penalty for p in ps], torch.float32, device)
            repetition = repetition[:, None]
            seen = counts.clone()
            prompt = [(r, t) for r in penalised for t in hs[r].token_ids[: hs[r].output_from]]
            if prompt:
                scatter(seen, prompt, torch.ones(len(prompt), device=device))
            scaled = torch.where(sub > 0, sub / repetition, sub * repetition)
            sub = torch.where(seen > 0, scaled, sub)
        frequency = to_device([p.frequency_penalty for p in ps], torch.float32, device)[:, None]
        presence = to_device([p.presence_penalty for p in ps], torch.float32, device)[:, None]
        sub = sub - frequency * counts - presence * (counts > 0)
    return logits.index_copy(0, index, sub)


def top_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[TopLogprobs]:
    """Each row's `top_logprobs` most likely tokens with their logprobs (() for a row that
    asked for none): one log-softmax and one top-k for the rows that did, one copy back."""
    rows = [i for i, p in enumerate(params) if p.top_logprobs]
    out: list[TopLogprobs] = [()] * len(params)
    if not rows:
        return out
    k = max(params[i].top_logprobs for i in rows)
    index = to_device(rows, torch.long, logits.device)
    values, ids = torch.log_softmax(logits.index_select(0, index), dim=-1).topk(k, dim=-1)
    for i, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
        n = params[i].top_logprobs
        out[i] = tuple(zip(row_ids[:n], row_values[:n], strict=True))
    return out


def to_device(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Host values on `device`, copied without the host waiting (pinned on a GPU)."""
    host = torch.tensor(values, dtype=dtype)
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


def skip_draws(generator: torch.Generator, vocab_size: int, n: int) -> None:
    """Advance a seeded request's generator past `n` tokens' draws, as `sample` draws them:
    a request continued on another worker (its first token sampled by a prefill worker, or
    migrated after some tokens) then draws what it would have drawn in one place."""
    noise = torch.empty(vocab_size, device=generator.device)
    for _ in range(n):
        noise.exponential_(generator=generator)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temps = to_device([p.temperature for p in params], torch.float32, device)
    logits = logits / temps[:, None]
    if any(p.top_k for p in params):
        vocab = logits.shape[1]
        ks = to_device([p.top_k or vocab for p in params], torch.long, device).clamp(max=vocab)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1 for p in params):
        top_p = to_device([p.top_p for p in params], torch.float32, device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keeps the smallest set reaching top_p; a row at 1 keeps all (a float cumsum can pass 1).
        drop_sorted = (mass_before > top_p[:, None]) & (top_p[:, None] < 1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, device)
        floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs
