"""Admission at the front doors over real workers: an input too long for the context is
refused after counting about a context's worth of it, and a client past its own limit
(`max_pending_per_client`, by its key) is refused while another client gets in; each
refusal is counted by the limit that made it."""

from __future__ import annotations

import asyncio
import json
import random
import string
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from router.request import MAX_CHARS_PER_TOKEN
from router.token_count import CHUNK_CHARS, count_tokens
from splitserve.client import request
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
