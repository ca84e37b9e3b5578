"""OpenAI request bodies become the gRPC API's GenerateRequest; bad ones name the field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict

from cluster.types import InvalidRequestError
from router.openai_reply import invalid
from router.openai_request import HONOURED, INERT, UNSERVED, Call, to_call


def test_a_chat_body_becomes_a_chat_request_with_its_sampling() -> None:
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": parts},
        ],
        "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "\n",
        "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
    }  # fmt: skip
    call = to_call(body, chat=True, session_id="alice")
    msg = call.request
    assert [(m.role, m.content) for m in msg.chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hi there"),
    ]
    s = msg.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, list(s.stop)) == (7, 0, 0.5, 3, ["\n"])
    assert (msg.model, msg.session_id, call.stream, call.include_usage, call.logprobs) == (
        "m", "alice", True, True, True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "prompt, kind",
    [("Once", "text"), (["Once"], "text"), ([1, 2, 3], "token_ids"), ([[1, 2]], "token_ids")],
)
def test_a_completion_prompt_is_text_or_token_ids(prompt: Any, kind: str) -> None:
    """A list of one prompt is one request."""
    msg = to_call({"prompt": prompt, "max_tokens": 4}, chat=False, session_id=None).request
    assert msg.WhichOneof("input") == kind and msg.sampling.max_tokens == 4


def test_ignore_eos_is_taken_as_vllm_spells_it() -> None:
    """Load generators ask for exact output lengths this way (`bench serve --backend openai`,
    AIPerf's `--extra-inputs ignore_eos:true`)."""
    body = {"prompt": [1, 2], "max_tokens": 4, "ignore_eos": True}
    assert to_call(body, chat=False, session_id=None).request.sampling.ignore_eos
    assert not to_call({"prompt": [1]}, chat=False, session_id=None).request.sampling.ignore_eos


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": ["a", 3]}, "prompt: must be a string, a list of token ids, or a list"),
        ({"prompt": [1, True]}, "prompt: must be a string, a list of token ids, or a list"),
        ({"prompt": ["a"] * 65}, "prompt: at most 64 prompts"),
        ({}, "prompt: required"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens: must be an integer"),
        ({"prompt": "a", "temperature": "hot"}, "temperature: must be a number"),
        ({"prompt": "a", "n": 17}, r"n: must be in \[1, 16\]"),
        ({"prompt": "a", "stop": [1]}, "stop: must be a string or a list of strings"),
        ({"prompt": "a", "logprobs": 21}, r"logprobs: must be in \[0, 20\]"),
        ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos: must be true or false"),
    ],
)
def test_a_bad_completion_body_is_refused_naming_the_field(body: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{message}"):
        to_call(body, chat=False, session_id=None)


def test_shared_checks_are_answered_in_openai_field_names() -> None:
    e = invalid(InvalidRequestError("sampling.max_tokens: must be in [1, 4096], got 0"))
    assert (e.status, e.param, str(e)) == (
        400,
        "max_tokens",
        "max_tokens: must be in [1, 4096], got 0",
    )
    assert invalid(InvalidRequestError("chat.messages: must not be empty")).param == "messages"
    assert invalid(InvalidRequestError("token_ids: id 9 is outside")).param == "prompt"


# --- every field honoured or refused ----------------------------------------------------------

# The request fields of OpenAI's API reference and vLLM's documented extras.
OPENAI_CHAT = [
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop",
    "store", "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs",
    "top_p", "user", "verbosity", "web_search_options"
]  # fmt: skip
OPENAI_COMPLETIONS = [
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user"
]  # fmt: skip
VLLM_EXTRAS = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structural_tag", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
    "response_format", "structured_outputs"
]  # fmt: skip
# A value for each honoured field that must show in the request (or be refused: n, top_logprobs).
SHOWN: dict[str, Any] = {
    "model": "m", "max_tokens": 5, "max_completion_tokens": 5, "temperature": 0.5,
    "top_p": 0.5, "min_p": 0.1, "top_k": 3, "seed": 1, "stop": "x", "stop_token_ids": [1],
    "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 1,
    "presence_penalty": 1, "frequency_penalty": 1, "repetition_penalty": 1.2,
    "logit_bias": {"1": 5}, "stream": True, "request_id": "r1",
    "messages": [{"role": "user", "content": "other"}], "prompt": "other",
    "response_format": {"type": "json_object"}, "guided_json": {"type": "object"},
    "guided_regex": "a+", "guided_choice": ["a", "b"], "guided_grammar": 'root ::= "a"',
    "structured_outputs": {"regex": "a+"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "echo": True, "best_of": 2, "add_special_tokens": False, "add_generation_prompt": False,
    "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low",
}  # fmt: skip
REFUSED_VALUES = {
    "n": 17,
    "top_logprobs": 2,
    "tool_choice": "required",
    "parallel_tool_calls": "yes",
}  # honoured with tools (test_tools.py)


def base(chat: bool) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}


