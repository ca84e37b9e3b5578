"""The API key both front doors check: `Authorization: Bearer <key>`, compared in
constant time.

What it guards is what vLLM's --api-key guards, the API itself (HTTP routes under /v1/,
the tokenizer, gRPC's splitserve.v1.Generation), and /metrics on both ports that serve it
(the HTTP API's and router.metrics_port), so a scraper sends the key too, and the lab's
live view (/lab/live). Health checks (HTTP /health, the gRPC health service), /version,
gRPC reflection and the lab's page (no data of the server's) stay open, so probes need no
key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from cluster.bearer import authorized, read_key
from cluster.config import ConfigError, RouterConfig, loopback

# What the key guards: the API, the tokenizer, /metrics and the lab's live view; /health,
# /version and the lab's page and capacity arithmetic stay open.
HTTP_GUARDED = ("/v1/", "/tokenize", "/detokenize", "/metrics", "/lab/live")
UNAUTHORIZED = "invalid API key: send Authorization: Bearer <key>"


def api_key(config: RouterConfig) -> tuple[str, ...] | None:
    """The keys clients may send (any one of them): router.api_key's, or router.api_key_file's
    contents (stripped); None: no check, which only a loopback router.host may go without
    (anything bound wider asks for a key: a ConfigError naming router.host and
    router.api_key)."""
    path = config.api_key_file
    key = config.api_key if path is None else read_key(path, "router.api_key_file")
    if key is not None:
        return (key,) if isinstance(key, str) else key
    if not loopback(config.host):
        raise ConfigError(
            f"router.host: {config.host} is reachable from other machines, so it needs "
            "router.api_key (--api-key, SPLITSERVE_API_KEY, or router.api_key_file); or "
            "listen on 127.0.0.1"
        )
    return None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def http_middleware(keys: tuple[str, ...], refuse: Callable[[], web.Response]) -> Any:
    """An aiohttp middleware answering `refuse()` (a 401) to a guarded request without one
    of the keys."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(HTTP_GUARDED) and not authorized(
            request.headers.get("Authorization"), keys
        ):
            return refuse()
        return await handler(request)

    return check


class GrpcKeyCheck(grpc.aio.ServerInterceptor):
    """Refuses a call to `service` without the key: UNAUTHENTICATED. Other services
    (health, reflection) pass."""

    def __init__(self, keys: tuple[str, ...], service: str) -> None:
        self.keys = keys
        self.prefix = f"/{service}/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if authorized(metadata.get("authorization"), self.keys):
            return handler
        return _refusal(handler)


async def _refuse(request: object, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call."""
    assert not handler.request_streaming, "Generation's calls take one request"
    make = grpc.unary_stream_rpc_method_handler
    if not handler.response_streaming:
        make = grpc.unary_unary_rpc_method_handler
    return make(
        _refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
