"""A router with an API key: both front doors and both /metrics (the HTTP API's and the
metrics port's) refuse a call without it and answer one with it; health checks and
/version stay open."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest

from splitserve.cli import main
from splitserve.client import Client
from tests.integration.router_harness import RouterHarness

KEY = "sk-test-4b1d"


@pytest.fixture(scope="module")
def router(ray_workers: Any) -> Iterator[RouterHarness]:
    decode = {"colocated": ray_workers.decode("colocated")}  # prefills itself: one worker is enough
    harness = RouterHarness({}, decode, redis_url=None, http_port=0, metrics_port=0, api_key=KEY)
    yield harness
    harness.stop()


def _openai(router: RouterHarness, key: str) -> openai.OpenAI:
    assert router.app.http is not None
    return openai.OpenAI(base_url=router.app.http.address + "/v1", api_key=key, timeout=60)


ERROR = {
    "message": "invalid API key: send Authorization: Bearer <key>",
    "type": "invalid_request_error",
    "param": None,
    "code": "invalid_api_key",
}


@pytest.mark.parametrize("key", ["wrong", KEY + "x"])
def test_http_without_the_key_is_a_401_in_openais_shape(router: RouterHarness, key: str) -> None:
    client = _openai(router, key)
    with pytest.raises(openai.AuthenticationError) as err:
        client.completions.create(model="", prompt="Hello", max_tokens=2)
    assert err.value.status_code == 401
    assert err.value.body == ERROR
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize", "/detokenize"])
def test_http_with_no_authorization_header_is_a_401(router: RouterHarness, path: str) -> None:
    assert router.app.http is not None
    body = json.dumps({"model": "", "prompt": "Hello", "max_tokens": 2}).encode()
    request = urllib.request.Request(router.app.http.address + path, data=body)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 401
    assert json.loads(err.value.read()) == {"error": ERROR}


def test_http_with_the_key_answers(router: RouterHarness, workers: Any) -> None:
    client = _openai(router, KEY)
    reply = client.completions.create(
        model="", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert reply.choices[0].text
    assert [m.id for m in client.models.list()]


def test_health_and_version_need_no_key(router: RouterHarness) -> None:
    assert router.app.http is not None
    base = router.app.http.address
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    with urllib.request.urlopen(base + "/version", timeout=30) as r:
        assert r.status == 200


def _metrics_urls(router: RouterHarness) -> list[str]:
    """/metrics on the HTTP API's port and on the metrics port."""
    assert router.app.http is not None and router.app.metrics_http is not None
    host, port = router.app.metrics_http.addresses[0][:2]
    return [router.app.http.address + "/metrics", f"http://{host}:{port}/metrics"]


@pytest.mark.parametrize("header", [None, "Bearer wrong"])
def test_metrics_without_the_key_is_a_401_on_both_ports(
    router: RouterHarness, header: str | None
) -> None:
    for url in _metrics_urls(router):
        request = urllib.request.Request(
            url, headers={} if header is None else {"Authorization": header}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        assert err.value.code == 401
        assert b"splitserve_" not in err.value.read()


def test_metrics_with_the_key_answers_on_both_ports(router: RouterHarness) -> None:
    for url in _metrics_urls(router):
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 200 and r.headers.get_content_type() == "text/plain"
            assert b"# TYPE splitserve_requests_total counter" in r.read()


async def _grpc(address: str, key: str | None) -> tuple[str, list[str]]:
    async with Client(address, key) as client:
        health = await client.health()  # open without a key
        try:
            reply = await client.generate("The capital of France is", max_tokens=4, timeout_s=60)
        except grpc.aio.AioRpcError as e:
            return health, [e.code().name, e.details() or ""]
        return health, [str(len(reply.token_ids))]


@pytest.mark.parametrize("key", [None, "wrong"])
def test_grpc_without_the_key_is_unauthenticated(router: RouterHarness, key: str | None) -> None:
    health, outcome = asyncio.run(_grpc(router.address, key))
    assert health == "SERVING"
    assert outcome == ["UNAUTHENTICATED", "invalid API key: send Authorization: Bearer <key>"]


def test_grpc_with_the_key_gets_tokens(router: RouterHarness, workers: Any) -> None:
    assert asyncio.run(_grpc(router.address, KEY)) == ("SERVING", ["4"])


def test_generate_sends_the_key_from_its_flag_or_the_environment(
    router: RouterHarness, workers: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    argv = ["generate", "--server", router.address, "--max-tokens", "2", "Hello"]
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    assert main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main([*argv, "--api-key", KEY]) == 0
    assert capsys.readouterr().out.strip()
    monkeypatch.setenv("SPLITSERVE_API_KEY", KEY)
    assert main(argv) == 0
