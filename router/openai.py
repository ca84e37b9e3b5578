"""The OpenAI-compatible HTTP front door, on the same router core as the gRPC API.

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events
ending in `data: [DONE]`, or one JSON body), GET /v1/models, /health and /metrics.

A body becomes the gRPC API's GenerateRequest and is checked by the same `prepare`, so
both front doors accept and refuse the same requests with the same messages. Errors
have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
field (the message and `param` name it), 404 for another model's name, 429 when a limit
refuses it, naming it (the router is full, the client is past its own limit: by its
`Authorization` header if it sends one, else by its address; or the tokenization queue
is full), 401 for a /v1/, tokenizer or /metrics request without the API key (when one is
set; /health and /version stay open), 503 with no live decode worker, 500 when a worker
failed the request. A stream that fails after its first event ends with an error event,
never `[DONE]`. A client that disconnects has its request aborted on every worker (its
pages are freed). The session header `X-Session-Id` gives a conversation's turns the
same worker.

As vLLM: a completion without max_tokens stops at 16 tokens, a chat may fill the context;
with a reasoning parser (router/reasoning.py) a chat's thoughts come apart as
`reasoning_content`; tool calls (router/tools.py) stream as they are made when the reply
is held to them or written in Hermes blocks, else they are read from the whole reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from cluster.engine.model.tokenizer import Tokenizer
from cluster.types import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    InvalidRequestError,
    ModelInfo,
    PromptLogprob,
    RequestId,
    TokenDelta,
    TopLogprobs,
)
from router import admission, cors, lab
from router.auth import UNAUTHORIZED, http_middleware
from router.errors import Overloaded, RequestFailed, Unavailable
from router.metrics import RouterMetrics
from router.reasoning import ReasoningSplit
from router.request import Prepared, prepare_off_loop, shown
from router.router import Final, Router
from router.tokenize_pool import TokenizePool
from router.tools import CallStream, HermesStream, ToolCall, Tools, parser_for, read_tools
from splitserve_api.v1 import splitserve_pb2 as pb

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
MAX_BODY_BYTES = 4 * 2**20
# Connections the kernel holds for accept(): aiohttp's 128 dropped part of a burst of new
# clients, who waited a 1 s SYN retransmit to be refused; the kernel caps it (somaxconn).
BACKLOG = 4096
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts per completions request
# A completion without max_tokens stops here (OpenAI's and vLLM's default); a chat's reply
# may fill what the context leaves.
COMPLETION_MAX_TOKENS = 16
GENERATE = ("/v1/chat/completions", "/v1/completions")  # the routes that take a slot


class HTTPError(Exception):
    """An error answered in OpenAI's shape with this status."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.kind}}  # fmt: skip


# The shared checks name fields as the gRPC API spells them; here, as OpenAI's body does.
OPENAI_NAMES = (("sampling.", ""), ("chat.messages", "messages"), ("token_ids", "prompt"),
                ("text", "prompt"), ("structured", "response_format"),
                ("chat.template_kwargs.reasoning_effort", "reasoning_effort"),
                ("chat.template_kwargs", "chat_template_kwargs"))  # fmt: skip


def invalid(e: InvalidRequestError) -> HTTPError:
    message = str(getattr(e, "cause", e))  # a worker's refusal arrives wrapped by Ray
    for ours, theirs in OPENAI_NAMES:
        if message.startswith(ours):
            message = theirs + message[len(ours) :]
            break
    field = message.split(":", 1)[0] if ":" in message else None
    return HTTPError(400, message, "invalid_request_error", field)


# --- OpenAI body -> GenerateRequest -----------------------------------------------------


@dataclass(frozen=True)
class Call:
    requests: tuple[pb.GenerateRequest, ...]  # one per prompt (completions take a list)
    chat: bool
    stream: bool
    include_usage: bool
    logprobs: bool
    n: int = 1  # choices per prompt: the same prompt sampled n times (`_choices`)
    tools: Tools | None = None  # a chat's tools (router/tools.py)
    best_of: int = 1  # candidates per prompt (n unless completions ask more), n likeliest kept
    echo: bool = False  # completions: the prompt's text leads each choice's

    @property
    def request(self) -> pb.GenerateRequest:
        return self.requests[0]


# The fields that hold the output to a grammar: OpenAI's, vLLM's older and newer spellings.
STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "structured_outputs")  # fmt: skip
# Every body field either changes what is served as asked (read by `to_call`) or is in
# UNSERVED; any other field is refused by name, so no field is accepted and ignored.
COMMON = {"model", "max_tokens", "temperature", "top_p", "min_p", "top_k", "seed", "stop",
          "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "n",
          "logprobs", "stream", "stream_options", "user", "request_id", *STRUCTURED}  # fmt: skip
