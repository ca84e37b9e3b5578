"""The checks a request passes wherever it arrives (router, decode worker, prefill worker):
each defined once, each refusing with an InvalidRequestError that names the field."""

from __future__ import annotations

from collections.abc import Container

from cluster.types import InvalidRequestError, RequestId


def refuse_in_flight(request_id: RequestId, in_flight: Container[RequestId]) -> None:
    """Refuse a request whose id is one of `in_flight`: an id names one request at a time."""
    if request_id in in_flight:
        raise InvalidRequestError(f"request_id: {request_id!r} is already in flight")
