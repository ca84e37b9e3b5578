"""A Generate call checked field by field and turned into token ids and SamplingParams.

Every check runs before any work is spent; a bad field raises InvalidRequestError with
a message that names it, which the servicer answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from cluster.engine.model.tokenizer import Tokenizer
from cluster.request_checks import refuse_long_prompt, refuse_past_context
from cluster.types import InvalidRequestError, ModelInfo, RequestId, SamplingParams, Structured
from router.token_count import CHUNK_CHARS, count_tokens
from router.tokenize_pool import TokenizePool
from router.tools import with_tool_prompt
from splitserve_api.v1 import splitserve_pb2 as pb

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 1024
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Text longer than this many characters per token of context cannot fit: refuse it
# before spending time tokenizing it.
MAX_CHARS_PER_TOKEN = 32
INLINE_BYTES = 4096  # requests this small are tokenized on the event loop
# Ids and session ids become Redis keys and log fields: keep them short and plain.
ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# An error message quotes at most this much of a value the caller sent: echoed whole, a
# 10,000-character model name overflowed gRPC's status metadata (RESOURCE_EXHAUSTED).
SHOWN_CHARS = 64
# Sampling fields a request may leave unset (then the engine's defaults apply).
OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "prompt_logprobs")  # fmt: skip
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True)
class Prepared:
    """A request ready to route."""

    prompt_ids: list[int]
    sampling: SamplingParams
    session_id: str | None
    request_id: RequestId | None


def prepare(
    msg: pb.GenerateRequest,
    tokenizer: Tokenizer,
    model: ModelInfo,
    max_tokens_limit: int | None,
    omitted_max_tokens: int | None = None,
) -> Prepared:
    """Check every field of `msg` and tokenize its input; InvalidRequestError names the field.

    `max_tokens_limit`: the most a request may ask for (None: the model's context). An
    omitted max_tokens is SamplingParams' default, or `omitted_max_tokens` (the HTTP API's:
    16 for a completion, the whole context for a chat, as OpenAI and vLLM) cut to what is
    left of the context after the prompt and to that limit."""
    _refuse_unknown(msg)
    if msg.model and msg.model != model.name:
        raise InvalidRequestError(
            f"model: {shown(msg.model)} is not served here (serving {model.name!r})"
        )
    limit = max_tokens_limit or model.max_model_len - 1
    session_id = _id(msg.session_id, "session_id")
    request_id = _id(msg.request_id, "request_id")
    sampling = _sampling(msg.sampling, model, limit)
    ids = _prompt_ids(msg, tokenizer, model)
    if omitted_max_tokens is not None and not msg.sampling.HasField("max_tokens"):
        left = min(omitted_max_tokens, limit, model.max_model_len - len(ids))
        sampling = dataclasses.replace(sampling, max_tokens=left)
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequestError(
            f"sampling.min_tokens: must be <= max_tokens ({sampling.max_tokens}), "
            f"got {sampling.min_tokens}"
        )
    refuse_past_context("sampling.max_tokens", len(ids), sampling.max_tokens, model.max_model_len)
    return Prepared(ids, sampling, session_id, RequestId(request_id) if request_id else None)


def _refuse_unknown(msg: Message, path: str = "") -> None:
    """A field this API does not know (a client built from a newer .proto) is refused, not
    ignored: protobuf would parse past it silently."""
    unknown = [f.field_number for f in UnknownFieldSet(msg)]
    if unknown:
        raise InvalidRequestError(
            f"{path or 'request'}: unknown field number {unknown[0]}, refused (nothing is ignored)"
        )
    for descriptor, value in msg.ListFields():
        if (
            descriptor.message_type is not None
            and not descriptor.message_type.GetOptions().map_entry
        ):
            for item in value if descriptor.is_repeated else [value]:
                _refuse_unknown(item, path + ("." if path else "") + descriptor.name)


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """`value` as an error message may echo it: quoted, and cut to `limit` characters."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


