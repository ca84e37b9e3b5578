"""How `splitserve bench chaos`'s pressure scenarios talk to the front doors: one request
in, one Call out, over gRPC or the OpenAI HTTP API, with the client's key sent as
`authorization: Bearer KEY` (the router's per-client limit counts by it).

A Call keeps what the scenarios check: when the request started and ended, its status
(OK, the gRPC code's name, or HTTP_<status>), what it streamed (token ids over gRPC, text
over HTTP, which carries no ids), when each piece of it came (a gRPC message, an HTTP
event) and, for a refusal, what its message starts with (the limit it names).
"""

from __future__ import annotations

import json
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
    arrivals: tuple[float, ...] = ()  # each piece's arrival, the first one's included
    detail: str = ""  # a refusal's message up to its first colon: the limit it names

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
        arrivals: list[float] = []
        metadata = (("authorization", f"Bearer {key}"),)
        start = time.perf_counter()
        try:
            async for piece in self.stub.Generate(msg, metadata=metadata):
                if piece.token_ids:
                    arrivals.append(time.perf_counter())
                    if first is not None and len(arrivals) == 1:
                        first()
                ids.extend(piece.token_ids)
        except grpc.aio.AioRpcError as e:
            why = (e.details() or "").split(":")[0]
            return Call(start, time.perf_counter(), e.code().name, tuple(ids), *_at(arrivals), why)
        return Call(start, time.perf_counter(), OK, tuple(ids), *_at(arrivals))

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
        arrivals: list[float] = []
        status = OK
        start = time.perf_counter()
        headers = {"Authorization": f"Bearer {key}"}
        async with self.http.post(f"{self.url}/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                why = _message(await r.read()).split(":")[0]
                return Call(start, time.perf_counter(), f"HTTP_{r.status}", "", detail=why)
            async for at, event in sse_events(r.content):
                if "error" in event:
                    status = "STREAM_ERROR"
                    break
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        arrivals.append(at)
                        if first is not None and len(arrivals) == 1:
                            first()
                    text.append(choice.get("text") or "")
        return Call(start, time.perf_counter(), status, "".join(text), *_at(arrivals))

    async def close(self) -> None:
        await self.http.close()


def _at(arrivals: list[float]) -> tuple[float | None, tuple[float, ...]]:
    """A Call's `first_at` and `arrivals`."""
    return (arrivals[0] if arrivals else None), tuple(arrivals)


def _message(body: bytes) -> str:
    """An OpenAI error body's message ("" for any other body)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""
