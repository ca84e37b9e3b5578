"""End to end over real gRPC, Ray, UCX and a Redis-protocol server: the router's contract."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from redis import Redis

from cluster.engine.engine import LLMEngine
from cluster.types import RequestId, SamplingParams
from router import request
from router.request import MAX_CHARS_PER_TOKEN
from router.server import UNPARSABLE_LOG_EVERY_S, RouterServer
from router.token_count import count_tokens
from splitserve.client import Client
from splitserve.redis_server import EmbeddedRedis
from tests.helpers import until, wait_until
from tests.integration.router_harness import RouterHarness, ask
from tests.unit.test_unparsable import CORRUPT


@pytest.fixture(scope="module")
def redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def routers(ray_workers: Any, redis: EmbeddedRedis) -> Iterator[tuple[RouterHarness, ...]]:
    """Two routers sharing one Redis, over one prefill and two decode workers."""
    prefill = {"prefill": ray_workers.prefill("prefill")}
    decode = {
        "decode": ray_workers.decode("decode", local_prefill_tokens=0),
        "colocated": ray_workers.decode("colocated"),
    }
    pair = (RouterHarness(prefill, decode, redis.url), RouterHarness(prefill, decode, redis.url))
    yield pair
    for r in pair:
        r.stop()


def _story(tag: str, words: int) -> str:
    """A prompt no other test sends (this module's tests share its workers' prefix caches)."""
    return f"[{tag}] " + " ".join(
        f"The {tag} river flows past hill number {i}." for i in range(words)
    )


@pytest.mark.parametrize(
    "kind, sampling",
    [
        ("text", {"max_tokens": 16}),
        ("chat", {"max_tokens": 16}),
        ("long", {"max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 7}),
        ("token_ids", {"max_tokens": 12, "temperature": 1.0, "top_k": 20, "seed": 3}),
    ],
)
def test_stream_equals_offline_engine(
    routers: tuple[RouterHarness, ...],
    workers: Any,
    twin: LLMEngine,
    kind: str,
    sampling: dict[str, Any],
) -> None:
    tok = twin.tokenizer
    prompt: Any
    if kind == "text":
        prompt = "The three primary colours are"
        ids = tok.encode(prompt)
    elif kind == "chat":
        prompt = [{"role": "user", "content": "Name a planet with rings."}]
        ids = tok.encode(tok.apply_chat_template(prompt))
    elif kind == "long":  # long enough that a prefill worker computes it
        prompt = _story("offline", 12)
        ids = tok.encode(prompt)
    else:
        ids = tok.encode("Count with me: one, two, three,")
        prompt = ids
    reply = ask(routers[0].address, prompt, **sampling)
    offline = twin.generate([ids], SamplingParams(**sampling))[0]
    assert reply.token_ids == offline.token_ids
    assert reply.text == offline.text
    assert reply.finish_reason == offline.finish_reason.value
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == len(offline.token_ids)
    assert 0 < reply.timing.first_token_ms <= reply.timing.total_ms
    if kind == "long":
        assert reply.prefill_worker == "prefill"
        assert reply.timing.transfer_ms >= 0 and reply.timing.prefill_ms > 0


def test_two_routers_stream_at_once_over_the_same_workers(
    routers: tuple[RouterHarness, ...], workers: Any, twin: LLMEngine
) -> None:
    """Each router reads only its own requests' tokens from a shared decode worker."""
    prompts = [f"Fact number {i} about owls:" for i in range(6)]

    async def one(address: str, prompt: str) -> Any:
        async with Client(address) as client:
            return await client.generate(prompt, max_tokens=20, ignore_eos=True, timeout_s=120)

    async def all_at_once() -> list[Any]:
        jobs = [one(routers[i % 2].address, p) for i, p in enumerate(prompts)]
        return await asyncio.gather(*jobs)

    replies = asyncio.run(all_at_once())
    offline = twin.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [r.token_ids for r in replies] == [c.token_ids for c in offline]
    assert {r.decode_worker for r in replies} == {"decode", "colocated"}


def _busy_worker(address: str, timeout_s: float = 20) -> str:
    """The decode worker with a running sequence, once the router's loads show one."""

    async def run() -> str:
        busy: list[str] = []
        async with Client(address) as client:

            async def probe() -> bool:
                info = await client.server_info()
                busy[:] = [w.id for w in info.workers if w.role == "decode" and w.running]
                return bool(busy)

            await until(probe, "a decode worker to be busy", timeout_s)
        return busy[0]

    return asyncio.run(run())