def seen(call: Call) -> tuple[Any, ...]:
    return (MessageToDict(call.request), call.stream, call.include_usage, call.logprobs,
            call.n, call.best_of, call.echo)  # fmt: skip


@pytest.mark.parametrize(
    "chat, name",
    [(True, f) for f in OPENAI_CHAT + VLLM_EXTRAS]
    + [(False, f) for f in OPENAI_COMPLETIONS + VLLM_EXTRAS],
)
def test_every_field_is_honoured_or_refused_by_name(chat: bool, name: str) -> None:
    plain = seen(to_call(base(chat), chat, None))
    if name in UNSERVED and name not in HONOURED[chat]:
        for neutral in UNSERVED[name]:  # asking for nothing is accepted and changes nothing
            assert seen(to_call({**base(chat), name: neutral}, chat, None)) == plain
        with pytest.raises(InvalidRequestError, match=f"^{name}: not served here"):
            to_call({**base(chat), name: {"x": 1}}, chat, None)
        return
    assert name in HONOURED[chat], f"{name}: neither honoured nor refused"
    if name in INERT:
        assert seen(to_call({**base(chat), name: "x"}, chat, None)) == plain
    elif name in REFUSED_VALUES:
        with pytest.raises(InvalidRequestError, match=f"^{name}: "):
            to_call({**base(chat), name: REFUSED_VALUES[name]}, chat, None)
    elif name == "logprobs":
        assert to_call({**base(chat), name: True if chat else 0}, chat, None).logprobs
    elif name == "stream_options":
        body = {**base(chat), "stream": True, name: {"include_usage": True}}
        assert to_call(body, chat, None).include_usage
    else:
        assert seen(to_call({**base(chat), name: SHOWN[name]}, chat, None)) != plain, name


@pytest.mark.parametrize("chat", [True, False])
def test_an_unknown_field_is_refused_by_name(chat: bool) -> None:
    with pytest.raises(InvalidRequestError, match=r"^temprature: unknown field"):
        to_call({**base(chat), "temprature": 0.5}, chat, None)


def test_the_logit_adjustments_reach_the_request() -> None:
    body = {**base(False), "logit_bias": {"7": -100, "9": 2.5}, "min_tokens": 3,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
            "stop_token_ids": [2, 3], "include_stop_str_in_output": True}  # fmt: skip
    s = to_call(body, False, None).request.sampling
    assert dict(s.logit_bias) == {7: -100.0, 9: 2.5}
    assert (s.min_tokens, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (
        3, 0.5, -0.5, 1.1,
    )  # fmt: skip
    assert (list(s.stop_token_ids), s.include_stop_str_in_output) == ([2, 3], True)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"logit_bias": {"a": 1}}, "logit_bias: must map token ids to numbers"),
        ({"logit_bias": {"1": "x"}}, "logit_bias: must map token ids to numbers"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids: must be a list of token ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options: only with stream: true"),
        ({"min_tokens": 1.5}, "min_tokens: must be an integer"),
    ],
)
def test_bad_adjustments_are_refused_naming_the_field(extra: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{message}"):
        to_call({**base(False), **extra}, False, None)


@pytest.mark.parametrize(
    "fields, kind, spec",
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "p", "schema": {"type": "integer"}}}},
            "json_schema", '{"type": "integer"}',
        ),
        ({"guided_json": '{"type": "string"}'}, "json_schema", '{"type": "string"}'),
        ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
        ({"structured_outputs": {"choice": ["a"]}}, "choice", ["a"]),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)  # fmt: skip
def test_every_spelling_of_a_grammar_reaches_the_request(
    fields: dict[str, Any], kind: str | None, spec: Any
) -> None:
    out = to_call({**base(True), **fields}, True, None).request.sampling
    assert out.structured.WhichOneof("kind") == kind
    if kind == "choice":
        assert list(out.structured.choice.choices) == spec
    elif kind is not None:
        assert getattr(out.structured, kind) == spec


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"response_format": {"type": "yaml"}}, "response_format: must be"),
        ({"guided_json": "{nope"}, "guided_json: the schema is not JSON"),
        ({"guided_choice": "yes"}, "guided_choice: must be a list of strings"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice: give one of"),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs: unknown kind"),
    ],
)
def test_a_bad_grammar_field_is_refused_by_name(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"^{message}"):
        to_call({**base(True), **fields}, True, None)


