"""The checks a request passes wherever it arrives (router, engine, the two workers):
each defined once, each refusing with an InvalidRequestError that names the field."""

from __future__ import annotations

from collections.abc import Container

from cluster.types import InFlightError, InvalidRequestError, RequestId


def refuse_in_flight(request_id: RequestId, in_flight: Container[RequestId]) -> None:
    """Refuse a request whose id is one of `in_flight`: an id names one request at a time."""
    if request_id in in_flight:
        raise InFlightError(f"request_id: {request_id!r} is already in flight")


def refuse_past_context(field: str, prompt_tokens: int, max_tokens: int, context: int) -> None:
    """Refuse a request whose prompt and `max_tokens` together pass the model's context."""
    if prompt_tokens + max_tokens > context:
        raise InvalidRequestError(
            f"{field}: prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) "
            f"exceeds the model's context of {context} tokens"
        )


def refuse_long_prompt(field: str, prompt_tokens: int, context: int) -> None:
    """Refuse a prompt that leaves no room in the model's context for one token of reply."""
    if prompt_tokens >= context:
        raise InvalidRequestError(
            f"{field}: the prompt is {prompt_tokens} tokens; the model's context is "
            f"{context} tokens, one of them for the reply"
        )
