"""router/request.py's checks of a GenerateRequest, on token-id prompts (no tokenizer)."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.types import InvalidRequestError, ModelInfo
from router.request import prepare
from splitserve_api.v1 import splitserve_pb2 as pb

MODEL = ModelInfo("m", max_model_len=128, vocab_size=100, page_size=16)


def prepared(raw: bytes) -> Any:
    return prepare(pb.GenerateRequest.FromString(raw), None, MODEL, 64)  # type: ignore[arg-type]


def request(**sampling: Any) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]))
    for name, value in sampling.items():
        if name == "logit_bias":
            msg.sampling.logit_bias.update(value)
        else:
            setattr(msg.sampling, name, value)
    return msg


def test_the_logit_adjustments_become_sampling_params() -> None:
    msg = request(
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.3,
        logit_bias={9: -100.0, 4: 2.0}, min_tokens=3, include_stop_str_in_output=True,
        top_logprobs=4, prompt_logprobs=0,
    )  # fmt: skip
    s = prepared(msg.SerializeToString()).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.3)
    assert (s.logit_bias, s.min_tokens, s.include_stop_str_in_output) == (
        ((4, 2.0), (9, -100.0)), 3, True,
    )  # fmt: skip
    assert (s.top_logprobs, s.prompt_logprobs) == (4, 0)
    assert prepared(request().SerializeToString()).sampling.prompt_logprobs is None


@pytest.mark.parametrize(
    "sampling, message",
    [
        ({"logit_bias": {100: 1.0}}, "sampling.logit_bias: token id 100 is outside"),
        ({"logit_bias": {1: 101.0}}, "sampling.logit_bias: every bias must be in"),
        ({"logit_bias": {1: float("nan")}}, "sampling.logit_bias: the bias of token 1"),
        ({"min_tokens": 9, "max_tokens": 4}, "sampling.min_tokens: must be <= max_tokens"),
        ({"min_tokens": -1}, "sampling.min_tokens: must be an integer >= 0"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty: must be in"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty: must be > 0"),
        ({"frequency_penalty": float("inf")}, "sampling.frequency_penalty: must be a finite"),
        ({"top_logprobs": 21}, "sampling.top_logprobs: must be in [0, 20]"),
        ({"prompt_logprobs": 21}, "sampling.prompt_logprobs: must be in [0, 20]"),
    ],
)
def test_bad_adjustments_are_refused_naming_the_field(sampling: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        prepared(request(**sampling).SerializeToString())
    assert str(err.value).startswith(message), err.value


def test_a_field_this_api_does_not_know_is_refused_not_ignored() -> None:
    # What a client built from a newer .proto sends: field 100 (a varint), top level and
    # inside sampling.
    known = request().SerializeToString()
    with pytest.raises(InvalidRequestError, match=r"^request: unknown field number 100"):
        prepared(known + b"\xa0\x06\x01")
    inner = pb.SamplingParams(max_tokens=2).SerializeToString() + b"\xa0\x06\x01"
    with pytest.raises(InvalidRequestError, match=r"^sampling: unknown field number 100"):
        prepared(known + b"\x22" + bytes([len(inner)]) + inner)
    assert prepared(known).prompt_ids == [1, 2, 3]


def test_a_grammar_after_the_thoughts_takes_token_ids_of_the_vocabulary() -> None:
    def structured(**fields: Any) -> bytes:
        msg = request()
        msg.sampling.structured.CopyFrom(pb.StructuredOutput(json_object=True, **fields))
        return msg.SerializeToString()

    s = prepared(structured(reasoning_end=7, reasoning_start=6)).sampling.structured
    assert (s.kind, s.reasoning_end, s.reasoning_start) == ("json_object", 7, 6)
    assert prepared(structured()).sampling.structured.reasoning_end is None
    with pytest.raises(InvalidRequestError, match=r"^sampling.structured.reasoning_end: token"):
        prepared(structured(reasoning_end=100))
    with pytest.raises(InvalidRequestError, match=r"^sampling.structured.reasoning_start: needs"):
        prepared(structured(reasoning_start=6))
