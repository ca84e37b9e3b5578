"""How `splitserve bench serve` talks to a server: one request in, one RequestRecord out.

Two backends, the same contract (`send`: stream one request to its end or its error, and
return its record and the reply's token ids), so one metrics path serves both:
- `grpc`: splitserve's own API (splitserve.client). Each streamed message carries its token
  ids; a failure is recorded by its gRPC status name. The last message brings the server's
  timings and its cached prompt tokens.
- `openai`: any OpenAI-compatible server (splitserve's HTTP front door, vLLM, ...) over
  aiohttp: POST /v1/completions with the prompt as token ids (both servers see exactly the
  same prompt), or /v1/chat/completions with the ids decoded to text as one user message
  (the server's usage gives the prompt's length). Greedy, `max_tokens` = the output
  length and `ignore_eos` (vLLM's extra field, which splitserve accepts too), streamed
  with `stream_options.include_usage`. Chunks are counted in tokens by the logprobs asked
  for with them (`logprobs: 0` / `true`: one entry per token), so a chunk of k tokens is
  one message of k tokens, as on gRPC; a server that sends no logprobs counts one token
  per chunk with text. A failure is recorded as `HTTP_<status>`, `STREAM_ERROR` (an error
  event mid-stream), `DEADLINE_EXCEEDED` or the client error's name.
Times are taken when a message arrives, before it is parsed.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol

import aiohttp
import grpc
from google.protobuf import json_format

from cluster.engine.model.tokenizer import Tokenizer
from splitserve.client import Client
from splitserve.serve_metrics import OK, RequestRecord, ServerTiming

Endpoint = Literal["completions", "chat"]
SESSION_HEADER = "X-Session-Id"  # splitserve's affinity header; other servers ignore it


class Backend(Protocol):
    async def info(self) -> dict[str, Any]:
        """What the server says about itself, for the results' JSON."""
        ...

    async def send(
        self, prompt: list[int], max_tokens: int, session_id: str, timeout_s: float
    ) -> tuple[RequestRecord, list[int]]:
        """One request, streamed to its end or its error: its record and the reply's ids."""
        ...


class GrpcBackend:
    def __init__(self, client: Client) -> None:
        self.client = client

    async def info(self) -> dict[str, Any]:
        return json_format.MessageToDict(await self.client.server_info())

    async def send(
        self, prompt: list[int], max_tokens: int, session_id: str, timeout_s: float
    ) -> tuple[RequestRecord, list[int]]:
        messages: list[tuple[float, int]] = []
        reply: list[int] = []
        status, last = OK, None
        sent = time.perf_counter()
        try:
            async for piece in self.client.stream(
                prompt, timeout_s, max_tokens=max_tokens, ignore_eos=True, session_id=session_id
            ):
                if piece.token_ids:
                    messages.append((time.perf_counter(), len(piece.token_ids)))
                    reply.extend(piece.token_ids)
                last = piece
        except grpc.aio.AioRpcError as e:
            status = e.code().name
        end = time.perf_counter()
        timing, cached = None, 0
        if status == OK and last is not None:
            t = last.timing
            timing = ServerTiming(
                t.queue_ms, t.prefill_ms, t.transfer_ms, t.first_token_ms, t.total_ms
            )
            cached = last.usage.cached_prompt_tokens
        record = RequestRecord(sent, end, tuple(messages), len(prompt), status, cached, timing)
        return record, reply


class OpenAIBackend:
    """`tokenizer` (the workload's vocabulary) is needed for chat, which sends text, and
    for multi-turn, whose next prompt holds the reply's ids (its text, encoded)."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        models: list[dict[str, Any]],
        endpoint: Endpoint,
        tokenizer: Tokenizer | None,
    ) -> None:
        assert endpoint == "completions" or tokenizer is not None
        self.http, self.url, self.models = http, url, models
        self.model = models[0]["id"]  # the first served model is the one measured
        self.endpoint, self.tokenizer = endpoint, tokenizer

    async def info(self) -> dict[str, Any]:
        return {"url": self.url, "endpoint": self.endpoint, "models": self.models}

    def _body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            assert self.tokenizer is not None
            content = self.tokenizer.decode(prompt)
            return {**body, "messages": [{"role": "user", "content": content}], "logprobs": True}
        return {**body, "prompt": prompt, "logprobs": 0}

    async def send(
        self, prompt: list[int], max_tokens: int, session_id: str, timeout_s: float
    ) -> tuple[RequestRecord, list[int]]:
        headers = {SESSION_HEADER: session_id} if session_id else {}
        url = f"{self.url}/v1/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"
        messages: list[tuple[float, int]] = []
        text: list[str] = []
        usage: dict[str, Any] = {}
        status = OK
        sent = time.perf_counter()
        try:
            async with self.http.post(
                url,
                json=self._body(prompt, max_tokens),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as r:
                if r.status != 200:
                    status = f"HTTP_{r.status}"
                    await r.read()
                else:
                    async for at, event in sse_events(r.content):
                        if "error" in event:
                            status = "STREAM_ERROR"
                            break
                        usage = event.get("usage") or usage
                        for choice in event.get("choices", []):
                            piece, n = _piece(choice)
                            text.append(piece)
                            if n:
                                messages.append((at, n))
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
        except aiohttp.ClientError as e:
            status = type(e).__name__
        end = time.perf_counter()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        prompt_tokens = usage.get("prompt_tokens", len(prompt))
        record = RequestRecord(sent, end, tuple(messages), prompt_tokens, status, cached)
        reply = self.tokenizer.encode("".join(text)) if self.tokenizer is not None else []
        return record, reply


async def sse_events(stream: aiohttp.StreamReader) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """Server-sent events' JSON payloads up to `[DONE]`, each with its arrival time."""
    async for line in stream:
        at = time.perf_counter()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield at, json.loads(data)


def _piece(choice: dict[str, Any]) -> tuple[str, int]:
    """A streamed choice's text and its number of tokens (see the module's docstring)."""
    if "delta" in choice:
        text = choice["delta"].get("content") or ""
        tokens = (choice.get("logprobs") or {}).get("content")
    else:
        text = choice.get("text") or ""
        tokens = (choice.get("logprobs") or {}).get("tokens")
    return text, len(tokens) if tokens is not None else int(bool(text))


@asynccontextmanager
async def connect(
    kind: str, target: str, endpoint: Endpoint, tokenizer: Tokenizer | None
) -> AsyncIterator[Backend]:
    """A backend to the server at `target` (gRPC: HOST:PORT; openai: its base URL)."""
    if kind == "grpc":
        async with Client(target) as client:
            yield GrpcBackend(client)
        return
    url = target.rstrip("/")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async with http.get(f"{url}/v1/models") as r:
            r.raise_for_status()
            models = (await r.json())["data"]
        yield OpenAIBackend(http, url, models, endpoint, tokenizer)