async def prepare_off_loop(
    msg: pb.GenerateRequest,
    tokenizer: Tokenizer,
    model: ModelInfo,
    max_tokens_limit: int | None,
    pool: TokenizePool,
    omitted_max_tokens: int | None = None,
) -> Prepared:
    """`prepare` without holding up the event loop: a long input is tokenized in the pool,
    shortest first (milliseconds); a short one here (tens of microseconds, less than the
    hop)."""
    run = functools.partial(prepare, msg, tokenizer, model, max_tokens_limit, omitted_max_tokens)
    size = msg.ByteSize()
    return run() if size <= INLINE_BYTES else await pool.run(size, run)


def _id(value: str, name: str) -> str | None:
    if not value:
        return None
    if not ID_PATTERN.fullmatch(value):
        raise InvalidRequestError(
            f"{name}: must be 1-128 characters of letters, digits and . _ : -, got {shown(value)}"
        )
    return value


def _prompt_ids(msg: pb.GenerateRequest, tokenizer: Tokenizer, model: ModelInfo) -> list[int]:
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("input: set one of text, chat or token_ids")
    chars = len(msg.text) + sum(len(m.content) for m in msg.chat.messages)
    if chars > model.max_model_len * MAX_CHARS_PER_TOKEN:
        raise InvalidRequestError(
            f"{kind}: {chars} characters cannot fit the model's context of "
            f"{model.max_model_len} tokens"
        )
    if kind == "token_ids":
        ids = list(msg.token_ids.ids)
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token_ids: id {bad[0]} is outside the vocabulary [0, {model.vocab_size})"
            )
    elif kind == "text":
        if not msg.text:
            raise InvalidRequestError("text: must not be empty")
        special = msg.add_special_tokens if msg.HasField("add_special_tokens") else True
        _refuse_past_context(tokenizer, msg.text, special, model, kind)
        ids = tokenizer.encode(msg.text, special_tokens=special)
    else:
        text = _render(msg.chat, tokenizer)
        special = msg.add_special_tokens  # False unless asked: the template writes its own
        _refuse_past_context(tokenizer, text, special, model, kind)
        ids = tokenizer.encode(text, special_tokens=special)
    if not ids:
        raise InvalidRequestError(f"{kind}: the prompt has no tokens")
    refuse_long_prompt(kind, len(ids), model.max_model_len)
    return ids


def _refuse_past_context(
    tokenizer: Tokenizer, text: str, special_tokens: bool, model: ModelInfo, kind: str
) -> None:
    """A long text that cannot fit is refused once its count passes the context, before it
    is tokenized whole (router/token_count.py)."""
    if len(text) <= CHUNK_CHARS:
        return  # one chunk: tokenized whole, then checked
    limit = model.max_model_len
    if count_tokens(tokenizer, text, limit, special_tokens) >= limit:
        raise InvalidRequestError(
            f"{kind}: the prompt is more than {limit - 1} tokens; the model's context is "
            f"{limit} tokens, one of them for the reply"
        )


def _render(chat: pb.Chat, tokenizer: Tokenizer) -> str:
    """The chat as its template writes it; tools the template ignores are in the default
    tool prompt (router/tools.py)."""
    kwargs = chat.template_kwargs
    variables = _json("chat.template_kwargs", kwargs, dict) if kwargs else None
    generation = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    messages, tools = _messages(chat), _tools(chat.tools)
    if tools and not tokenizer.reads("tools"):
        messages, tools = with_tool_prompt(messages, tools), None
    return tokenizer.apply_chat_template(messages, tools, generation, variables)