def _until(harness: RouterHarness, holds: Callable[[], bool], timeout_s: float = 60) -> None:
    """Wait until `holds()` is true on the router's loop (where its state changes)."""

    async def check() -> bool:
        return holds()

    wait_until(lambda: harness.call(check()), "the router", timeout_s)


def _hold_worker_busy(address: str, **fields: Any) -> tuple[asyncio.AbstractEventLoop, Any]:
    """Start a long generation in the background; returns its loop and future."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def run() -> Any:
        async with Client(address) as client:
            return await client.generate(
                _story("busy" + uuid.uuid4().hex[:6], 2), max_tokens=120, ignore_eos=True, **fields
            )

    return loop, asyncio.run_coroutine_threadsafe(run(), loop)


def test_second_turn_lands_on_the_worker_holding_its_kv(
    routers: tuple[RouterHarness, ...], workers: Any
) -> None:
    a, b = routers
    session = "s-" + uuid.uuid4().hex
    turn1 = [{"role": "user", "content": _story("turns", 60)}]
    r1 = ask(a.address, turn1, session_id=session, max_tokens=16)
    assert r1.usage.prompt_tokens > 500
    # Keep r1's worker busy, so a load-only choice would send turn two elsewhere; busy
    # from now on, once the router's loads show r1 done.
    idle = lambda: all(w.running == w.waiting == 0 for w in a.app.workers.snapshot().decode)
    _until(a, idle)
    loop, busy = _hold_worker_busy(a.address)
    try:
        assert _busy_worker(a.address) == r1.decode_worker
        turn2 = [*turn1, {"role": "assistant", "content": r1.text}]
        turn2.append({"role": "user", "content": "And then?"})
        # The second router reads the placement the first one wrote.
        r2 = ask(b.address, turn2, session_id=session, max_tokens=8)
        assert r2.decode_worker == r1.decode_worker
        computed = r2.usage.prompt_tokens - r2.usage.cached_prompt_tokens
        assert r2.usage.prompt_tokens > r1.usage.prompt_tokens + r1.usage.completion_tokens
        assert computed <= 64, r2.usage
        # Without a session the prefix index finds the same worker: it holds the prompt.
        r3 = ask(b.address, turn2, max_tokens=8)
        assert r3.decode_worker == r1.decode_worker
        assert r3.usage.cached_prompt_tokens >= r2.usage.cached_prompt_tokens
        assert r3.token_ids == r2.token_ids
    finally:
        busy.result(120)
        loop.call_soon_threadsafe(loop.stop)


BAD = [
    ({"prompt": ""}, "text"),
    ({"prompt": [70000]}, "token_ids"),
    ({"prompt": [-1]}, "token_ids"),
    ({"prompt": [{"role": "robot", "content": "hi"}]}, "chat.messages[0].role"),
    ({"prompt": "x" * 300_000}, "text"),
    ({"prompt": "hi", "max_tokens": 0}, "sampling.max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**6}, "sampling.max_tokens"),
    ({"prompt": "hi", "temperature": -1.0}, "sampling.temperature"),
    ({"prompt": "hi", "temperature": float("nan")}, "sampling.temperature"),
    ({"prompt": "hi", "top_p": 0.0}, "sampling.top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "sampling.top_p"),
    ({"prompt": "hi", "top_k": -2}, "sampling.top_k"),
    ({"prompt": "hi", "min_p": 2.0}, "sampling.min_p"),
    ({"prompt": "hi", "stop": [""]}, "sampling.stop"),
    ({"prompt": "hi", "stop": ["x"] * 17}, "sampling.stop"),
    ({"prompt": "hi", "stop_token_ids": [10**9]}, "sampling.stop_token_ids"),
    ({"prompt": "hi", "session_id": "bad id with spaces"}, "session_id"),
    ({"prompt": "hi", "request_id": "x" * 200}, "request_id"),
    ({"prompt": "hi", "model": "gpt-9"}, "model"),
    ({"prompt": "hi", "model": "m" * 10_000}, "model"),  # echoed whole, it overflowed metadata
    ({"prompt": [{"role": "r" * 10_000, "content": "hi"}]}, "chat.messages[0].role"),
    ({"prompt": "word " * 9000}, "text"),
    # Fits the model's context but not a worker's whole KV cache (0.2 GB): the served
    # context is what that cache holds (LLMEngine caps it), so the router refuses it.
    ({"prompt": "word " * 900, "max_tokens": 4000}, "sampling.max_tokens: prompt"),
]


def test_bad_input_is_refused_by_field_and_the_server_keeps_serving(
    routers: tuple[RouterHarness, ...], workers: Any
) -> None:
    address = routers[0].address

    async def refuse(fields: dict[str, Any]) -> grpc.aio.AioRpcError:
        async with Client(address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate(**fields)
            return err.value

    for fields, name in BAD:
        e = asyncio.run(refuse(fields))
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (fields, e.details())
        assert (e.details() or "").startswith(name), (name, e.details())
        assert len(e.details() or "") < 400, "a value the caller sent is echoed cut short"
    no_input = asyncio.run(refuse({"prompt": []}))
    assert no_input.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input" in (no_input.details() or "")
    assert ask(address, "The sky is", max_tokens=4).usage.completion_tokens == 4


def test_a_message_that_does_not_parse_is_invalid_argument_and_logged_at_a_bounded_rate(
    routers: tuple[RouterHarness, ...], workers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    address = routers[0].address
    bad = [*CORRUPT.values()] * 4

    async def send_raw() -> list[tuple[grpc.StatusCode, str]]:
        async with grpc.aio.insecure_channel(address) as channel:
            call = channel.unary_stream(
                "/splitserve.v1.Generation/Generate",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            got = []
            for data in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call(data):
                        pass
                got.append((err.value.code(), err.value.details() or ""))
            return got

    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        got = asyncio.run(send_raw())
        elapsed = time.monotonic() - started
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in got), got
    assert all(why.startswith("request: not a GenerateRequest") for _, why in got), got
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    lines = [r for r in caplog.records if "did not parse" in r.getMessage()]
    assert 1 <= len(lines) <= 1 + elapsed / UNPARSABLE_LOG_EVERY_S
    assert ask(address, "Snow is", max_tokens=3).usage.completion_tokens == 3


def test_message_over_the_size_limit_is_refused(
    routers: tuple[RouterHarness, ...], workers: Any
) -> None:
    big = "y" * (5 * 2**20)  # over max_message_bytes (4 MiB)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        ask(routers[0].address, big)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ask(routers[0].address, "Water boils at", max_tokens=3).usage.completion_tokens == 3


def test_cancelled_and_expired_streams_free_every_page(
    routers: tuple[RouterHarness, ...], workers: Any
) -> None:
    address = routers[0].address

    async def cancel_after(pieces: int, prompt: str) -> int:
        got = 0
        async with Client(address) as client:
            async for _ in client.stream(prompt, max_tokens=200, ignore_eos=True):
                got += 1
                if got == pieces:
                    break  # leaving the stream cancels the call
        return got

    assert asyncio.run(cancel_after(2, "Tell me about the sea.")) == 2
    assert asyncio.run(cancel_after(1, _story("cancel", 20))) == 1  # remote prefill
    # 4,000 tokens cannot come within the deadline on any CPU: each decode step of one
    # stream reads the whole float32 model (540 MB), so 4,000 of them read 2 TB.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        ask(address, "Tell me about mountains.", max_tokens=4000, ignore_eos=True, timeout_s=1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    workers.assert_all_pages_free()
    assert all(r.app.router.pending == 0 for r in routers)


def test_past_max_pending_requests_are_refused_at_once(
    routers: tuple[RouterHarness, ...], workers: Any
) -> None:
    a = routers[0]
    a.app.router.max_pending = 1
    try:
        loop, busy = _hold_worker_busy(a.address)
        _until(a, lambda: a.app.router.pending == 1)  # the busy request holds the one slot
        with pytest.raises(grpc.aio.AioRpcError) as err:
            ask(a.address, "Hello there", max_tokens=4)
        # Refused, not queued behind the busy request (which would have answered it).
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_pending" in (err.value.details() or "")
        assert busy.result(120).usage.completion_tokens == 120
        loop.call_soon_threadsafe(loop.stop)
    finally:
        a.app.router.max_pending = 256
    assert ask(a.address, "Hello there", max_tokens=4).usage.completion_tokens == 4


def test_a_flood_of_long_texts_is_bounded_by_max_pending_and_a_short_request_gets_through(
    routers: tuple[RouterHarness, ...], workers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = routers[0]
    servicer = a.app.server.servicer
    lock = threading.Lock()
    active, peak = [0], [0]

    def counted(*args: Any) -> int:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return count_tokens(*args)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(request, "count_tokens", counted)
    # Just under the character limit, and no space to cut it at: counted whole (~65k
    # tokens) before it is refused.
    huge = "x" * (servicer.model.max_model_len * MAX_CHARS_PER_TOKEN - 16)

    async def one(client: Client, prompt: str) -> grpc.StatusCode:
        try:
            await client.generate(prompt, max_tokens=4)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()

    async def short_one(client: Client, flood: asyncio.Future[Any]) -> grpc.StatusCode:
        while (code := await one(client, "Rain falls on")) is grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert not flood.done() or a.app.router.pending < 2, "refused with a free slot"
        return code

    async def go() -> tuple[list[grpc.StatusCode], grpc.StatusCode]:
        async with Client(a.address) as client:
            flood = asyncio.gather(*(one(client, huge) for _ in range(12)))
            short = await short_one(client, flood)
            return await flood, short

    a.app.router.max_pending = 2
    try:
        flood, short = asyncio.run(go())
    finally:
        a.app.router.max_pending = 256
    refused = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}
    assert set(flood) <= refused and grpc.StatusCode.INVALID_ARGUMENT in flood, flood
    assert short is grpc.StatusCode.OK
    assert 1 <= peak[0] <= 2, f"{peak[0]} texts tokenized at once past max_pending 2"
    assert a.app.router.pending == 0


def test_a_request_id_already_in_flight_is_refused(
    routers: tuple[RouterHarness, ...], workers: Any
) -> None:
    a = routers[0]
    loop, busy = _hold_worker_busy(a.address, request_id="twice")
    try:
        _until(a, lambda: a.app.router.dispatcher.worker_id(RequestId("twice")) is not None)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            ask(a.address, "Hello there", max_tokens=4, request_id="twice")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id: 'twice' is already in flight" in (err.value.details() or "")
        assert busy.result(120).usage.completion_tokens == 120
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_an_id_reused_right_after_a_cancel_gets_its_own_reply(
    routers: tuple[RouterHarness, ...], workers: Any
) -> None:
    address = routers[0].address
    prompt = "Name three rivers of Europe."
    expected = ask(address, prompt, max_tokens=6, ignore_eos=True)

    async def cancel_then_reuse(rid: str) -> Any:
        async with Client(address) as client:
            async for _ in client.stream(prompt, max_tokens=200, ignore_eos=True, request_id=rid):
                break  # cancels the first use after its first token
            while True:  # until the router has seen the cancel; never ABORTED by it
                try:
                    return await client.generate(prompt, max_tokens=6, ignore_eos=True,
                                                 request_id=rid)  # fmt: skip
                except grpc.aio.AioRpcError as e:
                    if "already in flight" not in (e.details() or ""):
                        raise

    for i in range(8):
        reply = asyncio.run(cancel_then_reuse(f"reused-{i}"))
        assert (reply.request_id, reply.token_ids) == (f"reused-{i}", expected.token_ids)
    workers.assert_all_pages_free()
    assert all(r.app.router.pending == 0 for r in routers)


def test_redis_outage_fails_open_and_affinity_resumes(
    routers: tuple[RouterHarness, ...], workers: Any, redis: EmbeddedRedis
) -> None:
    a = routers[0]
    redis.stop()
    try:
        for i in range(3):
            reply = ask(a.address, f"Outage number {i} is", session_id=f"down-{i}", max_tokens=4)
            assert reply.usage.completion_tokens == 4
        info = asyncio.run(_server_info(a.address))
        assert not info.placement_available
        assert a.app.placements is not None and a.app.placements.failures >= 1
    finally:
        redis.start()
    store = a.app.placements

    async def reachable() -> bool:
        await store.get("probe")  # the store tries Redis again once retry_s has passed
        return store.available

    wait_until(lambda: a.call(reachable()), "the router's store to reach Redis again", 10)
    session = "back-" + uuid.uuid4().hex
    turn1 = [{"role": "user", "content": _story("back", 40)}]
    r1 = ask(a.address, turn1, session_id=session, max_tokens=8)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": r1.text},
        {"role": "user", "content": "Go on."},
    ]
    r2 = ask(a.address, turn2, session_id=session, max_tokens=4)
    assert asyncio.run(_server_info(a.address)).placement_available
    stored = Redis.from_url(redis.url).hgetall(f"splitserve:session:{session}")
    assert stored[b"decode_worker"].decode() == r1.decode_worker == r2.decode_worker
    assert r2.usage.prompt_tokens - r2.usage.cached_prompt_tokens <= 64


async def _server_info(address: str) -> Any:
    async with Client(address) as client:
        return await client.server_info()


def test_a_second_server_on_a_taken_port_fails_to_bind_instead_of_sharing_it(
    routers: tuple[RouterHarness, ...],
) -> None:
    first = routers[0].app.server
    config = dataclasses.replace(first.config, port=first.port)

    async def second() -> RouterServer:
        return RouterServer(first.servicer, config)

    with pytest.raises(OSError, match=f"router.port: cannot listen on {first.address}"):
        routers[0].call(second())
    assert ask(first.address, "Still here?", max_tokens=2).token_ids  # the first still serves
