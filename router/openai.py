"""The OpenAI-compatible HTTP front door, on the same router core as the gRPC API.

Routes: POST /v1/chat/completions and /v1/completions (streamed as server-sent events
ending in `data: [DONE]`, or one JSON body), GET /v1/models, /health and /metrics.

A body becomes the gRPC API's GenerateRequest (router/openai_request.py) and is checked by
the same `prepare`, so both front doors accept and refuse the same requests with the same
messages. Replies, chunks and errors are rendered in OpenAI's shape (router/openai_reply.py),
errors as `{"error": {"message", "type", "param", "code"}}`: 400 for a bad field (the
message and `param` name it), 404 for another model's name, 429 when a limit
refuses it, naming it (the router is full, the client is past its own limit: by its
`Authorization` header if it sends one, else by its address; or the tokenization queue
is full), 401 for a /v1/, tokenizer or /metrics request without the API key (when one is
set; /health and /version stay open), 503 with no live decode worker, 500 when a worker
failed the request. A stream that fails after its first event ends with an error event,
never `[DONE]`. A client that disconnects has its request aborted on every worker (its
pages are freed). The session header `X-Session-Id` gives a conversation's turns the
same worker.

As vLLM: a completion without max_tokens stops at 16 tokens, a chat may fill the context;
with a reasoning parser (router/reasoning.py) a chat's thoughts come apart as
`reasoning_content`; tool calls (router/tools.py) stream as they are made when the reply
is held to them or written in Hermes blocks, else they are read from the whole reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import ssl
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from importlib.metadata import version
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from cluster.engine.model.tokenizer import Tokenizer
from cluster.types import FinishReason, InvalidRequestError, ModelInfo, RequestId, TokenDelta
from router import admission, cors, lab
from router.auth import UNAUTHORIZED, http_middleware
from router.errors import Overloaded, RequestFailed, Unavailable
from router.metrics import RouterMetrics
from router.openai_reply import (
    FINISH,
    HTTPError,
    Readers,
    Reply,
    ReplyRenderer,
    best,
    invalid,
    usage,
)
from router.openai_request import Call, body_field, to_call
from router.reasoning import grammar_bounds
from router.request import Prepared, prepare_off_loop, shown
from router.router import Final, Router
from router.tokenize_pool import TokenizePool
from router.tools import Tools, parser_for

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"
MAX_BODY_BYTES = 4 * 2**20
# Connections the kernel holds for accept(): aiohttp's 128 dropped part of a burst of new
# clients, who waited a 1 s SYN retransmit to be refused; the kernel caps it (somaxconn).
BACKLOG = 4096
# A completion without max_tokens stops here (OpenAI's and vLLM's default); a chat's reply
# may fill what the context leaves.
COMPLETION_MAX_TOKENS = 16
GENERATE = ("/v1/chat/completions", "/v1/completions")  # the routes that take a slot


def _child(p: Prepared, i: int) -> Prepared:
    """Choice i of a request: the same prompt, its own id, and, when seeded, seed + i (an
    unseeded one gets a random seed of its own in the router)."""
    sampling = p.sampling
    if sampling.seed is not None:
        sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
    rid = None if p.request_id is None else RequestId(f"{p.request_id}-{i}")
    return dataclasses.replace(p, sampling=sampling, request_id=rid)


class OpenAIFrontDoor:
    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        model: ModelInfo,
        max_tokens: int | None,
        metrics: RouterMetrics,
        serving: Callable[[], bool],
        pool: TokenizePool,
        api_key: tuple[str, ...] | None = None,  # any one of them
        allowed_origins: tuple[str, ...] = (),
        routes: Sequence[web.RouteDef] = (),  # more pages: splitserve's lab
        reasoning_parser: str | None = None,  # router/reasoning.py's; None: no split
        tool_parser: str | None = None,  # router/tools.py's; None: the template's
    ) -> None:
        self.router = router
        self.routes = routes
        self.api_key = api_key
        self.allowed_origins = allowed_origins  # CORS (router/cors.py); empty: off
        self.pool = pool
        self.tokenizer = tokenizer
        self.model = model
        self.max_tokens = max_tokens
        self.tool_parser = tool_parser or parser_for(getattr(tokenizer.hf, "chat_template", None))
        self.reasoning_parser = reasoning_parser
        # What a request leaves out gets the model's generation config, else OpenAI's 1.0.
        self.sampling_defaults = {"temperature": 1.0, **dict(model.sampling_defaults)}
        self.render = ReplyRenderer(tokenizer, model.name, reasoning_parser, self.tool_parser)
        self.metrics = metrics
        self.serving = serving
        self.runner: web.AppRunner | None = None
        self.address = ""

    def app(self) -> web.Application:
        middlewares: list[Middleware] = [_errors_as_json]
        if self.allowed_origins:  # before the key: a browser's preflight carries none
            middlewares.append(cors.preflight(self.allowed_origins))
        if self.api_key is not None:
            middlewares.append(http_middleware(self.api_key, _unauthorized))
        # Last, so a client without the key learns that first; before any body is read.
        middlewares.append(admission.http_middleware(self.router, GENERATE, self._full))
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
        if self.allowed_origins:
            app.on_response_prepare.append(cors.allow_origin(self.allowed_origins))
        app.router.add_post(GENERATE[0], self._chat)
        app.router.add_post(GENERATE[1], self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/version", self._version)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self.metrics.scrape)
        app.router.add_get("/lab/live", self._lab_live)
        app.router.add_routes(self.routes)
        return app

    async def start(
        self, host: str, port: int, grace_s: float, tls: ssl.SSLContext | None = None
    ) -> None:
        """Serve on host:port (0: any free port), over TLS with `tls` (router/tls.py); on
        stop, requests in flight get grace_s."""
        # handler_cancellation: a client that goes away cancels its handler at once, even
        # while it waits for a first token, so the request is aborted on every worker.
        self.runner = web.AppRunner(
            self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=grace_s
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, backlog=BACKLOG, ssl_context=tls)
        await site.start()
        bound = self.runner.addresses[0]
        self.address = f"{'http' if tls is None else 'https'}://{bound[0]}:{bound[1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # --- handlers ---

    async def _lab_live(self, request: web.Request) -> web.Response:
        return web.json_response(lab.live(self.router, self.metrics))

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    def _card(self) -> dict[str, Any]:
        return {"id": self.model.name, "object": "model", "created": 0, "owned_by": "splitserve",
                "max_model_len": self.model.max_model_len}  # fmt: skip

    def _check_model(self, name: str | None) -> None:
        if name and name != self.model.name:
            raise HTTPError(404, f"model: {shown(name)} is not served here (serving "
                            f"{self.model.name!r})", "model_not_found", "model")  # fmt: skip

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def _model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"])
        return web.json_response(self._card())

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: the ids a completion's `prompt` or a chat's `messages` become
        (with `add_special_tokens`; a chat's `add_generation_prompt`, template variables and
        tools too), checked as a request with them would be; `return_token_strs` adds each
        id's token as a string."""
        body = await _body(request)
        try:
            strs = body_field(body, "return_token_strs", (bool,), "true or false")
            body = {k: v for k, v in body.items() if k != "return_token_strs"}
            call = to_call(body, "messages" in body, None)
            self._check_model(call.request.model)
            args = (call.request, self.tokenizer, self.model, self.max_tokens, self.pool)
            ids = (await prepare_off_loop(*args)).prompt_ids
        except InvalidRequestError as e:
            raise invalid(e) from None
        tokens = self.tokenizer.hf.convert_ids_to_tokens(ids) if strs else None
        return web.json_response({"count": len(ids), "max_model_len": self.model.max_model_len,
                                  "tokens": ids, "token_strs": tokens})  # fmt: skip

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: `tokens` (ids) as text."""
        body = await _body(request)
        try:
            if extra := sorted(set(body) - {"model", "tokens"}):
                raise InvalidRequestError(f"{extra[0]}: unknown field, refused")
            self._check_model(body_field(body, "model", (str,), "a string"))
            ids = body_field(body, "tokens", (list,), "a list of token ids")
            if ids is None or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.model.vocab_size
                for t in ids
            ):
                raise InvalidRequestError(
                    f"tokens: must be a list of token ids in [0, {self.model.vocab_size})"
                )
        except InvalidRequestError as e:
            raise invalid(e) from None
        return web.json_response({"prompt": self.tokenizer.decode(ids)})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": version("splitserve")})

    async def _health(self, request: web.Request) -> web.Response:
        ok = self.serving()
        return web.json_response({"status": "ok" if ok else "no decode worker"},
                                 status=200 if ok else 503)  # fmt: skip

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        status = "cancelled"  # unless it ends otherwise: the client went away
        try:
            try:
                with self.router.in_flight(_client(request)):  # before tokenizing
                    response, status = await self._answer(request, chat)
            except Overloaded as e:
                status = "rate_limit_exceeded"
                return self._overloaded(e)
            return response
        except HTTPError as e:
            status = e.kind
            return web.json_response(e.body(), status=e.status)
        finally:
            self.metrics.requests.labels(status).inc()

    def _overloaded(self, e: Overloaded) -> web.Response:
        """429 naming the limit, with Retry-After."""
        self.metrics.refusals.labels(e.limit).inc()
        body = HTTPError(429, str(e), "rate_limit_exceeded").body()
        return web.json_response(body, status=429, headers=admission.retry_after())

    def _full(self, e: Overloaded) -> web.Response:
        """The admission middleware's refusal: the handler never runs to count it."""
        self.metrics.requests.labels("rate_limit_exceeded").inc()
        return self._overloaded(e)

    async def _answer(self, request: web.Request, chat: bool) -> tuple[web.StreamResponse, str]:
        call, prepared = await self._prepare(request, chat)
        if call.stream and (call.tools is None or self._streams_calls(call.tools)):
            return await self._stream(request, call, prepared)
        replies = await self._collect(prepared, call.best_of)
        if call.best_of > call.n:
            replies = best(replies, call.best_of, call.n)
        if call.stream:  # calls in another format: read from the whole reply
            return await self._stream_whole(request, call, replies), "ok"
        return web.json_response(self.render.body(call, replies)), "ok"

    def _streams_calls(self, tools: Tools) -> bool:
        """Whether a stream's tool calls go out as they come (forced ones, Hermes blocks)."""
        return tools.schema() is not None or (
            tools.choice == "auto" and self.tool_parser == "hermes"
        )

    async def _prepare(self, request: web.Request, chat: bool) -> tuple[Call, list[Prepared]]:
        body = await _body(request)
        try:
            call = to_call(body, chat, request.headers.get(SESSION_HEADER))
            self._check_model(call.request.model)
            if chat and self.reasoning_parser and call.request.sampling.HasField("structured"):
                given = "tool_choice" if call.tools is not None else "response_format"
                end, start = grammar_bounds(self.reasoning_parser, self.tokenizer, given)
                for msg in call.requests:
                    msg.sampling.structured.reasoning_end = end
                    if start is not None:
                        msg.sampling.structured.reasoning_start = start
            if call.tools is not None and call.tools.choice == "auto" and not self.tool_parser:
                raise InvalidRequestError(
                    "tools: no tool-call parser fits this model's chat template (Hermes "
                    "<tool_call> or Llama 3 JSON); tool_choice required or a named function "
                    "work without one"
                )
            prepared = []
            for msg in call.requests:
                for name, value in self.sampling_defaults.items():
                    if not msg.sampling.HasField(name):
                        setattr(msg.sampling, name, value)
                args = (msg, self.tokenizer, self.model, self.max_tokens, self.pool)
                omitted = self.model.max_model_len if chat else COMPLETION_MAX_TOKENS
                prepared.append(await prepare_off_loop(*args, omitted_max_tokens=omitted))
            return call, prepared
        except InvalidRequestError as e:
            raise invalid(e) from None

    async def _deltas(self, p: Prepared) -> AsyncIterator[tuple[TokenDelta, Final | None]]:
        """The router's stream, its errors as HTTPErrors, its latencies recorded."""
        try:
            last: float | None = None
            async for delta, final in self.router.generate(p, admitted=True):
                last = self.metrics.observe(delta, final, last)
                yield delta, final
        except InvalidRequestError as e:
            raise invalid(e) from None
        except Unavailable as e:
            raise HTTPError(503, str(e), "service_unavailable") from None
        except RequestFailed as e:
            raise HTTPError(500 if e.reason is FinishReason.ERROR else 503, str(e),
                            "server_error") from None  # fmt: skip
        except Exception as e:  # a bug of ours: say so, and keep serving
            log.exception("HTTP generate failed")
            raise HTTPError(500, f"internal error: {e}", "server_error") from None

    async def _choices(
        self, prompts: list[Prepared], n: int
    ) -> AsyncIterator[tuple[int, TokenDelta, Final | None]]:
        """Every choice's deltas as they come, with its index (prompt k's choice i is
        k * n + i, as OpenAI numbers them). The prompts run together; of each prompt's n
        choices, choice 0 runs alone until its first token: the others, the same prompt,
        then find its KV pages in the prefix cache, so the prompt is prefilled once and its
        full pages are shared (the last, partial one each request computes and owns)."""
        children = [p if n == 1 else _child(p, i) for p in prompts for i in range(n)]
        queue: asyncio.Queue[tuple[int, TokenDelta | Exception | None, Final | None]]
        queue = asyncio.Queue()

        async def run(i: int) -> None:
            try:
                async for delta, final in self._deltas(children[i]):
                    queue.put_nowait((i, delta, final))
            except Exception as e:
                queue.put_nowait((i, e, None))
            else:
                queue.put_nowait((i, None, None))

        tasks = [asyncio.create_task(run(k * n)) for k in range(len(prompts))]
        try:
            ended = 0
            while ended < len(children):
                i, got, final = await queue.get()
                if isinstance(got, Exception):
                    raise got
                if i % n == 0 and n > 1 and got is not None and got.index == 0:
                    # choice 0's first token: its prompt is cached for the others
                    tasks += [asyncio.create_task(run(i + j)) for j in range(1, n)]
                if got is None:
                    ended += 1
                    continue
                yield i, got, final
        finally:
            for task in tasks:  # a choice still running is aborted on its workers
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect(self, prompts: list[Prepared], n: int) -> list[Reply]:
        replies = [Reply() for _ in range(len(prompts) * n)]
        async for i, delta, final in self._choices(prompts, n):
            reply = replies[i]
            reply.text += delta.text
            reply.token_ids.extend(delta.token_ids)
            reply.logprobs.extend(delta.logprobs)
            reply.top_logprobs.extend(delta.top_logprobs)
            reply.prompt_logprobs = reply.prompt_logprobs or delta.prompt_logprobs
            if delta.finish_reason is not None:
                reply.finish = FINISH.get(delta.finish_reason, "stop")
            reply.final = final or reply.final
        return replies

    async def _stream_whole(
        self, request: web.Request, call: Call, replies: list[Reply]
    ) -> web.StreamResponse:
        """Whole replies as one stream: per choice its role, its content, its tool calls
        (each whole), its finish; then usage if asked, then [DONE]."""
        body = self.render.body(call, replies)
        envelope = {**self.render.envelope(call, body["id"]), "object": "chat.completion.chunk"}
        response = await self._open(request, call, envelope)
        for choice in body["choices"]:
            message, i = choice["message"], choice["index"]
            delta: dict[str, Any] = {"content": message["content"]} if message["content"] else {}
            if message.get("reasoning_content"):
                delta["reasoning_content"] = message["reasoning_content"]
            if "tool_calls" in message:
                delta["tool_calls"] = [
                    {**c, "index": j} for j, c in enumerate(message["tool_calls"])
                ]
            chunks = [{"index": i, "delta": delta, "logprobs": choice["logprobs"],
                       "finish_reason": None},
                      {"index": i, "delta": {}, "logprobs": None,
                       "finish_reason": choice["finish_reason"]}]  # fmt: skip
            for chunk in chunks:
                await _event(response, {**envelope, "choices": [chunk]})
        if call.include_usage and "usage" in body:
            await _event(response, {**envelope, "choices": [], "usage": body["usage"]})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream(
        self, request: web.Request, call: Call, prompts: list[Prepared]
    ) -> tuple[web.StreamResponse, str]:
        """Server-sent events: one chunk per delta, then usage if asked, then [DONE]. The
        response starts with the first delta, so a refusal still gets its status code;
        a failure after it ends the stream with an error event. Returns how it ended."""
        rid = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex
        envelope = self.render.envelope(call, rid)
        response: web.StreamResponse | None = None
        finals: dict[int, Final] = {}
        readers: dict[int, Readers] = {}  # each choice's
        try:
            async for i, delta, last in self._choices(prompts, call.n):
                if response is None:
                    response = await self._open(request, call, envelope)
                if i not in readers:
                    readers[i] = self.render.readers(call)
                chunk = self.render.chunk(call, delta, i, readers[i])
                await _event(response, {**envelope, "choices": [chunk]})
                if last is not None:
                    finals[i] = last
        except HTTPError as e:
            if response is None:
                raise
            await _event(response, e.body())
            await response.write_eof()
            return response, e.kind
        except ConnectionResetError:  # the client left between two events
            assert response is not None
            return response, "cancelled"
        assert response is not None, "a stream ends with a delta that has a finish reason"
        if call.include_usage and finals:
            await _event(response, {**envelope, "choices": [], "usage": usage(finals, call.n)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response, "ok"

    async def _open(
        self, request: web.Request, call: Call, envelope: dict[str, Any]
    ) -> web.StreamResponse:
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        if call.chat:  # each choice's role comes first, in a chunk of its own
            for i in range(call.n * len(call.requests)):
                first = {"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}  # fmt: skip
                await _event(response, {**envelope, "choices": [first]})
        return response


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"body: not valid JSON: {e}", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "body: must be a JSON object", "invalid_request_error", "body")
    return body


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in OpenAI's shape: ours (HTTPError), and aiohttp's own (404, 405, 413)."""
    try:
        return await handler(request)
    except HTTPError as e:
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found" if e.status == 404 else "invalid_request_error"
        message = f"{request.method} {request.path}: {e.reason}"
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return web.json_response(HTTPError(e.status, message, kind).body(), status=e.status,
                                 headers=allow)  # fmt: skip


def _unauthorized() -> web.Response:
    body = HTTPError(401, UNAUTHORIZED, "invalid_request_error").body()
    body["error"]["code"] = "invalid_api_key"  # as OpenAI answers a wrong key
    return web.json_response(body, status=401)


def _client(request: web.Request) -> str:
    """Who sent the request, for the per-client limit: its key (`Authorization`) if it
    sent one, else its address."""
    key = request.headers.get("Authorization")
    return f"key {key}" if key else f"peer {request.remote}"


async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())