def test_a_list_of_prompts_is_one_request_each_with_the_same_sampling() -> None:
    body = {"prompt": ["Once", [5, 6], "Twice"], "max_tokens": 3, "seed": 9}
    call = to_call(body, chat=False, session_id=None)
    assert [m.WhichOneof("input") for m in call.requests] == ["text", "token_ids", "text"]
    assert [m.text for m in call.requests] == ["Once", "", "Twice"]
    assert list(call.requests[1].token_ids.ids) == [5, 6]
    assert {(m.sampling.max_tokens, m.sampling.seed) for m in call.requests} == {(3, 9)}


def test_top_logprobs_are_asked_as_openai_spells_them() -> None:
    chat = to_call({**base(True), "logprobs": True, "top_logprobs": 5}, True, None)
    assert (chat.logprobs, chat.request.sampling.top_logprobs) == (True, 5)
    completion = to_call({**base(False), "logprobs": 3}, False, None)
    assert (completion.logprobs, completion.request.sampling.top_logprobs) == (True, 3)
    with pytest.raises(InvalidRequestError, match=r"^top_logprobs: needs logprobs: true"):
        to_call({**base(True), "top_logprobs": 2}, True, None)


def test_best_of_ranks_candidates_it_samples_with_logprobs_and_echo_asks_the_prompts() -> None:
    chat = to_call({**base(True), "n": 3}, True, None)
    assert (chat.n, chat.best_of) == (3, 3)  # every choice is run: none to rank
    call = to_call({**base(False), "n": 2, "best_of": 4}, False, None)
    assert (call.n, call.best_of, call.logprobs, call.request.sampling.logprobs) == (
        2, 4, False, True,
    )  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"^best_of: must be in \[n, 16\]"):
        to_call({**base(False), "n": 3, "best_of": 2}, False, None)
    with pytest.raises(InvalidRequestError, match=r"^best_of: cannot be streamed"):
        to_call({**base(False), "best_of": 2, "stream": True}, False, None)
    echoed = to_call({**base(False), "echo": True, "logprobs": 2}, False, None)
    assert echoed.request.sampling.prompt_logprobs == 2
    assert not to_call({**base(False), "echo": True}, False, None).request.sampling.HasField(
        "prompt_logprobs"
    )


@pytest.mark.parametrize(
    "seed, carried",
    [(0, 0), (2**63 - 1, 2**63 - 1), (2**63, -(2**63)), (2**64 - 1, -1), (-5, -5)],
)
def test_a_seed_of_any_64_bits_is_carried_as_the_same_torch_seed(seed: int, carried: int) -> None:
    """torch seeds a generator with 64 unsigned bits: 2^64 - 1 and -1 are one seed."""
    call = to_call({**base(False), "seed": seed}, False, None)
    assert call.request.sampling.seed == carried
    assert carried % 2**64 == seed % 2**64


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_past_64_bits_is_refused_naming_it(seed: int) -> None:
    with pytest.raises(InvalidRequestError, match=r"^seed: must be in \[-2\*\*63, 2\*\*64 - 1\]"):
        to_call({**base(True), "seed": seed}, True, None)


def test_top_k_minus_one_is_off_as_vllm_spells_it() -> None:
    assert to_call({**base(False), "top_k": -1}, False, None).request.sampling.top_k == 0
    assert to_call({**base(False), "top_k": 0}, False, None).request.sampling.top_k == 0
    with pytest.raises(InvalidRequestError, match=r"^top_k: must be -1 or 0"):
        to_call({**base(False), "top_k": -2}, False, None)


def test_template_variables_and_reasoning_effort_reach_the_chat() -> None:
    body = {**base(True), "chat_template_kwargs": {"enable_thinking": False},
            "reasoning_effort": "high", "add_generation_prompt": False}  # fmt: skip
    chat = to_call(body, True, None).request.chat
    assert json.loads(chat.template_kwargs) == {
        "enable_thinking": False,
        "reasoning_effort": "high",
    }
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    refused = InvalidRequestError("chat.template_kwargs.reasoning_effort: not read")
    assert invalid(refused).param == "reasoning_effort"
    refused = InvalidRequestError("chat.template_kwargs.foo: not read")
    assert invalid(refused).param == "chat_template_kwargs.foo"
