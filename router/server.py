"""The gRPC server: splitserve.v1.Generation, the standard health service and reflection.

Status codes: a bad field, or a message that does not parse, is INVALID_ARGUMENT (the
message names the field; unparsable messages are logged at most once a minute), a full
router (max_pending), a client past its own limit (max_pending_per_client: by its
`authorization` metadata if it sends one, else by its address) or a full tokenization
queue is RESOURCE_EXHAUSTED naming the limit (past max_pending plus a small allowance of
calls at once, grpc's own limit refuses first, with its own message: router/admission.py),
no live decode worker is UNAVAILABLE, a
request a worker failed is INTERNAL, a call without the API key (when one is set)
is UNAUTHENTICATED, one the server aborted (shutdown) is ABORTED. A
client that cancels, or whose deadline passes, has its request aborted on every worker.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from importlib.metadata import version

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.config import RouterConfig
from cluster.engine.model.tokenizer import Tokenizer
from cluster.protocol import DecodeStats
from cluster.types import FinishReason, InvalidRequestError, ModelInfo, TokenDelta
from router.admission import grpc_limit
from router.auth import GrpcKeyCheck
from router.errors import Overloaded, RequestFailed, Unavailable
from router.metrics import RouterMetrics
from router.request import prepare_off_loop
from router.router import Final, Router
from router.tokenize_pool import TokenizePool
from router.unparsable import RateLimitedLog, Unparsable, parse_generate
from splitserve_api.v1 import splitserve_pb2 as pb
from splitserve_api.v1 import splitserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
UNPARSABLE_LOG_EVERY_S = 60.0


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        model: ModelInfo,
        config: RouterConfig,
        metrics: RouterMetrics,
        pool: TokenizePool,
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.pool = pool
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self.unparsable = RateLimitedLog(log, UNPARSABLE_LOG_EVERY_S)

    async def Generate(
        self, request: pb.GenerateRequest | Unparsable, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        status = "cancelled"  # unless it ends otherwise: the client left or its deadline passed
        code: grpc.StatusCode | None = None
        why = ""
        try:
            if isinstance(request, Unparsable):
                self.unparsable.warning(
                    f"Generate: a {request.num_bytes}-byte message did not parse: {request.why}"
                )
                raise InvalidRequestError(f"request: not a GenerateRequest: {request.why}")
            with self.router.in_flight(_client(context)):  # before tokenizing
                args = (request, self.tokenizer, self.model, self.config.max_tokens, self.pool)
                prepared = await prepare_off_loop(*args)
                last: float | None = None
                async for delta, final in self.router.generate(prepared, admitted=True):
                    last = self.metrics.observe(delta, final, last)
                    yield _response(delta, final)
            status = "ok"
        except InvalidRequestError as e:  # ours, or a worker's (Ray wraps it: its cause)
            code, why = grpc.StatusCode.INVALID_ARGUMENT, str(getattr(e, "cause", e))
        except Overloaded as e:
            code, why = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
            self.metrics.refusals.labels(e.limit).inc()
        except Unavailable as e:
            code, why = grpc.StatusCode.UNAVAILABLE, str(e)
        except RequestFailed as e:
            code, why = grpc.StatusCode.ABORTED, str(e)
            if e.reason is FinishReason.ERROR:
                code = grpc.StatusCode.INTERNAL
        except Exception as e:  # a bug of ours: say so, and keep serving
            log.exception("Generate failed")
            code, why = grpc.StatusCode.INTERNAL, f"internal error: {e}"
        finally:
            self.metrics.requests.labels(status if code is None else code.name.lower()).inc()
        if code is not None:
            await context.abort(code, why)

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            models=[pb.Model(id=self.model.name, max_model_len=self.model.max_model_len)]
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        workers = []
        for name, s in sorted(self.router.workers.stats().items()):
            if isinstance(s, DecodeStats):
                w = pb.Worker(role="decode", running=s.running)
            else:
                w = pb.Worker(role="prefill", queued_tokens=s.queued_tokens)
            w.id, w.epoch, w.num_pages, w.free_pages = name, s.epoch, s.num_pages, s.free_pages
            workers.append(w)
        snapshot = self.router.workers.snapshot()
        placements = self.router.placements
        return pb.ServerInfo(
            version=version("splitserve"),
            model=self.model.name,
            max_model_len=self.model.max_model_len,
            page_size=self.model.page_size,
            num_prefill_workers=len(snapshot.prefill),
            num_decode_workers=len(snapshot.decode),
            workers=workers,
            routing_policy=self.router.policy.name.value,
            placement_available=placements is not None and placements.available,
        )


def _client(context: grpc.aio.ServicerContext) -> str:
    """Who sent the call, for the per-client limit: its key (`authorization` metadata)
    if it sent one, else its address without the port."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return f"key {value}"
    peer = context.peer().removeprefix("ipv4:").removeprefix("ipv6:")
    return f"peer {peer.rsplit(':', 1)[0].strip('[]')}"


