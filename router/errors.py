"""The router's three ways to end a request other than its reply, which each front door
answers in its own terms (router/openai.py, router/server.py): Overloaded (refused by a
limit), Unavailable (no worker can take it), RequestFailed (a worker failed or aborted it).
Here, below both the router and its tokenization pool, which raise them."""

from __future__ import annotations

from cluster.types import FinishReason


class Overloaded(Exception):
    """Refused by a limit (`limit`, its config name) before any work: try again later."""

    def __init__(self, limit: str, why: str) -> None:
        super().__init__(why)
        self.limit = limit


class Unavailable(Exception):
    """No worker can take the request now."""


class RequestFailed(Exception):
    """An accepted request ended with an error or was aborted; the message says why."""

    def __init__(self, reason: FinishReason, why: str) -> None:
        super().__init__(why)
        self.reason = reason
