"""Ids, sampling parameters, request states and per-step outputs shared by every role."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NewType

RequestId = NewType("RequestId", str)
PageId = NewType("PageId", int)
BlockHash = NewType("BlockHash", bytes)


# At or below this a temperature is greedy: dividing float32 logits by it overflows (from about
# 1e-37 the probabilities are NaN, which drew token 0 every step), and this close to 0 a
# draw is the argmax but for near-ties anyway. vLLM draws the same line at 1e-5.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20
# One sampled token's most likely alternatives: (token id, logprob), most likely first.
TopLogprobs = tuple[tuple[int, float], ...]
# A prompt token, its logprob given the tokens before it (None for the first: nothing
# predicts it), and its alternatives.
PromptLogprob = tuple[int, float | None, TopLogprobs]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class InvalidRequestError(ValueError):
    """A request field a caller sent is wrong; the message names the field."""


class InFlightError(InvalidRequestError):
    """A request's id names a request already in flight where it was sent."""


class RequestStatus(enum.Enum):
    """Every request is in exactly one of these states."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RESTORING = "restoring"  # its prefix's pages are being copied back from the KV tier
    TRANSFERRING = "transferring"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Structured:
    """Output held to a grammar (cluster/engine/grammar.py): any JSON object, one valid
    under a JSON schema, a regex's match, one of a list of strings, or an EBNF grammar's
    sentence. `spec`: the schema (JSON text), the regex, the choices (a JSON list) or the
    grammar; "" for json_object.

    A reasoning model's thoughts stay free: with `reasoning_end` (its `</think>` token) the
    grammar holds only the tokens after it; with `reasoning_start` too (Qwen3's `<think>`)
    the reply reasons only when that is its first token, else the grammar holds it all
    (without it, DeepSeek-R1's way: the reply starts in its thoughts)."""

    kind: str
    spec: str = ""
    reasoning_end: int | None = None
    reasoning_start: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                f"structured: kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}"
            )
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise InvalidRequestError("structured: reasoning_start needs reasoning_end")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. A temperature at or under GREEDY_TEMPERATURE (0 too) is greedy;
    seed makes sampling batch-independent."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # with each token, this many most likely alternatives
    # The prompt's own tokens' logprobs (and this many alternatives each), with the first
    # output token; None: not asked. Computed where the prompt is, never from the cache.
    prompt_logprobs: int | None = None
    # Logit adjustments (cluster/engine/sampler.py `adjust`), off at these values.
    presence_penalty: float = 0.0  # [-2, 2], per token present in the output
    frequency_penalty: float = 0.0  # [-2, 2], times the token's count in the output
    repetition_penalty: float = 1.0  # > 0, on tokens of the prompt and the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, [-100, 100]) added
    min_tokens: int = 0  # EOS and stop token ids barred before this many new tokens
    include_stop_str_in_output: bool = False
    structured: Structured | None = None  # the output's grammar, applied as a token mask

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise bad("logit_bias", "every bias must be in [-100, 100]")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad(
                "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        k = self.prompt_logprobs
        if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
            raise bad("prompt_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}] or null, got {k!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )


@dataclass(frozen=True)
class SampledToken:
    """A sampled token as it travels alone: a request's first, from the prefill engine to
    the decode worker (push, DONE notice, inbound) and to the router (FirstToken)."""

    token_id: int
    logprob: float | None  # None unless the request asked for logprobs
    top_logprobs: TopLogprobs = ()  # when asked for


@dataclass
class RequestOutput:
    """What one engine step produced for one request: new tokens, new text, and the end."""

    request_id: RequestId
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None = None
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when asked for
    # With the first output token, when asked for: each prompt token's (PromptLogprob).
    prompt_logprobs: list[PromptLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    text_offset: int = 0  # characters of the request's output text before new_text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def first(self) -> SampledToken:
        """Its first new token, with its logprob and alternatives where asked for."""
        return SampledToken(
            self.new_token_ids[0],
            self.new_logprobs[0] if self.new_logprobs else None,
            self.new_top_logprobs[0] if self.new_top_logprobs else (),
        )


@dataclass
class Completion:
    """A whole finished request, as `generate` returns it."""

    request_id: RequestId
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[float]
    num_cached_tokens: int


@dataclass(frozen=True, kw_only=True)
class Submission:
    """One attempt at a request, as the router hands it to a worker: to a decode worker
    (DecodeWorker.submit), or to a prefill worker (PrefillWorker.prefill), which passes it
    on to its decode worker as it is. Plain data: it crosses Ray."""

    request_id: RequestId
    prompt_ids: list[int]
    sampling: SamplingParams
    remote_prefill: bool  # a prefill worker pushes the prompt's KV: reserve pages for it
    reader: str  # whose outbox on the decode worker its deltas go to
    resumed: int = 0  # the prompt ends with this many tokens of its own output (migrated)


@dataclass(frozen=True)
class KVTarget:
    """Where a prefill worker writes a request's prompt KV: pages reserved on a decode worker.

    `pages` is the decode worker's page table for the whole prompt; the first
    `num_cached_tokens` tokens are already there (its prefix cache) and are not sent.
    `lease_s` is a duration, counted on each side's own clock: the decode worker revokes
    the transfer when it has heard no progress (STARTED, RENEW, a WRITE, DONE) for that
    long, and the prefill worker posts no WRITE once it has sent none for that long
    (cluster/transfer/inbound.py and push.py).
    """

    handshake: bytes  # the decode worker's transfer Handshake
    pages: tuple[PageId, ...]
    num_cached_tokens: int
    lease_s: float


@dataclass(frozen=True)
class FirstToken:
    """What a prefill worker returns as soon as it has sampled a request's first token."""

    token: SampledToken
    text: str
    num_cached_tokens: int = 0  # prompt tokens the prefill found in its prefix cache
    text_offset: int = 0  # characters of the request's output text before `text`
    waited_s: float = 0.0  # for the decode worker's reservation, before any compute
    computed_s: float = 0.0  # from its admission to the prefill engine to this token


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request, as a worker emits them; `index` counts output tokens and
    `text_offset` the characters of output text before `text`: a reader that got some of
    them from another worker (the first token, or the part before a migration) skips those.
    `evicted`: the worker gave the request up unfinished (drained): continue it elsewhere."""

    request_id: RequestId
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None  # set when finish_reason is ERROR: what went wrong
    num_cached_tokens: int = 0  # prompt tokens this worker found in its prefix cache
    text_offset: int = 0
    evicted: bool = False
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per token, when asked for
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # see RequestOutput


@dataclass(frozen=True)
class ModelInfo:
    """What a worker serves, for the router's validation and its ServerInfo."""

    name: str  # the model file's stem or checkpoint directory's name
    max_model_len: int
    vocab_size: int
    page_size: int
    # (field, value) the model's generation config sets (temperature, top_p, ...): what an
    # OpenAI request that leaves the field out gets.
    sampling_defaults: tuple[tuple[str, float], ...] = ()
