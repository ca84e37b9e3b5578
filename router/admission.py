"""Admission before the application: a request past `router.max_pending` is refused before
any of its work (over HTTP before its body is read), and past what the router's Python
takes at once, gRPC's own limit refuses without running any of it (no parse, no key
check, no count, no tokenizer).

The router's own count (`Router.pending`, held by `Router.in_flight`) stays the one truth
of what is in flight. Neither door keeps a count beside it:

- HTTP: `http_middleware` reads the router's count before any handler, so once it is
  full, a POST to a generation route is answered 429 (OpenAI's error shape, naming
  max_pending, with `Retry-After`) before its body is read. Below the limit the handler
  takes its slot as before, so a request let past here can still be refused there (the
  last slot went in between): both say the same thing.
- gRPC: grpc.aio's own limit on concurrent calls (`maximum_concurrent_rpcs`, enforced in
  grpc's Cython layer: a call past it is answered RESOURCE_EXHAUSTED "Concurrent RPC limit
  exceeded!" without a handler, an interceptor or a deserializer running) is set to
  `grpc_limit(max_pending)`: max_pending plus `GRPC_ALLOWANCE`. It counts every call on
  the server and cannot tell one service from another, so it cannot keep health and
  reflection out of its count by itself; set to max_pending, a health probe (or
  ListModels) would be refused whenever the router is full. With the allowance on top,
  the router's count decides first, naming max_pending, while the limit is only the
  backstop of a burst: it refuses once the router is full *and* `GRPC_ALLOWANCE` more
  calls are in the router's Python at once (being refused, health checks, ListModels).
  So with max_pending streams running a health check answers; during a burst it can be
  refused like any call and the prober tries again. A separate server and port for
  health would keep it out for good, but is not what a load balancer configured for
  one gRPC port expects.

The price of the backstop: a call it refuses carries gRPC's message, not the limit's
name, and is not in the router's refusal metrics (grpc gives no hook there; the bench's
`by_status` counts them). Calls open that hold no slot (a health check or Watch, a
reflection stream, a request being parsed or refused) take allowance, not max_pending,
so the backstop never refuses a request the router would have taken while fewer than
`GRPC_ALLOWANCE` of them are open.

What it does not do is make a refusal cheap: grpc.aio's own work per call (taking it
from the core, its task, sending the status: Cython on the event loop) costs about as
much as the router's whole refusal, and each refused call ends before grpc.aio takes the
next one, so a burst rarely has many calls open at once. Measured, with the targets
missed, in docs/benchmarks.md (`bench chaos --scenario burst`).
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from router.errors import Overloaded
from router.router import Router

# Calls past max_pending the router's Python handles at once before gRPC's limit refuses
# the rest: health checks and reflection while full (a prober's Health.Watch holds one
# for as long as it watches), and the first of a burst's refusals.
GRPC_ALLOWANCE = 64
# What a refusal asks the client to wait, in seconds (the router cannot know when a slot
# frees: a stream ends when its tokens do).
RETRY_AFTER_S = 1


def grpc_limit(max_pending: int) -> int:
    """The gRPC server's `maximum_concurrent_rpcs` for a router of `max_pending`."""
    return max_pending + GRPC_ALLOWANCE


def retry_after() -> dict[str, str]:
    """The header every refusal by a limit carries."""
    return {hdrs.RETRY_AFTER: str(RETRY_AFTER_S)}


def http_middleware(
    router: Router, paths: tuple[str, ...], refuse: Callable[[Overloaded], web.Response]
) -> Middleware:
    """An aiohttp middleware answering `refuse(...)` (a 429) to a POST to one of `paths`
    while the router is full, before the handler runs or the body is read."""

    @web.middleware
    async def admit(request: web.Request, handler: Handler) -> web.StreamResponse:
        if router.full() and request.method == hdrs.METH_POST and request.path in paths:
            return refuse(router.overloaded())
        return await handler(request)

    return admit
