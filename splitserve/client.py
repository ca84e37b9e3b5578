"""A small asyncio client for a splitserve server (what `splitserve chat` uses).

    async with Client("127.0.0.1:50051") as client:  # TLS: Client(..., ssl_ca="ca.pem")
        async for piece in client.stream("The capital of France is", max_tokens=16):
            print(piece.text, end="")
        reply = await client.generate([{"role": "user", "content": "Hi!"}], session_id="s1")

Errors come as grpc.aio.AioRpcError with the server's status code and message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve_api.v1 import splitserve_pb2 as pb
from splitserve_api.v1 import splitserve_pb2_grpc as pb_grpc

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


@dataclass(frozen=True)
class Reply:
    """A whole reply, collected from its stream."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    usage: pb.Usage
    timing: pb.Timing
    decode_worker: str
    prefill_worker: str  # empty: the decode worker prefilled it


def request(
    prompt: Prompt,
    session_id: str = "",
    request_id: str = "",
    model: str = "",
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest: text for a str, token ids for ints, chat for role/content dicts.
    `sampling` takes SamplingParams' fields (max_tokens, temperature, seed, ...)."""
    msg = pb.GenerateRequest(
        session_id=session_id,
        request_id=request_id,
        model=model,
        sampling=pb.SamplingParams(**sampling),
    )
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        for item in prompt:
            if isinstance(item, dict):
                msg.chat.messages.append(pb.ChatMessage(**item))
            else:
                msg.token_ids.ids.append(item)
    return msg


class Client:
    """`api_key`: sent as `authorization: Bearer <key>` metadata on every call. `ssl_ca`:
    talk TLS, trusting the CA certificate(s) in this PEM file (a self-signed server's own
    certificate will do); None: plain text."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        api_key: str | None = None,
        ssl_ca: str | None = None,
    ) -> None:
        self.address = address
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        if ssl_ca is None:
            self.channel = grpc.aio.insecure_channel(address)
        else:
            trusted = grpc.ssl_channel_credentials(Path(ssl_ca).read_bytes())
            self.channel = grpc.aio.secure_channel(address, trusted)
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def stream(
        self,
        prompt: Prompt,
        timeout_s: float | None = None,
        wait_for_ready: bool = False,
        **fields: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The reply as the server streams it; leaving the loop early cancels the request.
        `wait_for_ready`: a server not up yet is waited for (until timeout_s), not refused."""
        msg = request(prompt, **fields)
        call = self.stub.Generate(
            msg, timeout=timeout_s, wait_for_ready=wait_for_ready, metadata=self.metadata
        )
        try:
            async for piece in call:
                yield piece
        finally:
            call.cancel()

    async def generate(
        self, prompt: Prompt, timeout_s: float | None = None, **fields: Any
    ) -> Reply:
        text: list[str] = []
        ids: list[int] = []
        last = pb.GenerateResponse()
        async for piece in self.stream(prompt, timeout_s, **fields):
            text.append(piece.text)
            ids.extend(piece.token_ids)
            last = piece
        return Reply(
            last.request_id,
            "".join(text),
            ids,
            pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower(),
            last.usage,
            last.timing,
            last.decode_worker,
            last.prefill_worker,
        )

    async def models(self) -> list[pb.Model]:
        return list(
            (await self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata)).models
        )

    async def server_info(self) -> pb.ServerInfo:
        info: pb.ServerInfo = await self.stub.GetServerInfo(
            pb.GetServerInfoRequest(), metadata=self.metadata
        )
        return info

    async def health(self, service: str = "") -> str:
        """SERVING or NOT_SERVING, from the standard gRPC health service."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return name
