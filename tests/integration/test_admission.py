"""Admission at the front doors over real workers: an input too long for the context is
refused after counting about a context's worth of it, and a client past its own limit
(`max_pending_per_client`, by its key) is refused while another client gets in; each
refusal is counted by the limit that made it. A full router (`max_pending`) refuses on
both doors naming the limit, as often as a client retries, before reading an HTTP body; a
burst past gRPC's own limit is refused without stopping a stream or a health check; no
refusal leaves a slot, a page or a tokenize job behind."""

from __future__ import annotations

import asyncio
import json
import random
import string
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.admission import grpc_limit
from router.request import MAX_CHARS_PER_TOKEN
from router.token_count import CHUNK_CHARS, count_tokens
from splitserve.client import request
from splitserve_api.v1 import splitserve_pb2 as pb
from splitserve_api.v1 import splitserve_pb2_grpc as pb_grpc
from tests.helpers import wait_until
from tests.integration.router_harness import RouterHarness


@pytest.fixture(scope="module")
def router(ray_workers: Any) -> Iterator[RouterHarness]:
    prefill = {"prefill": ray_workers.prefill("prefill")}
    decode = {"colocated": ray_workers.decode("colocated")}
    harness = RouterHarness(prefill, decode, redis_url=None, http_port=0)
    yield harness
    harness.stop()


def _near_limit_text(max_model_len: int) -> str:
    """Random words just under the router's character bound: far more tokens than fit."""
    rng = random.Random(0)
    words = (
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        for _ in range(max_model_len * MAX_CHARS_PER_TOKEN)
    )
    return " ".join(words)[: max_model_len * MAX_CHARS_PER_TOKEN - 100]


def _refusals(router: RouterHarness, limit: str) -> float:
    value = router.app.metrics.registry.get_sample_value(
        "splitserve_refused_requests_total", {"limit": limit}
    )
    return value or 0.0


def test_a_text_past_the_context_is_refused_having_counted_about_a_context_of_it(
    router: RouterHarness, tok: Any, workers: Any
) -> None:
    max_model_len = router.app.server.servicer.model.max_model_len
    text = _near_limit_text(max_model_len)
    whole = len(tok.encode(text))
    counted = count_tokens(tok, text, max_model_len, special_tokens=True)
    assert whole > 3 * max_model_len  # tokenized whole, it would cost several contexts
    assert max_model_len <= counted < max_model_len + CHUNK_CHARS  # stopped a chunk past

    async def send(prompt: Any) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(request(prompt, max_tokens=4))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
            return refused.value

    chat = [{"role": "user", "content": text}]
    for prompt, kind in ((text, "text"), (chat, "chat")):
        refused = asyncio.run(send(prompt))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        why = refused.details() or ""
        assert why.startswith(f"{kind}: the prompt is more than {max_model_len - 1} tokens"), why
    assert router.app.http is not None
    body = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    post = urllib.request.Request(router.app.http.address + "/v1/completions", data=body)
    with pytest.raises(urllib.error.HTTPError) as http_refused:
        urllib.request.urlopen(post, timeout=60)
    assert http_refused.value.code == 400
    assert json.loads(http_refused.value.read())["error"]["param"] == "prompt"


def test_a_client_past_its_own_limit_is_refused_and_counted_while_another_gets_in(
    router: RouterHarness, workers: Any
) -> None:
    core = router.app.router
    assert router.app.http is not None
    http = router.app.http.address

    def post(key: str) -> int:
        body = json.dumps({"prompt": "Rain falls on", "max_tokens": 2}).encode()
        headers = {"Authorization": f"Bearer {key}"}
        call = urllib.request.Request(http + "/v1/completions", data=body, headers=headers)
        try:
            with urllib.request.urlopen(call, timeout=120) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return e.code

    async def go() -> tuple[grpc.aio.AioRpcError, int, int, int]:
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = pb_grpc.GenerationStub(channel)

            def generate(key: str, max_tokens: int) -> Any:
                msg = request("Tell me a long story.", max_tokens=max_tokens, ignore_eos=True)
                return stub.Generate(msg, metadata=(("authorization", f"Bearer {key}"),))

            held = generate("flood", 4000)  # cannot finish during the test: cancelled below
            await held.read()  # its first token: it holds its slot
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in generate("flood", 2):
                    pass
            others = [len([m async for m in generate("normal", 2)])]
            codes = await asyncio.gather(*(asyncio.to_thread(post, k) for k in ("flood", "x")))
            held.cancel()
            return refused.value, others[0], codes[0], codes[1]

    before = _refusals(router, "max_pending_per_client")
    core.max_pending_per_client = 1
    try:
        refused, normal_messages, flood_http, other_http = asyncio.run(go())
    finally:
        core.max_pending_per_client = None
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (refused.details() or "").startswith("max_pending_per_client: 1 requests")
    assert normal_messages >= 1  # the other client streamed its reply
    assert (flood_http, other_http) == (429, 200)
    assert _refusals(router, "max_pending_per_client") - before == 2
    wait_until(lambda: core.pending == 0, "the cancelled stream's slot to come back")
    assert not core.clients