def _messages(chat: pb.Chat) -> list[dict[str, str]]:
    if not chat.messages:
        raise InvalidRequestError("chat.messages: must not be empty")
    if len(chat.messages) > MAX_MESSAGES:
        raise InvalidRequestError(f"chat.messages: at most {MAX_MESSAGES} messages")
    for i, m in enumerate(chat.messages):
        if m.role not in ROLES:
            raise InvalidRequestError(
                f"chat.messages[{i}].role: must be one of {ROLES}, got {shown(m.role)}"
            )
    return [_message(i, m) for i, m in enumerate(chat.messages)]


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it (HF's convention: a call's arguments as an
    object, a tool result with the id of the call it answers)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = _json(f"chat.messages[{i}].tool_calls", m.tool_calls, list)
        out["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _tools(tools: str) -> list[Any] | None:
    return _json("chat.tools", tools, list) if tools else None


def _json(name: str, text: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{name}: not JSON: {e}") from None
    if not isinstance(value, kind):
        raise InvalidRequestError(f"{name}: must be a JSON {kind.__name__}")
    return value


MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1024


def _structured(s: pb.StructuredOutput, vocab_size: int) -> Structured:
    """The grammar a request's output keeps to; whether it compiles is the worker's word."""
    thoughts: dict[str, Any] = {}
    for name in ("reasoning_end", "reasoning_start"):
        if s.HasField(name):
            if not 0 <= getattr(s, name) < vocab_size:
                raise InvalidRequestError(
                    f"sampling.structured.{name}: token id {getattr(s, name)} is outside the "
                    f"vocabulary [0, {vocab_size})"
                )
            thoughts[name] = getattr(s, name)
    if "reasoning_start" in thoughts and "reasoning_end" not in thoughts:
        raise InvalidRequestError("sampling.structured.reasoning_start: needs reasoning_end")
    kind = s.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("sampling.structured: set one kind")
    if kind == "json_object":
        return Structured(kind, "", **thoughts)
    if kind == "choice":
        choices = list(s.choice.choices)
        if not choices or len(choices) > MAX_CHOICES or not all(choices):
            raise InvalidRequestError(
                f"sampling.structured.choice: 1-{MAX_CHOICES} non-empty strings"
            )
        spec = json.dumps(choices)
    else:
        spec = getattr(s, kind)
        if kind == "json_schema":
            try:
                json.loads(spec)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(
                    f"sampling.structured.json_schema: not JSON: {e}"
                ) from None
    if not spec or len(spec) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(
            f"sampling.structured.{kind}: 1-{MAX_GRAMMAR_CHARS} characters, got {len(spec)}"
        )
    return Structured(kind, spec, **thoughts)


def _sampling(s: pb.SamplingParams, model: ModelInfo, limit: int) -> SamplingParams:
    def bad(name: str, why: str) -> InvalidRequestError:
        return InvalidRequestError(f"sampling.{name}: {why}")

    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):  # fmt: skip
        if s.HasField(name) and not math.isfinite(getattr(s, name)):
            raise bad(name, "must be a finite number")
    if s.HasField("max_tokens") and not 1 <= s.max_tokens <= limit:
        raise bad("max_tokens", f"must be in [1, {limit}], got {s.max_tokens}")
    if len(s.stop) > MAX_STOP or any(len(x) > MAX_STOP_CHARS for x in s.stop):
        raise bad("stop", f"at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
    outside = [t for t in s.stop_token_ids if not 0 <= t < model.vocab_size]
    if outside:
        raise bad("stop_token_ids", f"id {outside[0]} is outside the vocabulary")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens")
    for token, bias in s.logit_bias.items():
        if not 0 <= token < model.vocab_size:
            raise bad("logit_bias", f"token id {token} is outside the vocabulary")
        if not math.isfinite(bias):
            raise bad("logit_bias", f"the bias of token {token} must be a finite number")
    fields = {name: getattr(s, name) for name in OPTIONAL if s.HasField(name)}
    if s.HasField("structured"):
        fields["structured"] = _structured(s.structured, model.vocab_size)
    try:
        return SamplingParams(
            **fields,
            stop_token_ids=tuple(s.stop_token_ids),
            stop=tuple(s.stop),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs,
            logit_bias=tuple(sorted(s.logit_bias.items())),
            min_tokens=s.min_tokens,
            top_logprobs=s.top_logprobs,
            include_stop_str_in_output=s.include_stop_str_in_output,
        )
    except InvalidRequestError as e:
        raise InvalidRequestError(f"sampling.{e}") from None
