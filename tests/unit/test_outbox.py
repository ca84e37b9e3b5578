"""Outboxes: each reader gets exactly its own requests' deltas, in order, once; a box
stays while a request claimed on it is live."""

from __future__ import annotations

import asyncio

from cluster.types import FinishReason, RequestId, TokenDelta
from decode_worker.outbox import Outboxes


def _delta(rid: str, index: int, done: bool = False) -> TokenDelta:
    reason = FinishReason.STOP if done else None
    return TokenDelta(RequestId(rid), index, (index,), str(index), (), reason)


def test_readers_see_only_their_own_requests_and_never_drop_each_others() -> None:
    async def go() -> None:
        boxes = Outboxes()
        boxes.claim("A")
        boxes.claim("B")
        boxes.publish([("A", _delta("a1", 0)), ("B", _delta("b1", 0)), ("A", _delta("a1", 1))])
        cursor_b, got_b = await boxes.read("B", 0, 0.01)
        assert [(d.request_id, d.index) for d in got_b] == [("b1", 0)]
        boxes.publish([("B", _delta("b1", 1, done=True))])
        cursor_b, got_b = await boxes.read("B", cursor_b, 0.01)  # B runs ahead of A
        assert [(d.request_id, d.index) for d in got_b] == [("b1", 1)]
        cursor_a, got_a = await boxes.read("A", 0, 0.01)
        assert [(d.request_id, d.index) for d in got_a] == [("a1", 0), ("a1", 1)]
        assert cursor_a == 2
        # Asking on acknowledges: the same deltas are not handed out twice.
        assert await boxes.read("A", cursor_a, 0.01) == (2, [])

    asyncio.run(go())


def test_a_box_with_a_live_request_is_kept_however_long_its_reader_is_away() -> None:
    async def go() -> None:
        now = [0.0]
        boxes = Outboxes(idle_s=60.0, clock=lambda: now[0])
        boxes.claim("A")
        boxes.claim("A")
        boxes.publish([("A", _delta("r", 0, done=True))])  # one of A's two is over
        now[0] = 61.0
        boxes.claim("B")
        await boxes.read("B", 0, 0.01)  # sweeps idle boxes with nothing live: not A's
        _, got = await boxes.read("A", 0, 0.01)
        assert [(d.request_id, d.index) for d in got] == [("r", 0)]

    asyncio.run(go())


def test_a_read_waits_for_the_next_delta_published_from_another_thread() -> None:
    async def go() -> None:
        boxes = Outboxes()
        boxes.claim("A")
        await boxes.read("A", 0, 0.01)  # binds the loop, as a polling reader does
        loop = asyncio.get_running_loop()
        deltas = [("A", _delta("r", 0))]
        loop.call_later(0.05, lambda: loop.run_in_executor(None, boxes.publish, deltas))
        _, got = await boxes.read("A", 0, 5.0)
        assert [d.index for d in got] == [0]

    asyncio.run(go())


def test_an_idle_reader_is_swept_and_coming_back_continues_its_numbering() -> None:
    async def go() -> None:
        now = [0.0]
        boxes = Outboxes(idle_s=60.0, clock=lambda: now[0])
        boxes.claim("A")
        boxes.publish([("A", _delta("r", 0)), ("A", _delta("r", 1, done=True))])
        cursor, _ = await boxes.read("A", 0, 0.01)
        await boxes.read("A", cursor, 0.01)  # acknowledged; nothing live: sweepable
        now[0] = 61.0  # A has not read for longer than idle_s
        boxes.claim("B")
        await boxes.read("B", 0, 0.01)  # sweeps A's empty box
        boxes.claim("A")  # A comes back, its cursor still at 2
        boxes.publish([("A", _delta("t", 0))])
        assert [d.request_id for d in (await boxes.read("A", cursor, 0.01))[1]] == ["t"]

    asyncio.run(go())
