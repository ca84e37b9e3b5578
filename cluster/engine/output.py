"""A request's output as its tokens are sampled: the Request the engine holds (its
Sequence and its text, stop conditions, grammar and generator), each new token appended
with its end decided (a stop string or token, the grammar's end, max_tokens), and the
prompt's logprobs recorded as its chunks are computed and handed over once, with the
first output token."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cluster.engine.model.tokenizer import TextStream
from cluster.engine.sched.sequence import Sequence
from cluster.types import FinishReason, PromptLogprob, RequestId, RequestOutput, TopLogprobs

if TYPE_CHECKING:  # xgrammar loads only for structured output
    from cluster.engine.grammar import Held

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class Request(Sequence):
    """A request in the engine: its Sequence (what the scheduler reads) and its output's
    state. The scheduler holds it (Scheduler.requests) from admission to its end."""

    text: TextStream
    generator: torch.Generator | None  # a seeded request's own; unseeded rows draw together
    stop_ids: frozenset[int]
    output_from: int  # where its output starts in token_ids (resumed tokens are output)
    matcher: Held | None = None  # a structured output's place in its grammar
    prompt_logprobs: list[PromptLogprob] | None = None  # filled as the prompt is computed


def append(req: Request, token: int, logprob: float | None, top: TopLogprobs = ()) -> RequestOutput:
    """`token` appended to `req`, and what it outputs: its text so far and, if it ends
    the request, why (the caller then finishes it in the scheduler)."""
    req.token_ids.append(token)
    if logprob is not None:
        req.logprobs.append(logprob)
    reason = None
    if req.matcher is not None and not req.matcher.accept(token):
        reason = FinishReason.ERROR  # the mask allowed no such token: a bug, not a reply
        log.error("request %s: token %d breaks its grammar", req.request_id, token)
    elif (
        req.text.add(token)
        or token in req.stop_ids
        or (req.matcher is not None and req.matcher.is_terminated())
    ):
        reason = FinishReason.STOP
    elif len(req.token_ids) - req.num_prompt >= req.sampling.max_tokens:
        reason = FinishReason.LENGTH
    text_offset = req.text.emitted
    prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None  # once, with the first
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=[token],
        text_offset=text_offset,
        new_text=req.text.take(final=reason is not None),
        finish_reason=reason,
        new_logprobs=[logprob] if logprob is not None else [],
        new_top_logprobs=[top] if req.sampling.top_logprobs else [],
        prompt_logprobs=prompt_logprobs,
        num_prompt_tokens=req.num_prompt,
        num_cached_tokens=req.num_cached,
    )


def record_prompt_logprobs(
    parts: list[tuple[Sequence, int, int]],
    logits: torch.Tensor,
    requests: dict[RequestId, Request],
) -> None:
    """Each prompt position's logprob of the prompt's next token, and its alternatives:
    `parts` (sequence, first position, count) in the order of `logits`' rows."""
    logprobs = torch.log_softmax(logits, dim=-1)
    at = 0
    for seq, start, count in parts:
        rows, at = logprobs[at : at + count], at + count
        recorded = requests[seq.request_id].prompt_logprobs
        if recorded is None:  # a resumed request's were delivered before it moved
            continue
        nexts = torch.tensor(seq.token_ids[start + 1 : start + 1 + count], device=rows.device)
        chosen = rows.gather(1, nexts[:, None]).squeeze(1).tolist()
        k = seq.sampling.prompt_logprobs or 0
        tops: list[TopLogprobs] = [()] * count
        if k:
            values, ids = rows.topk(k, dim=-1)
            pairs = zip(ids.tolist(), values.tolist(), strict=True)
            tops = [tuple(zip(i, v, strict=True)) for i, v in pairs]
        for j in range(count):
            recorded[start + 1 + j] = (seq.token_ids[start + 1 + j], chosen[j], tops[j])