# `user`, `prompt_cache_key`, `safety_identifier` and `metadata` identify, they change
# nothing served. Accepted as they are.
INERT = {"user", "prompt_cache_key", "safety_identifier", "metadata"}
HONOURED = {
    True: COMMON | INERT | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                            "tool_choice", "parallel_tool_calls", "add_special_tokens",
                            "add_generation_prompt", "chat_template_kwargs", "reasoning_effort"},
    False: COMMON | INERT | {"prompt", "best_of", "echo", "add_special_tokens"},
}  # fmt: skip
# Fields not served, with the values that ask for nothing (then they are accepted): any
# other value is refused with a 400 naming the field.
UNSERVED: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (True, False),
    "functions": ([],), "function_call": ("none",),
    "echo": (False,), "suffix": ("",), "best_of": (1,), "audio": (), "modalities": (["text"],),
    "prediction": (), "reasoning_effort": (), "web_search_options": (), "verbosity": (),
    "store": (False,), "service_tier": ("auto", "default"), "guided_decoding_backend": (),
    "guided_whitespace_pattern": (), "structural_tag": (),
    "prompt_logprobs": (), "allowed_token_ids": (), "bad_words": ([],),
    "use_beam_search": (False,), "length_penalty": (1,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "add_generation_prompt": (True,), "continue_final_message": (False,),
    "chat_template": (), "chat_template_kwargs": ({},),
    "documents": (), "mm_processor_kwargs": (), "priority": (0,), "logits_processors": (),
    "return_tokens_as_token_ids": (False,), "cache_salt": (), "kv_transfer_params": (),
    "vllm_xargs": (),
}  # fmt: skip


def _asks_nothing(value: Any, neutral: tuple[Any, ...]) -> bool:
    return value is None or any(
        value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral
    )


def _refuse_unserved(body: dict[str, Any], chat: bool) -> None:
    for name, value in body.items():
        if name in HONOURED[chat]:
            continue
        if name not in UNSERVED:
            raise InvalidRequestError(f"{name}: unknown field, refused (nothing is ignored)")
        if not _asks_nothing(value, UNSERVED[name]):
            raise InvalidRequestError(f"{name}: not served here, got {json.dumps(value)[:40]}")


def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise InvalidRequestError(f"{name}: must be {what}, got {json.dumps(value)[:40]}")
    return value


def to_call(body: Any, chat: bool, session_id: str | None) -> Call:
    """An OpenAI request body as a GenerateRequest; InvalidRequestError names the field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body: must be a JSON object")
    _refuse_unserved(body, chat)
    msg = pb.GenerateRequest(session_id=session_id or "")
    prompts: list[Any] = []  # completions: each prompt after the first is a request too
    tools: Tools | None = None  # chat
    model = _field(body, "model", (str,), "a string")
    if model:
        msg.model = model
    request_id = _field(body, "request_id", (str,), "a string")
    if request_id:
        msg.request_id = request_id
    if chat:
        messages = _field(body, "messages", (list,), "a list of messages")
        if messages is None:
            raise InvalidRequestError("messages: required")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidRequestError(f"messages[{i}]: must be an object")
            role = "system" if m.get("role") == "developer" else str(m.get("role"))
            calls = m.get("tool_calls")
            content = m.get("content")
            text = "" if content is None and calls else _content(content, i)
            msg.chat.messages.add(role=role, content=text, tool_calls=_calls(calls, i),
                                  tool_call_id=str(m.get("tool_call_id") or ""))  # fmt: skip
        if not messages:
            msg.chat.SetInParent()  # prepare says what is wrong with no messages
        _template(body, msg.chat)
        tools = read_tools(body.get("tools"), body.get("tool_choice"),
                           body.get("parallel_tool_calls"))  # fmt: skip
        if tools is not None:
            msg.chat.tools = json.dumps(body["tools"])
    else:
        given = body.get("prompt")
        many = isinstance(given, list) and given and all(isinstance(p, str | list) for p in given)
        prompts = list(given) if many else [given]  # type: ignore[arg-type]
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequestError(f"prompt: at most {MAX_PROMPTS} prompts per request")
        _prompt(msg, prompts[0])
    special = _field(body, "add_special_tokens", (bool,), "true or false")
    if special is not None:
        msg.add_special_tokens = special
    _sampling(body, msg.sampling)
    _structured(body, msg.sampling.structured)
    schema = None if tools is None else tools.schema()
    if schema is not None:
        if msg.sampling.HasField("structured"):
            raise InvalidRequestError("tool_choice: forces a call; give no response_format too")
        msg.sampling.structured.json_schema = json.dumps(schema)
    n = _field(body, "n", (int,), "an integer") or 1
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n: must be in [1, {MAX_N}], got {n}")
    _field(body, "user", (str,), "a string")
    logprobs, top = _logprobs(body, chat)
    msg.sampling.logprobs = logprobs
    msg.sampling.top_logprobs = top
    stream = bool(_field(body, "stream", (bool,), "true or false"))
    options = _field(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise InvalidRequestError("stream_options: only with stream: true")
    include_usage = bool(_field(options or {}, "include_usage", (bool,), "true or false"))
    requests = [msg]
    for prompt in prompts[1:]:
        other = pb.GenerateRequest()
        other.CopyFrom(msg)
        other.ClearField("text")
        other.ClearField("token_ids")
        _prompt(other, prompt)
        requests.append(other)
    best_of, echo = n, False
    if not chat:
        best_of = _field(body, "best_of", (int,), "an integer") or n
        if not n <= best_of <= MAX_N:
            raise InvalidRequestError(f"best_of: must be in [n, {MAX_N}], got {best_of}")
        if best_of > n and stream:
            raise InvalidRequestError("best_of: cannot be streamed (the best are known at the end)")
        echo = bool(_field(body, "echo", (bool,), "true or false"))
        for m in requests:  # the candidates are ranked by their tokens' logprobs
            if echo and logprobs:  # echoed, the prompt's tokens come with theirs too
                m.sampling.prompt_logprobs = top
            m.sampling.logprobs = m.sampling.logprobs or best_of > n
    return Call(tuple(requests), chat, stream, include_usage, logprobs, n, tools, best_of, echo)


def _sampling(body: dict[str, Any], s: pb.SamplingParams) -> None:
    max_tokens = _field(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None:
        s.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):  # fmt: skip
        value = _field(body, name, (int, float), "a number")
        if value is not None:
            setattr(s, name, value)
    for name in ("seed", "top_k", "min_tokens"):
        value = _field(body, name, (int,), "an integer")
        if value is not None:
            setattr(s, name, _SPELLINGS.get(name, lambda v: v)(value))
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise InvalidRequestError("stop: must be a string or a list of strings")
        s.stop.extend(stops)
    ids = _field(body, "stop_token_ids", (list,), "a list of token ids") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("stop_token_ids: must be a list of token ids")
    s.stop_token_ids.extend(ids)
    bias = _field(body, "logit_bias", (dict,), "an object of token id: bias") or {}
    for token, value in bias.items():
        if (
            not str(token).isdigit()
            or not isinstance(value, int | float)
            or isinstance(value, bool)
        ):
            raise InvalidRequestError(
                f"logit_bias: must map token ids to numbers, got {json.dumps({token: value})[:40]}"
            )
        s.logit_bias[int(token)] = float(value)
    s.ignore_eos = bool(_field(body, "ignore_eos", (bool,), "true or false"))
    s.include_stop_str_in_output = bool(
        _field(body, "include_stop_str_in_output", (bool,), "true or false")
    )


def _seed(value: int) -> int:
    """Any seed of torch's 64 bits (vLLM takes int64's range; OpenAI's clients send either),
    as the API's int64 carries it: one at or above 2^63 is the same seed 2^64 below."""
    if not -(2**63) <= value < 2**64:
        raise InvalidRequestError(f"seed: must be in [-2**63, 2**64 - 1], got {value}")
    return value - 2**64 if value >= 2**63 else value


