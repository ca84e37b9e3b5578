"""Running requests through the Dispatcher in tests: collect a whole stream."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cluster.types import FinishReason, RequestId, SamplingParams, TokenDelta
from router.dispatch import Dispatcher, Progress

T = TypeVar("T")


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    error: str | None = None
    deltas: list[TokenDelta] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)


async def collect(
    disp: Dispatcher,
    ids: list[int],
    sp: SamplingParams,
    decode: Any,
    prefill: Any = None,
    request_id: str | None = None,
) -> Result:
    out = Result()
    rid = RequestId(request_id) if request_id else None
    async for d in disp.generate(ids, sp, decode, prefill, rid, out.progress):
        assert d.index == len(out.tokens), "deltas arrive in order with no gap"
        out.tokens += d.token_ids
        out.text += d.text
        out.deltas.append(d)
        out.finish, out.error = d.finish_reason, d.error
    return out


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
