"""The Dispatcher hands a decode step's deltas out DELIVER_SLICE streams per turn of the
event loop: whatever else is ready (a new request's admission or refusal) runs after the
first slice, not after the whole step. A decode worker's deltas that come before the
prefill worker's first token wait for it; without it, the stream is lost."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from cluster.types import (
    FinishReason,
    FirstToken,
    RequestId,
    SampledToken,
    SamplingParams,
    Submission,
    TokenDelta,
)
from router.dispatch import DELIVER_SLICE, Dispatcher, Progress, WorkerLost, _Stream

STREAMS = 10 * DELIVER_SLICE


class _Outputs:
    """A decode worker's outbox: one step's deltas, then nothing more."""

    def __init__(self, step: list[TokenDelta], arrived: Any) -> None:
        self.step, self.arrived = step, arrived

    def remote(self, reader: str, cursor: int, wait_s: float) -> Any:
        return self._next(cursor)

    async def _next(self, cursor: int) -> tuple[int, list[TokenDelta]]:
        if cursor:
            await asyncio.Event().wait()  # no second step
        asyncio.get_running_loop().call_soon(self.arrived)  # ready as the step lands
        return 1, self.step


class _Decode:
    def __init__(self, step: list[TokenDelta], arrived: Any) -> None:
        self.outputs = _Outputs(step, arrived)


def test_a_step_is_handed_out_a_slice_at_a_time_with_the_loop_in_between() -> None:
    async def go() -> tuple[int, int]:
        dispatcher = Dispatcher()
        rids = [RequestId(f"r{i}") for i in range(STREAMS)]
        step = [TokenDelta(RequestId(f"{rid}.0"), 0, (7,), "x") for rid in rids]
        queues: list[asyncio.Queue[TokenDelta | str | Exception]] = []
        seen: list[int] = []

        def arrived() -> None:  # what else the loop had to do when the step came
            seen.append(sum(q.qsize() for q in queues))

        decode: Any = _Decode(step, arrived)
        for rid in rids:
            queues.append(asyncio.Queue())
            request = ([1], SamplingParams(), 0)  # prompt, sampling, tokens resumed
            stream = _Stream(RequestId(f"{rid}.0"), queues[-1], decode, None, Progress(), *request)
            dispatcher._streams[rid] = stream
        dispatcher._poll(decode)
        while sum(q.qsize() for q in queues) < STREAMS:
            await asyncio.sleep(0)
        await dispatcher.close()
        return seen[0], sum(q.qsize() for q in queues)

    before_other_work, delivered = asyncio.run(go())
    assert before_other_work <= DELIVER_SLICE
    assert delivered == STREAMS


class _Remote:
    """An actor method: `remote(...)` gives an awaitable of `call(...)`."""

    def __init__(self, call: Callable[..., Awaitable[Any]]) -> None:
        self.remote = call


class _Pair:
    """A prefill worker whose first token comes back only when the test says (or never:
    it dies), paired with a decode worker that has the rest of the request's tokens out
    already: (8, "b"), then (9, "c") ending it."""

    def __init__(self) -> None:
        self.rid = asyncio.get_running_loop().create_future()
        self.reply = asyncio.get_running_loop().create_future()
        self.prefill = type("Prefill", (), {"prefill": _Remote(self._prefill)})()
        self.decode = type("Decode", (), {"outputs": _Remote(self._outputs)})()

    async def _prefill(self, submission: Submission, decode: Any) -> FirstToken:
        assert submission.remote_prefill  # the KV is pushed to `decode`, which reserves for it
        self.rid.set_result(submission.request_id)
        return await self.reply

    async def _outputs(self, reader: str, cursor: int, wait_s: float) -> Any:
        if cursor:
            await asyncio.Event().wait()
        rid = await self.rid
        ahead = [
            TokenDelta(rid, 1, (8,), "b", text_offset=1),
            TokenDelta(rid, 2, (9,), "c", finish_reason=FinishReason.LENGTH, text_offset=2),
        ]
        return 1, ahead


def test_decode_deltas_ahead_of_the_prefill_workers_first_token_wait_for_it() -> None:
    async def go() -> list[TokenDelta]:
        pair, dispatcher = _Pair(), Dispatcher()
        stream = dispatcher.generate(
            [1, 2], SamplingParams(max_tokens=3), pair.decode, pair.prefill
        )
        got = asyncio.ensure_future(_all(stream))
        await pair.rid
        for _ in range(20):  # the decode worker's deltas are in; the stream holds them
            await asyncio.sleep(0)
        assert not got.done()
        pair.reply.set_result(FirstToken(SampledToken(7, None), "a"))
        deltas = await got
        await dispatcher.close()
        return deltas

    deltas = asyncio.run(go())
    assert [(d.index, d.token_ids, d.text) for d in deltas] == [
        (0, (7,), "a"),
        (1, (8,), "b"),
        (2, (9,), "c"),
    ]
    assert deltas[-1].finish_reason is FinishReason.LENGTH


def test_a_first_token_queued_right_behind_the_decode_workers_deltas_goes_first() -> None:
    """The prefill worker's reply lands in the same turn of the loop as the decode worker's
    deltas, after them, and its call has ended before the stream reads any of it."""

    async def go() -> list[TokenDelta]:
        pair, dispatcher = _Pair(), Dispatcher()

        async def prefill(submission: Submission, decode: Any) -> FirstToken:
            pair.rid.set_result(submission.request_id)
            await asyncio.sleep(0)  # the decode worker's deltas are queued meanwhile
            return FirstToken(SampledToken(7, None), "a")

        pair.prefill.prefill = _Remote(prefill)
        stream = dispatcher.generate(
            [1, 2], SamplingParams(max_tokens=3), pair.decode, pair.prefill
        )
        deltas = await _all(stream)
        await dispatcher.close()
        return deltas

    assert [d.token_ids for d in asyncio.run(go())] == [(7,), (8,), (9,)]


def test_a_prefill_worker_that_dies_with_the_first_token_loses_the_stream() -> None:
    """Its KV reached the decode worker, which decodes on, but its reply never comes: the
    stream ends with WorkerLost, the decode worker not dead, so the router moves it."""

    async def go() -> WorkerLost:
        pair, dispatcher = _Pair(), Dispatcher()
        stream = dispatcher.generate(
            [1, 2], SamplingParams(max_tokens=3), pair.decode, pair.prefill
        )
        got = asyncio.ensure_future(_all(stream))
        await pair.rid
        for _ in range(20):
            await asyncio.sleep(0)
        pair.decode.submit = _Remote(_in_flight)  # the router asks it to prefill: it has it
        pair.decode.transfer_failed = _Remote(_here)
        pair.reply.set_exception(ActorDiedError())
        with pytest.raises(WorkerLost) as lost:
            await got
        await dispatcher.close()
        return lost.value

    lost = asyncio.run(go())
    assert not lost.dead and "first token" in str(lost)


def test_after_a_move_a_dead_prefill_worker_is_still_reported_to_the_new_decode_worker() -> None:
    """The request decoded in its first attempt; in the second, its prefill worker dies
    before the KV is there: the new decode worker hears at once that no WRITE can land
    (it recomputes now instead of waiting out its lease)."""

    async def go() -> tuple[list[RequestId], list[RequestId]]:
        dispatcher, called, asked, told = Dispatcher(), asyncio.Event(), [], []

        async def prefill(submission: Submission, decode: Any) -> FirstToken:
            asked.append(submission.request_id)
            called.set()
            await asyncio.Event().wait()  # it dies before it answers
            raise AssertionError

        async def transfer_failed(rid: RequestId, why: str) -> bool:
            told.append(rid)
            return True

        async def outputs(*args: Any) -> Any:
            await asyncio.Event().wait()  # no delta of the second attempt yet

        async def nothing(*args: Any) -> None:
            return None

        worker = type("Worker", (), {})
        p, d = worker(), worker()
        p.prefill, p.abort = _Remote(prefill), _Remote(nothing)
        d.outputs, d.abort = _Remote(outputs), _Remote(nothing)
        d.transfer_failed = _Remote(transfer_failed)
        moved = Progress(token_ids=[5], chars=1, first_token_at=1.0, kv_ready_at=2.0)
        stream = dispatcher.generate([1, 2], SamplingParams(max_tokens=3), d, p, None, moved)
        task = asyncio.ensure_future(_all(stream))
        await called.wait()
        before = set(dispatcher._tasks)
        dispatcher.prefill_died(p, "gone")
        await asyncio.gather(*(dispatcher._tasks - before))  # what it set off has run
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await dispatcher.close()
        return asked, told

    asked, told = asyncio.run(go())
    assert told == asked and len(told) == 1


async def _all(stream: Any) -> list[TokenDelta]:
    return [d async for d in stream]


async def _in_flight(submission: Submission) -> None:
    from cluster.types import InFlightError

    raise InFlightError(f"request_id: {submission.request_id!r} is already in flight")


async def _here(rid: RequestId, why: str) -> bool:
    return True