def _top_k(value: int) -> int:
    """vLLM's -1 for off is the API's 0."""
    if value < -1:
        raise InvalidRequestError(f"top_k: must be -1 or 0 (off) or a positive count, got {value}")
    return max(value, 0)


_SPELLINGS = {"seed": _seed, "top_k": _top_k}


def _template(body: dict[str, Any], chat: pb.Chat) -> None:
    """What a chat's template is given beyond the messages: whether it ends with the
    reply's start, and more variables (`chat_template_kwargs`, and `reasoning_effort` as
    vLLM passes it); the template must read every one (router/request.py)."""
    generation = _field(body, "add_generation_prompt", (bool,), "true or false")
    if generation is not None:
        chat.add_generation_prompt = generation
    variables = dict(_field(body, "chat_template_kwargs", (dict,), "an object") or {})
    effort = _field(body, "reasoning_effort", (str,), "a string")
    if effort is not None:
        variables["reasoning_effort"] = effort
    if variables:
        chat.template_kwargs = json.dumps(variables)


def _structured(body: dict[str, Any], out: pb.StructuredOutput) -> None:
    """The grammar the output keeps to, from whichever one field gives it."""
    given = [name for name in STRUCTURED if body.get(name) is not None]
    given = [n for n in given if not (n == "response_format" and body[n] == {"type": "text"})]
    if len(given) > 1:
        raise InvalidRequestError(f"{given[1]}: give one of {', '.join(given)}, not both")
    if not given:
        return
    name, value = given[0], body[given[0]]
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            out.json_object = True
        elif kind == "json_schema" and isinstance(value.get("json_schema"), dict):
            _json_schema(name, value["json_schema"].get("schema", {}), out)
        else:
            raise InvalidRequestError(
                f"{name}: must be {{'type': 'text' | 'json_object' | 'json_schema', "
                f"'json_schema': {{'schema': ...}}}}, got {json.dumps(value)[:60]}"
            )
    elif name == "structured_outputs":
        if not isinstance(value, dict) or len(value) != 1:
            raise InvalidRequestError(
                f"{name}: one of json, json_object, regex, choice, grammar, "
                f"got {json.dumps(value)[:60]}"
            )
        ((key, inner),) = value.items()
        vllm = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                "grammar": "guided_grammar"}  # fmt: skip
        if key == "json_object" and inner is True:
            out.json_object = True
        elif key in vllm:
            _structured({vllm[key]: inner}, out)
        else:
            raise InvalidRequestError(f"{name}: unknown kind {key!r}")
    elif name == "guided_json":
        _json_schema(name, value, out)
    elif name == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"{name}: must be a list of strings")
        out.choice.choices.extend(value)
    else:
        if not isinstance(value, str):
            raise InvalidRequestError(f"{name}: must be a string")
        setattr(out, "regex" if name == "guided_regex" else "grammar", value)


