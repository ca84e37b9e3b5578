"""OpenAI's request bodies as the gRPC API's GenerateRequest, field by field.

`to_call` reads a chat or completions body into one GenerateRequest per prompt and what
the reply must look like (`Call`); a field it cannot serve as asked is refused with an
InvalidRequestError naming it. The gRPC API's own checks (router/request.py) follow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cluster.types import MAX_TOP_LOGPROBS, InvalidRequestError
from router.tools import Tools, read_tools
from splitserve_api.v1 import splitserve_pb2 as pb

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts per completions request


@dataclass(frozen=True)
class Call:
    requests: tuple[pb.GenerateRequest, ...]  # one per prompt (completions take a list)
    chat: bool
    stream: bool
    include_usage: bool
    logprobs: bool
    n: int = 1  # choices per prompt: the same prompt sampled n times (router/openai.py `_choices`)
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


def body_field(body: dict[str, Any], name: str, kinds: tuple[type, ...], what: str) -> Any:
    """The field's value, None when absent; refused naming it unless of `kinds`."""
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
    model = body_field(body, "model", (str,), "a string")
    if model:
        msg.model = model
    request_id = body_field(body, "request_id", (str,), "a string")
    if request_id:
        msg.request_id = request_id
    if chat:
        messages = body_field(body, "messages", (list,), "a list of messages")
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
    special = body_field(body, "add_special_tokens", (bool,), "true or false")
    if special is not None:
        msg.add_special_tokens = special
    _sampling(body, msg.sampling)
    _structured(body, msg.sampling.structured)
    schema = None if tools is None else tools.schema()
    if schema is not None:
        if msg.sampling.HasField("structured"):
            raise InvalidRequestError("tool_choice: forces a call; give no response_format too")
        msg.sampling.structured.json_schema = json.dumps(schema)
    n = body_field(body, "n", (int,), "an integer") or 1
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n: must be in [1, {MAX_N}], got {n}")
    body_field(body, "user", (str,), "a string")
    logprobs, top = _logprobs(body, chat)
    msg.sampling.logprobs = logprobs
    msg.sampling.top_logprobs = top
    stream = bool(body_field(body, "stream", (bool,), "true or false"))
    options = body_field(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise InvalidRequestError("stream_options: only with stream: true")
    include_usage = bool(body_field(options or {}, "include_usage", (bool,), "true or false"))
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
        best_of = body_field(body, "best_of", (int,), "an integer") or n
        if not n <= best_of <= MAX_N:
            raise InvalidRequestError(f"best_of: must be in [n, {MAX_N}], got {best_of}")
        if best_of > n and stream:
            raise InvalidRequestError("best_of: cannot be streamed (the best are known at the end)")
        echo = bool(body_field(body, "echo", (bool,), "true or false"))
        for m in requests:  # the candidates are ranked by their tokens' logprobs
            if echo and logprobs:  # echoed, the prompt's tokens come with theirs too
                m.sampling.prompt_logprobs = top
            m.sampling.logprobs = m.sampling.logprobs or best_of > n
    return Call(tuple(requests), chat, stream, include_usage, logprobs, n, tools, best_of, echo)


def _sampling(body: dict[str, Any], s: pb.SamplingParams) -> None:
    max_tokens = body_field(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = body_field(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None:
        s.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):  # fmt: skip
        value = body_field(body, name, (int, float), "a number")
        if value is not None:
            setattr(s, name, value)
    for name in ("seed", "top_k", "min_tokens"):
        value = body_field(body, name, (int,), "an integer")
        if value is not None:
            setattr(s, name, _SPELLINGS.get(name, lambda v: v)(value))
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise InvalidRequestError("stop: must be a string or a list of strings")
        s.stop.extend(stops)
    ids = body_field(body, "stop_token_ids", (list,), "a list of token ids") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("stop_token_ids: must be a list of token ids")
    s.stop_token_ids.extend(ids)
    bias = body_field(body, "logit_bias", (dict,), "an object of token id: bias") or {}
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
    s.ignore_eos = bool(body_field(body, "ignore_eos", (bool,), "true or false"))
    s.include_stop_str_in_output = bool(
        body_field(body, "include_stop_str_in_output", (bool,), "true or false")
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
    generation = body_field(body, "add_generation_prompt", (bool,), "true or false")
    if generation is not None:
        chat.add_generation_prompt = generation
    variables = dict(body_field(body, "chat_template_kwargs", (dict,), "an object") or {})
    effort = body_field(body, "reasoning_effort", (str,), "a string")
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
        asked = bool(body_field(body, "logprobs", (bool,), "true or false"))
        top = body_field(body, "top_logprobs", (int,), "an integer") or 0
        if top and not asked:
            raise InvalidRequestError("top_logprobs: needs logprobs: true")
    else:
        value = body_field(body, "logprobs", (int,), "an integer")
        asked, top = value is not None, value or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise InvalidRequestError(f"{name}: must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return asked, top
