"""OpenAI request bodies become the gRPC API's GenerateRequest; bad ones name the field."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.types import InvalidRequestError
from router.openai import invalid, to_call


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
        ({"prompt": ["a", "b"]}, "prompt: must be a string or a list of token ids"),
        ({"prompt": [1, True]}, "prompt: must be a string or a list of token ids"),
        ({}, "prompt: required"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens: must be an integer"),
        ({"prompt": "a", "temperature": "hot"}, "temperature: must be a number"),
        ({"prompt": "a", "n": 3}, "n: only 1 choice per request"),
        ({"prompt": "a", "stop": [1]}, "stop: must be a string or a list of strings"),
        ({"prompt": "a", "logprobs": 2}, "logprobs: only 0 is served"),
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