def _json_schema(name: str, schema: Any, out: pb.StructuredOutput) -> None:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{name}: the schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{name}: the schema must be a JSON object")
    out.json_schema = json.dumps(schema)


def _calls(calls: Any, i: int) -> str:
    """An assistant message's tool_calls as the proto carries them: a JSON list of
    {"name", "arguments"}, the arguments an object (OpenAI sends them as JSON text)."""
    if not calls:
        return ""
    try:
        out = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
               for c in calls]  # fmt: skip
    except (TypeError, KeyError, json.JSONDecodeError):
        raise InvalidRequestError(
            f"messages[{i}].tool_calls: each {{'function': {{'name', 'arguments': JSON}}}}"
        ) from None
    return json.dumps(out)


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or a list of text parts (the only kind served)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(f"messages[{i}].content: must be a string or a list of text parts")


def _prompt(msg: pb.GenerateRequest, prompt: Any) -> None:
    if isinstance(prompt, str):
        msg.text = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        msg.token_ids.ids.extend(prompt)
    elif prompt is None:
        raise InvalidRequestError("prompt: required")
    else:
        raise InvalidRequestError(
            "prompt: must be a string, a list of token ids, or a list of either"
        )


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """Whether the chosen tokens' logprobs are asked for, and how many alternatives with
    each. Chat: `logprobs: true` and `top_logprobs: k`; completions: `logprobs: k`."""
    if chat:
        asked = bool(_field(body, "logprobs", (bool,), "true or false"))
        top = _field(body, "top_logprobs", (int,), "an integer") or 0
        if top and not asked:
            raise InvalidRequestError("top_logprobs: needs logprobs: true")
    else:
        value = _field(body, "logprobs", (int,), "an integer")
        asked, top = value is not None, value or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise InvalidRequestError(f"{name}: must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return asked, top


# --- responses ---------------------------------------------------------------------------


@dataclass
class Reply:
    """What a request's stream added up to."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # when asked for
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when asked for
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # echo with logprobs
    finish: str | None = None
    final: Final | None = None


def _usage(finals: dict[int, Final], n: int) -> dict[str, Any]:
    """Each prompt's tokens once (its choice 0's), every choice's completion; by index."""
    firsts = [f.usage for i, f in finals.items() if i % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(f.usage.completion_tokens for f in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in firsts)},
    }


def _best(replies: list[Reply], best_of: int, n: int) -> list[Reply]:
    """Of each prompt's best_of candidates, the n whose tokens are likeliest together."""
    groups = [replies[k : k + best_of] for k in range(0, len(replies), best_of)]
    return [r for g in groups for r in sorted(g, key=lambda r: -sum(r.logprobs))[:n]]


def _child(p: Prepared, i: int) -> Prepared:
    """Choice i of a request: the same prompt, its own id, and, when seeded, seed + i (an
    unseeded one gets a random seed of its own in the router)."""
    sampling = p.sampling
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
    rid = None if p.request_id is None else RequestId(f"{p.request_id}-{i}")
    return dataclasses.replace(p, sampling=sampling, request_id=rid)