MAX_PENDING = 2  # the small router's limit, from its config (gRPC's own limit is sized by it)


@pytest.fixture(scope="module")
def small(ray_workers: Any) -> Iterator[RouterHarness]:
    prefill = {"prefill": ray_workers.prefill("prefill")}
    decode = {"colocated": ray_workers.decode("colocated")}
    harness = RouterHarness(prefill, decode, None, http_port=0, max_pending=MAX_PENDING)
    yield harness
    harness.stop()


def _long(stub: pb_grpc.GenerationStub) -> Any:
    """A stream that cannot finish during a test (4,000 tokens): cancelled by the test."""
    return stub.Generate(request("Tell me a long story.", max_tokens=4000, ignore_eos=True))


async def _status(stub: pb_grpc.GenerationStub) -> tuple[str, str]:
    """One short request's end: its status code's name and its message."""
    try:
        async for _ in stub.Generate(request("Rain falls on", max_tokens=2)):
            pass
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details() or ""
    return "OK", ""


def _post(url: str, body: bytes) -> tuple[int, str | None, dict[str, Any]]:
    """A completions POST: its status, Retry-After and JSON body."""
    call = urllib.request.Request(url + "/v1/completions", data=body)
    try:
        with urllib.request.urlopen(call, timeout=120) as r:
            return int(r.status), r.headers.get("Retry-After"), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After"), json.loads(e.read())


def test_a_full_router_refuses_on_both_doors_naming_max_pending_again_at_once(
    small: RouterHarness, workers: Any
) -> None:
    assert small.app.http is not None
    http = small.app.http.address
    valid = json.dumps({"prompt": "Rain falls on", "max_tokens": 2}).encode()

    async def go() -> tuple[list[tuple[str, str]], list[Any], str, int]:
        async with grpc.aio.insecure_channel(small.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            held = [_long(stub) for _ in range(MAX_PENDING)]
            for call in held:
                await call.read()  # its first token: it holds its slot
            refusals = [await _status(stub), await _status(stub)]  # the retry at once too
            posts = [await asyncio.to_thread(_post, http, b) for b in (valid, valid, b"{no")]
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            models = await stub.ListModels(pb.ListModelsRequest())
            for call in held:
                call.cancel()
        return (
            refusals,
            posts,
            health_pb2.HealthCheckResponse.ServingStatus.Name(health.status),
            len(models.models),
        )

    before = _refusals(small, "max_pending")
    refusals, posts, health, models = asyncio.run(go())
    for code, why in refusals:
        assert code == "RESOURCE_EXHAUSTED"
        assert why.startswith(f"max_pending: {MAX_PENDING} requests in flight"), why
    # Twice, and a body that is not JSON: the same 429, so the body was never read.
    for status, retry_after, body in posts:
        assert (status, retry_after) == (429, "1")
        assert body["error"]["type"] == body["error"]["code"] == "rate_limit_exceeded"
        assert body["error"]["message"].startswith(f"max_pending: {MAX_PENDING} requests")
    assert (health, models) == ("SERVING", 1)  # the probes answer while it is full
    assert _refusals(small, "max_pending") - before == 5
    core = small.app.router
    wait_until(lambda: core.pending == 0, "the cancelled streams' slots to come back")
    assert not core.clients and small.app.tokenize.queued == 0


def test_a_burst_past_grpcs_own_limit_is_refused_while_streams_and_probes_go_on(
    small: RouterHarness, workers: Any
) -> None:
    burst = 4 * grpc_limit(MAX_PENDING)  # far past what the router's Python takes at once

    async def go() -> tuple[Counter[tuple[str, str]], list[int], str]:
        async with grpc.aio.insecure_channel(small.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            held = [_long(stub) for _ in range(MAX_PENDING)]
            for call in held:
                await call.read()
            ends = await asyncio.gather(*(_status(stub) for _ in range(burst)))
            more = [0] * MAX_PENDING
            for i, call in enumerate(held):  # the streams go on after the burst
                for _ in range(4):
                    more[i] += len((await call.read()).token_ids)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            for call in held:
                call.cancel()
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
        return Counter((code, why.split(":")[0]) for code, why in ends), more, status

    ends, more, health = asyncio.run(go())
    assert sum(ends.values()) == burst
    # The router's own refusals name max_pending; past grpc's limit, grpc's message.
    assert {code for code, _ in ends} == {"RESOURCE_EXHAUSTED"}
    assert {why for _, why in ends} <= {"max_pending", "Concurrent RPC limit exceeded!"}
    assert all(n >= 4 for n in more) and health == "SERVING"
    core = small.app.router
    wait_until(lambda: core.pending == 0, "the cancelled streams' slots to come back")
    assert not core.clients and small.app.tokenize.queued == 0