def _response(delta: TokenDelta, final: Final | None) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=delta.request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=delta.logprobs,
        top_logprobs=[
            pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[v for _, v in top])
            for top in delta.top_logprobs
        ],
        prompt_logprobs=[
            pb.PromptLogprob(
                token_id=token,
                logprob=lp,
                top=pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[v for _, v in top]),
            )
            for token, lp, top in delta.prompt_logprobs or ()
        ],
    )
    if final is not None and delta.finish_reason is not None:
        msg.finish_reason = FINISH[delta.finish_reason]
        u, t = final.usage, final.timing
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
                completion_tokens=u.completion_tokens,
            )
        )
        msg.timing.CopyFrom(
            pb.Timing(
                queue_ms=t.queue_ms,
                prefill_ms=t.prefill_ms,
                transfer_ms=t.transfer_ms,
                first_token_ms=t.first_token_ms,
                total_ms=t.total_ms,
            )
        )
        msg.decode_worker = final.route.decode
        msg.prefill_worker = final.route.prefill or ""
    return msg


class RouterServer:
    """The router's gRPC server with health (NOT_SERVING without a live decode worker)
    and reflection, bound to config.host:config.port: over TLS with `tls` (router/tls.py),
    else plain text. With an api_key, Generation's calls without it are UNAUTHENTICATED
    (router/auth.py)."""

    def __init__(
        self,
        servicer: GenerationServicer,
        config: RouterConfig,
        api_key: tuple[str, ...] | None = None,  # any one of them
        tls: grpc.ServerCredentials | None = None,
    ) -> None:
        self.config = config
        self.servicer = servicer
        self.health = health.aio.HealthServicer()
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a second server on this port fails, not shares it
        ]
        interceptors = [GrpcKeyCheck(api_key, SERVICE)] if api_key is not None else []
        # grpc's own limit on calls: the backstop of a burst (router/admission.py).
        limit = grpc_limit(config.max_pending)
        self.server = grpc.aio.server(
            options=options, interceptors=interceptors, maximum_concurrent_rpcs=limit
        )
        _add_generation(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), self.server)
        try:
            address = f"{config.host}:{config.port}"
            if tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, tls)
        except RuntimeError as e:  # grpc's word for a port it cannot bind
            raise OSError(f"router.port: cannot listen on {config.host}:{config.port}") from e

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.NOT_SERVING
        if serving:
            status = health_pb2.HealthCheckResponse.SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls; let calls in flight run up to grace_s, then cancel them."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def _add_generation(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """The generated registration, but a Generate message that does not parse reaches
    the servicer as an Unparsable (grpc would answer UNKNOWN and log a traceback)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=parse_generate,
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=pb.ListModelsRequest.FromString,
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetServerInfo,
            request_deserializer=pb.GetServerInfoRequest.FromString,
            response_serializer=pb.ServerInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
