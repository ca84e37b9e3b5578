"""CORS for the HTTP API: which browser origins may call it (router.allowed_origins).

With none (the default) the API sends no Access-Control-* header, so browsers keep pages
of other origins out. With some, a request whose Origin is one of them (or any, with a `*`
entry) gets `Access-Control-Allow-Origin: <its origin>`, and its preflight (OPTIONS with
Access-Control-Request-Method) is answered before the API key is asked for, as browsers
send preflights without credentials. Any other origin gets no header and its browser
refuses the reply.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


def allowed_origin(request: web.Request, origins: tuple[str, ...]) -> str | None:
    """The request's Origin if it may call the API, else None."""
    origin = request.headers.get(hdrs.ORIGIN)
    return origin if origin is not None and ("*" in origins or origin in origins) else None


def preflight(origins: tuple[str, ...]) -> Middleware:
    """An aiohttp middleware answering an allowed origin's preflight: 204 with the method
    and headers it asked for (the Allow-Origin header comes from `allow_origin`)."""

    @web.middleware
    async def answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        method = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_METHOD)
        if request.method != hdrs.METH_OPTIONS or method is None:
            return await handler(request)
        if allowed_origin(request, origins) is None:
            return await handler(request)
        headers = {
            hdrs.ACCESS_CONTROL_ALLOW_METHODS: method,
            hdrs.ACCESS_CONTROL_MAX_AGE: str(MAX_AGE_S),
        }
        if asked := request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS):
            headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = asked
        return web.Response(status=204, headers=headers)

    return answer


def allow_origin(
    origins: tuple[str, ...],
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """An on_response_prepare hook: every reply to an allowed origin names it, streamed
    replies and errors included (a middleware would see a stream only after its headers
    went out)."""

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        if origin := allowed_origin(request, origins):
            response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
            response.headers.add(hdrs.VARY, hdrs.ORIGIN)

    return add
