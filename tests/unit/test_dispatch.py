"""The Dispatcher hands a decode step's deltas out DELIVER_SLICE streams per turn of the
event loop: whatever else is ready (a new request's admission or refusal) runs after the
first slice, not after the whole step."""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.types import RequestId, SamplingParams, TokenDelta
from router.dispatch import DELIVER_SLICE, Delivered, Dispatcher, Trace, _Stream

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
        step = [TokenDelta(rid, 0, (7,), "x") for rid in rids]
        queues: list[asyncio.Queue[TokenDelta | str | Exception]] = []
        seen: list[int] = []

        def arrived() -> None:  # what else the loop had to do when the step came
            seen.append(sum(q.qsize() for q in queues))

        decode: Any = _Decode(step, arrived)
        for rid in rids:
            queues.append(asyncio.Queue())
            request = ([1], SamplingParams(), 0)  # prompt, sampling, tokens resumed
            stream = _Stream(queues[-1], decode, None, Trace(), Delivered(), *request)
            dispatcher._streams[rid] = stream
        dispatcher._poll(decode)
        while sum(q.qsize() for q in queues) < STREAMS:
            await asyncio.sleep(0)
        await dispatcher.close()
        return seen[0], sum(q.qsize() for q in queues)

    before_other_work, delivered = asyncio.run(go())
    assert before_other_work <= DELIVER_SLICE
    assert delivered == STREAMS