class OpenAIFrontDoor:
    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        model: ModelInfo,
        max_tokens: int | None,
        metrics: RouterMetrics,
        serving: Callable[[], bool],
        pool: TokenizePool,
        api_key: tuple[str, ...] | None = None,  # any one of them
        allowed_origins: tuple[str, ...] = (),
        routes: Sequence[web.RouteDef] = (),  # more pages: splitserve's lab
        reasoning_parser: str | None = None,  # router/reasoning.py's; None: no split
        tool_parser: str | None = None,  # router/tools.py's; None: the template's
    ) -> None:
        self.router = router
        self.routes = routes
        self.api_key = api_key
        self.allowed_origins = allowed_origins  # CORS (router/cors.py); empty: off
        self.pool = pool
        self.tokenizer = tokenizer
        self.model = model
        self.max_tokens = max_tokens
        self.tool_parser = tool_parser or parser_for(getattr(tokenizer.hf, "chat_template", None))
        self.reasoning_parser = reasoning_parser
        # What a request leaves out gets the model's generation config, else OpenAI's 1.0.
        self.sampling_defaults = {"temperature": 1.0, **dict(model.sampling_defaults)}
        self.metrics = metrics
        self.serving = serving
        self.runner: web.AppRunner | None = None
        self.address = ""

    def app(self) -> web.Application:
        middlewares: list[Middleware] = [_errors_as_json]
        if self.allowed_origins:  # before the key: a browser's preflight carries none
            middlewares.append(cors.preflight(self.allowed_origins))
        if self.api_key is not None:
            middlewares.append(http_middleware(self.api_key, _unauthorized))
        # Last, so a client without the key learns that first; before any body is read.
        middlewares.append(admission.http_middleware(self.router, GENERATE, self._full))
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        if self.allowed_origins:
            app.on_response_prepare.append(cors.allow_origin(self.allowed_origins))
        app.router.add_post(GENERATE[0], self._chat)
        app.router.add_post(GENERATE[1], self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/version", self._version)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self.metrics.scrape)
        app.router.add_get("/lab/live", self._lab_live)
        app.router.add_routes(self.routes)
        return app

    async def start(
        self, host: str, port: int, grace_s: float, tls: ssl.SSLContext | None = None
    ) -> None:
        """Serve on host:port (0: any free port), over TLS with `tls` (router/tls.py); on
        stop, requests in flight get grace_s."""
        # handler_cancellation: a client that goes away cancels its handler at once, even
        # while it waits for a first token, so the request is aborted on every worker.
        self.runner = web.AppRunner(
            self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=grace_s
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, backlog=BACKLOG, ssl_context=tls)
        await site.start()
        bound = self.runner.addresses[0]
        self.address = f"{'http' if tls is None else 'https'}://{bound[0]}:{bound[1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # --- handlers ---

    async def _lab_live(self, request: web.Request) -> web.Response:
        return web.json_response(lab.live(self.router, self.metrics))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    def _card(self) -> dict[str, Any]:
        return {"id": self.model.name, "object": "model", "created": 0, "owned_by": "splitserve",
                "max_model_len": self.model.max_model_len}  # fmt: skip

    def _check_model(self, name: str | None) -> None:
        if name and name != self.model.name:
            raise HTTPError(404, f"model: {shown(name)} is not served here (serving "
                            f"{self.model.name!r})", "model_not_found", "model")  # fmt: skip

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def _model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._card())

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the ids a completion's `prompt` or a chat's `messages` become
        (with `add_special_tokens`; a chat's `add_generation_prompt`, template variables and
        tools too), checked as a request with them would be; `return_token_strs` adds each
        id's token as a string."""
        body = await _body(request)
        try:
            strs = _field(body, "return_token_strs", (bool,), "true or false")
            body = {k: v for k, v in body.items() if k != "return_token_strs"}
            call = to_call(body, "messages" in body, None)
            self._check_model(call.request.model)
            args = (call.request, self.tokenizer, self.model, self.max_tokens, self.pool)
            ids = (await prepare_off_loop(*args)).prompt_ids
        except InvalidRequestError as e:
            raise invalid(e) from None
        tokens = self.tokenizer.hf.convert_ids_to_tokens(ids) if strs else None
        return web.json_response({"count": len(ids), "max_model_len": self.model.max_model_len,
                                  "tokens": ids, "token_strs": tokens})  # fmt: skip

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: `tokens` (ids) as text."""
        body = await _body(request)
        try:
            if extra := sorted(set(body) - {"model", "tokens"}):
                raise InvalidRequestError(f"{extra[0]}: unknown field, refused")
            self._check_model(_field(body, "model", (str,), "a string"))
            ids = _field(body, "tokens", (list,), "a list of token ids")
            if ids is None or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.model.vocab_size
                for t in ids
            ):
                raise InvalidRequestError(
                    f"tokens: must be a list of token ids in [0, {self.model.vocab_size})"
                )
        except InvalidRequestError as e:
            raise invalid(e) from None
        return web.json_response({"prompt": self.tokenizer.decode(ids)})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": version("splitserve")})

    async def _health(self, request: web.Request) -> web.Response:
        ok = self.serving()
        return web.json_response({"status": "ok" if ok else "no decode worker"},
                                 status=200 if ok else 503)  # fmt: skip

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        status = "cancelled"  # unless it ends otherwise: the client went away
        try:
            try:
                with self.router.in_flight(_client(request)):  # before tokenizing
                    response, status = await self._answer(request, chat)
            except Overloaded as e:
                status = "rate_limit_exceeded"
                return self._overloaded(e)
            return response
        except HTTPError as e:
            status = e.kind
            return web.json_response(e.body(), status=e.status)
        finally:
            self.metrics.requests.labels(status).inc()

    def _overloaded(self, e: Overloaded) -> web.Response:
        """429 naming the limit, with Retry-After."""
        self.metrics.refusals.labels(e.limit).inc()
        body = HTTPError(429, str(e), "rate_limit_exceeded").body()
        return web.json_response(body, status=429, headers=admission.retry_after())

    def _full(self, e: Overloaded) -> web.Response:
        """The admission middleware's refusal: the handler never runs to count it."""
        self.metrics.requests.labels("rate_limit_exceeded").inc()
        return self._overloaded(e)

    async def _answer(self, request: web.Request, chat: bool) -> tuple[web.StreamResponse, str]:
        call, prepared = await self._prepare(request, chat)
        if call.stream and (call.tools is None or self._streams_calls(call.tools)):
            return await self._stream(request, call, prepared)
        replies = await self._collect(prepared, call.best_of)
        if call.best_of > call.n:
            replies = _best(replies, call.best_of, call.n)
        if call.stream:  # calls in another format: read from the whole reply
            return await self._stream_whole(request, call, replies), "ok"
        return web.json_response(self._body(call, replies)), "ok"

    def _streams_calls(self, tools: Tools) -> bool:
        """Whether a stream's tool calls go out as they come (forced ones, Hermes blocks)."""
        return tools.schema() is not None or (
            tools.choice == "auto" and self.tool_parser == "hermes"
        )

    async def _prepare(self, request: web.Request, chat: bool) -> tuple[Call, list[Prepared]]:
        body = await _body(request)
        try:
            call = to_call(body, chat, request.headers.get(SESSION_HEADER))
            self._check_model(call.request.model)
            if chat and self.reasoning_parser and call.request.sampling.HasField("structured"):
                given = "tool_choice" if call.tools is not None else "response_format"
                raise InvalidRequestError(
                    f"{given}: structured output is not served with the reasoning parser "
                    f"({self.reasoning_parser}): the grammar would hold the thoughts too"
                )
            if call.tools is not None and call.tools.choice == "auto" and not self.tool_parser:
                raise InvalidRequestError(
                    "tools: no tool-call parser fits this model's chat template (Hermes "
                    "<tool_call> or Llama 3 JSON); tool_choice required or a named function "
                    "work without one"
                )
            prepared = []
            for msg in call.requests:
                for name, value in self.sampling_defaults.items():
                    if not msg.sampling.HasField(name):
                        setattr(msg.sampling, name, value)
                args = (msg, self.tokenizer, self.model, self.max_tokens, self.pool)
                omitted = self.model.max_model_len if chat else COMPLETION_MAX_TOKENS
                prepared.append(await prepare_off_loop(*args, omitted_max_tokens=omitted))
            return call, prepared
        except InvalidRequestError as e:
            raise invalid(e) from None

    async def _deltas(self, p: Prepared) -> AsyncIterator[tuple[TokenDelta, Final | None]]:
        """The router's stream, its errors as HTTPErrors, its latencies recorded."""
        try:
            last: float | None = None
            async for delta, final in self.router.generate(p, admitted=True):
                last = self.metrics.observe(delta, final, last)
                yield delta, final
        except InvalidRequestError as e:
            raise invalid(e) from None
        except Unavailable as e:
            raise HTTPError(503, str(e), "service_unavailable") from None
        except RequestFailed as e:
            raise HTTPError(500 if e.reason is FinishReason.ERROR else 503, str(e),
                            "server_error") from None  # fmt: skip
        except Exception as e:  # a bug of ours: say so, and keep serving
            log.exception("HTTP generate failed")
            raise HTTPError(500, f"internal error: {e}", "server_error") from None

    async def _choices(
        self, prompts: list[Prepared], n: int
    ) -> AsyncIterator[tuple[int, TokenDelta, Final | None]]:
        """Every choice's deltas as they come, with its index (prompt k's choice i is
        k * n + i, as OpenAI numbers them). The prompts run together; of each prompt's n
        choices, choice 0 runs alone until its first token: the others, the same prompt,
        then find its KV pages in the prefix cache, so the prompt is prefilled once and its
        full pages are shared (the last, partial one each request computes and owns)."""
        children = [p if n == 1 else _child(p, i) for p in prompts for i in range(n)]
        queue: asyncio.Queue[tuple[int, TokenDelta | Exception | None, Final | None]]
        queue = asyncio.Queue()

        async def run(i: int) -> None:
            try:
                async for delta, final in self._deltas(children[i]):
                    queue.put_nowait((i, delta, final))
            except Exception as e:
                queue.put_nowait((i, e, None))
            else:
                queue.put_nowait((i, None, None))

        tasks = [asyncio.create_task(run(k * n)) for k in range(len(prompts))]
        try:
            ended = 0
            while ended < len(children):
                i, got, final = await queue.get()
                if isinstance(got, Exception):
                    raise got
                if i % n == 0 and n > 1 and got is not None and got.index == 0:
                    # choice 0's first token: its prompt is cached for the others
                    tasks += [asyncio.create_task(run(i + j)) for j in range(1, n)]
                if got is None:
                    ended += 1
                    continue
                yield i, got, final
        finally:
            for task in tasks:  # a choice still running is aborted on its workers
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, prompts: list[Prepared], n: int) -> list[Reply]:
        replies = [Reply() for _ in range(len(prompts) * n)]
        async for i, delta, final in self._choices(prompts, n):
            reply = replies[i]
            reply.text += delta.text
            reply.token_ids.extend(delta.token_ids)
            reply.logprobs.extend(delta.logprobs)
            reply.top_logprobs.extend(delta.top_logprobs)
            reply.prompt_logprobs = reply.prompt_logprobs or delta.prompt_logprobs
            if delta.finish_reason is not None:
                reply.finish = FINISH.get(delta.finish_reason, "stop")
            reply.final = final or reply.final
        return replies

    def _envelope(self, call: Call, rid: str) -> dict[str, Any]:
        kind = "chat.completion" if call.chat else "text_completion"
        return {"id": rid, "object": kind + (".chunk" if call.stream and call.chat else ""),
                "created": int(time.time()), "model": self.model.name}  # fmt: skip

    def _logprobs(
        self,
        call: Call,
        ids: list[int],
        values: list[float],
        tops: list[TopLogprobs],
        prompt: Sequence[PromptLogprob] | None = None,
    ) -> dict[str, Any]:
        """OpenAI's logprobs: each token's, with its alternatives when asked for."""
        tokens = [self.tokenizer.decode([t]) for t in ids]
        alternatives = [[(self.tokenizer.decode([t]), v) for t, v in top] for top in tops]
        if call.chat:
            content = [
                {"token": t, "logprob": v, "bytes": list(t.encode()),
                 "top_logprobs": [{"token": a, "logprob": w, "bytes": list(a.encode())}
                                  for a, w in (alternatives[i] if alternatives else [])]}
                for i, (t, v) in enumerate(zip(tokens, values, strict=True))
            ]  # fmt: skip
            return {"content": content}
        top: list[dict[str, float] | None] | None = (
            [dict(a) for a in alternatives] if alternatives else None
        )
        given: list[float | None] = list(values)
        if prompt:  # echo: the prompt's tokens first, the first of them with no logprob
            tokens = [self.tokenizer.decode([t]) for t, _, _ in prompt] + tokens
            given = [lp for _, lp, _ in prompt] + given
            if top is not None:
                first = [None if lp is None else {self.tokenizer.decode([t]): w for t, w in alt}
                         for _, lp, alt in prompt]  # fmt: skip
                top = first + top
        return {"tokens": tokens, "token_logprobs": given, "top_logprobs": top,
                "text_offset": None}  # fmt: skip

    def _body(self, call: Call, replies: list[Reply]) -> dict[str, Any]:
        rid = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex
        choices = []
        for i, reply in enumerate(replies):
            logprobs = None
            if call.logprobs:
                logprobs = self._logprobs(
                    call, reply.token_ids, reply.logprobs, reply.top_logprobs,
                    reply.prompt_logprobs,
                )  # fmt: skip
            choice: dict[str, Any] = {"index": i, "finish_reason": reply.finish,
                                      "logprobs": logprobs}  # fmt: skip
            if call.chat:
                reasoning, text = self._reasoning(reply.text)
                content, calls = self._tool_calls(call, text, reply.finish)
                choice["message"] = {"role": "assistant", "content": content}
                if self.reasoning_parser:  # either may be absent (None), as vLLM gives them
                    choice["message"].update(reasoning_content=reasoning, content=content or None)
                if calls:
                    choice["message"]["tool_calls"] = [c.body() for c in calls]
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = self._echo(call, i) + reply.text
            choices.append(choice)
        body = {**self._envelope(call, rid), "choices": choices}
        finals = {i: r.final for i, r in enumerate(replies) if r.final is not None}
        if finals:
            body["usage"] = _usage(finals, call.n)
        return body

    def _echo(self, call: Call, index: int) -> str:
        """The prompt choice `index` answers, as text, when the request asked for echo."""
        if not call.echo:
            return ""
        msg = call.requests[index // call.n]
        return msg.text if msg.HasField("text") else self.tokenizer.decode(list(msg.token_ids.ids))

    def _reasoning(self, text: str) -> tuple[str | None, str]:
        """A chat reply's thoughts (with a reasoning parser) and the rest."""
        if not self.reasoning_parser:
            return None, text
        reasoning, content = ReasoningSplit.of(self.reasoning_parser).whole(text)
        return reasoning, content or ""

    def _tool_calls(
        self, call: Call, text: str, finish: str | None
    ) -> tuple[str | None, list[ToolCall]]:
        if call.tools is None or finish != "stop":
            return text, []
        return call.tools.calls(text, self.tool_parser)

    async def _stream_whole(
        self, request: web.Request, call: Call, replies: list[Reply]
    ) -> web.StreamResponse:
        """Whole replies as one stream: per choice its role, its content, its tool calls
        (each whole), its finish; then usage if asked, then [DONE]."""
        body = self._body(call, replies)
        envelope = {**self._envelope(call, body["id"]), "object": "chat.completion.chunk"}
        response = await self._open(request, call, envelope)
        for choice in body["choices"]:
            message, i = choice["message"], choice["index"]
            delta: dict[str, Any] = {"content": message["content"]} if message["content"] else {}
            if message.get("reasoning_content"):
                delta["reasoning_content"] = message["reasoning_content"]
            if "tool_calls" in message:
                delta["tool_calls"] = [
                    {**c, "index": j} for j, c in enumerate(message["tool_calls"])
                ]
            chunks = [{"index": i, "delta": delta, "logprobs": choice["logprobs"],
                       "finish_reason": None},
                      {"index": i, "delta": {}, "logprobs": None,
                       "finish_reason": choice["finish_reason"]}]  # fmt: skip
            for chunk in chunks:
                await _event(response, {**envelope, "choices": [chunk]})
        if call.include_usage and "usage" in body:
            await _event(response, {**envelope, "choices": [], "usage": body["usage"]})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream(
        self, request: web.Request, call: Call, prompts: list[Prepared]
    ) -> tuple[web.StreamResponse, str]:
        """Server-sent events: one chunk per delta, then usage if asked, then [DONE]. The
        response starts with the first delta, so a refusal still gets its status code;
        a failure after it ends the stream with an error event. Returns how it ended."""
        envelope = self._envelope(call, ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex)
        response: web.StreamResponse | None = None
        finals: dict[int, Final] = {}
        splits: dict[int, ReasoningSplit | CallStream | HermesStream] = {}  # each choice's
        try:
            async for i, delta, last in self._choices(prompts, call.n):
                if response is None:
                    response = await self._open(request, call, envelope)
                if call.tools is not None and i not in splits:  # calls as they come (_answer)
                    forced = call.tools.schema() is not None
                    splits[i] = CallStream(call.tools) if forced else HermesStream(call.tools)
                elif call.chat and self.reasoning_parser and i not in splits:
                    splits[i] = ReasoningSplit.of(self.reasoning_parser)
                chunk = self._chunk(call, delta, i, splits.get(i))
                await _event(response, {**envelope, "choices": [chunk]})
                if last is not None:
                    finals[i] = last
        except HTTPError as e:
            if response is None:
                raise
            await _event(response, e.body())
            await response.write_eof()
            return response, e.kind
        except ConnectionResetError:  # the client left between two events
            assert response is not None
            return response, "cancelled"
        assert response is not None, "a stream ends with a delta that has a finish reason"
        if call.include_usage and finals:
            await _event(response, {**envelope, "choices": [], "usage": _usage(finals, call.n)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response, "ok"

    async def _open(
        self, request: web.Request, call: Call, envelope: dict[str, Any]
    ) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        if call.chat:  # each choice's role comes first, in a chunk of its own
            for i in range(call.n * len(call.requests)):
                first = {"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}  # fmt: skip
                await _event(response, {**envelope, "choices": [first]})
        return response

    def _chunk(
        self,
        call: Call,
        delta: TokenDelta,
        index: int,
        split: ReasoningSplit | CallStream | HermesStream | None,
    ) -> dict[str, Any]:
        finish = None if delta.finish_reason is None else FINISH.get(delta.finish_reason)
        logprobs = None
        if call.logprobs:
            logprobs = self._logprobs(
                call, list(delta.token_ids), list(delta.logprobs), list(delta.top_logprobs),
                delta.prompt_logprobs,
            )  # fmt: skip
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if isinstance(split, CallStream):
            calls = split.feed(delta.text)
            choice["delta"] = {"tool_calls": calls} if calls else {}
            if finish == "stop" and split.calls:
                choice["finish_reason"] = "tool_calls"
        elif isinstance(split, HermesStream):
            content, calls = split.feed(delta.text, final=delta.finish_reason is not None)
            choice["delta"] = {"content": content} if content or not (calls or finish) else {}
            if calls:
                choice["delta"]["tool_calls"] = calls
            if finish == "stop" and split.calls:
                choice["finish_reason"] = "tool_calls"
        elif split is not None:
            reasoning, content = split.feed(delta.text, final=delta.finish_reason is not None)
            choice["delta"] = {"reasoning_content": reasoning} if reasoning else {}
            if content or not (reasoning or finish):
                choice["delta"]["content"] = content
        elif call.chat:
            choice["delta"] = {"content": delta.text} if delta.text or not finish else {}
        else:
            choice["text"] = (self._echo(call, index) if delta.index == 0 else "") + delta.text
        return choice


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"body: not valid JSON: {e}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "body: must be a JSON object", "invalid_request_error", "body")
    return body


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in OpenAI's shape: ours (HTTPError), and aiohttp's own (404, 405, 413)."""
    try:
        return await handler(request)
    except HTTPError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found" if e.status == 404 else "invalid_request_error"
        message = f"{request.method} {request.path}: {e.reason}"
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return web.json_response(HTTPError(e.status, message, kind).body(), status=e.status,
                                 headers=allow)  # fmt: skip


def _unauthorized() -> web.Response:
    body = HTTPError(401, UNAUTHORIZED, "invalid_request_error").body()
    body["error"]["code"] = "invalid_api_key"  # as OpenAI answers a wrong key
    return web.json_response(body, status=401)


def _client(request: web.Request) -> str:
    """Who sent the request, for the per-client limit: its key (`Authorization`) if it
    sent one, else its address."""
    key = request.headers.get("Authorization")
    return f"key {key}" if key else f"peer {request.remote}"


async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())
