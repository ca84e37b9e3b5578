"""How `splitserve bench chaos`'s pressure scenarios talk to the front doors: one request
in, one Call out, over gRPC or the OpenAI HTTP API, with the client's key sent as
`authorization: Bearer KEY` (the router's per-client limit counts by it).

A Call keeps what the scenarios check: when the request started and ended, its status
(OK, the gRPC code's name, or HTTP_<status>), what it streamed (token ids over gRPC, text
over HTTP, which carries no ids) and when its first token came.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import grpc

from splitserve.bench.serve_backend import sse_events
from splitserve.client import request
from splitserve.serve_metrics import OK
from splitserve_api.v1 import splitserve_pb2_grpc as pb_grpc

Prompt = list[int] | str


@dataclass(frozen=True)
class Call:
    start: float  # time.perf_counter()
    end: float
    status: str
    output: tuple[int, ...] | str  # token ids (gRPC) or text (HTTP)
    first_at: float | None = None  # the first token's arrival

    @property
    def latency_s(self) -> float:
        return self.end - self.start


class Door(Protocol):
    async def call(
        self, prompt: Prompt, max_tokens: int, key: str, first: Callable[[], None] | None = None
    ) -> Call:
        """One greedy request (ignore_eos) streamed to its end or its refusal; `first` is
        called when its first token arrives."""
        ...

    async def close(self) -> None: ...


class GrpcDoor:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def call(
        self, prompt: Prompt, max_tokens: int, key: str, first: Callable[[], None] | None = None
    ) -> Call:
        msg = request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids: list[int] = []
        first_at = None
        metadata = (("authorization", f"Bearer {key}"),)
        start = time.perf_counter()
        try:
            async for piece in self.stub.Generate(msg, metadata=metadata):
                if first_at is None and piece.token_ids:
                    first_at = time.perf_counter()
                    if first is not None:
                        first()
                ids.extend(piece.token_ids)
        except grpc.aio.AioRpcError as e:
            return Call(start, time.perf_counter(), e.code().name, tuple(ids), first_at)
        return Call(start, time.perf_counter(), OK, tuple(ids), first_at)

    async def close(self) -> None:
        await self.channel.close()


class HttpDoor:
    """POST /v1/completions, streamed; the prompt as token ids or as text."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def call(
        self, prompt: Prompt, max_tokens: int, key: str, first: Callable[[], None] | None = None
    ) -> Call:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        text: list[str] = []
        first_at = None
        status = OK
        start = time.perf_counter()
        headers = {"Authorization": f"Bearer {key}"}
        async with self.http.post(f"{self.url}/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                await r.read()
                return Call(start, time.perf_counter(), f"HTTP_{r.status}", "")
            async for at, event in sse_events(r.content):
                if "error" in event:
                    status = "STREAM_ERROR"
                    break
                for choice in event.get("choices", []):
                    if first_at is None and choice.get("text"):
                        first_at = at
                        if first is not None:
                            first()
                    text.append(choice.get("text") or "")
        return Call(start, time.perf_counter(), status, "".join(text), first_at)

    async def close(self) -> None:
        await self.http.close()
