"""TLS on both front doors, with a self-signed certificate made here: the `openai` package
and splitserve's own client (and CLI) get replies over it, plain-text clients do not. CORS
on the HTTP door: an allowed origin's preflight and requests get the headers, any other
origin none, and a router with no origins none at all."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import httpx2
import openai
import pytest

from splitserve.cli import main
from splitserve.client import Client
from tests.certificates import Certificate, self_signed
from tests.integration.router_harness import RouterHarness

KEY = "sk-test-tls"
ORIGIN = "https://app.example.com"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def decode(ray_workers: Any) -> dict[str, Any]:
    return {"colocated": ray_workers.decode("colocated")}  # one worker, for both routers


@pytest.fixture(scope="module")
def secure(decode: dict[str, Any], cert: Certificate) -> Iterator[RouterHarness]:
    """TLS, a key and one allowed origin."""
    harness = RouterHarness(
        {},
        decode,
        redis_url=None,
        http_port=0,
        metrics_port=0,
        api_key=KEY,
        ssl_keyfile=str(cert.key),
        ssl_certfile=str(cert.cert),
        allowed_origins=(ORIGIN,),
    )
    yield harness
    harness.stop()


@pytest.fixture(scope="module")
def plain(decode: dict[str, Any]) -> Iterator[RouterHarness]:
    """The defaults: plain text, no key, no CORS."""
    harness = RouterHarness({}, decode, redis_url=None, http_port=0)
    yield harness
    harness.stop()


def _base(router: RouterHarness) -> str:
    assert router.app.http is not None
    return router.app.http.address


# --- TLS ------------------------------------------------------------------------------------


def test_the_openai_package_gets_a_completion_over_https(
    secure: RouterHarness, cert: Certificate, workers: Any
) -> None:
    assert _base(secure).startswith("https://127.0.0.1:")
    trusting = httpx2.Client(verify=ssl.create_default_context(cafile=str(cert.cert)))
    client = openai.OpenAI(
        base_url=_base(secure) + "/v1", api_key=KEY, http_client=trusting, timeout=60
    )
    reply = client.completions.create(
        model="", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    assert reply.choices[0].text


def test_an_https_client_that_does_not_trust_the_certificate_is_refused(
    secure: RouterHarness,
) -> None:
    client = openai.OpenAI(base_url=_base(secure) + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()


async def _grpc(address: str, ssl_ca: str | None) -> tuple[str, int]:
    async with Client(address, KEY, ssl_ca) as client:
        health = await client.health()
        reply = await client.generate("The capital of France is", max_tokens=4, timeout_s=60)
        return health, len(reply.token_ids)


def test_splitserves_client_gets_tokens_over_grpc_tls(
    secure: RouterHarness, cert: Certificate, workers: Any
) -> None:
    assert asyncio.run(_grpc(secure.address, str(cert.cert))) == ("SERVING", 4)


def _metrics_port(router: RouterHarness) -> str:
    assert router.app.metrics_http is not None
    host, port = router.app.metrics_http.addresses[0][:2]
    return f"{host}:{port}"


def test_plain_text_clients_fail_on_the_tls_ports(secure: RouterHarness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_grpc(secure.address, None))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    plain_url = _base(secure).replace("https://", "http://") + "/health"
    for url in (plain_url, f"http://{_metrics_port(secure)}/metrics"):
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, timeout=30)


def test_the_metrics_port_is_scraped_over_tls_with_the_key(
    secure: RouterHarness, cert: Certificate
) -> None:
    """The scraper's key never crosses the network in plain text."""
    trusting = ssl.create_default_context(cafile=str(cert.cert))
    url = f"https://{_metrics_port(secure)}/metrics"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30, context=trusting) as r:
        assert b"# TYPE splitserve_requests_total counter" in r.read()


def test_generate_talks_tls_with_ssl_ca(
    secure: RouterHarness, cert: Certificate, workers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--server", secure.address, "--api-key", KEY, "--max-tokens", "2", "Hi"]
    assert main([*argv, "--ssl-ca", str(cert.cert)]) == 0
    assert capsys.readouterr().out.strip()
    assert main(argv) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


# --- CORS -----------------------------------------------------------------------------------


def _ask(
    router: RouterHarness,
    cert: Certificate | None,
    method: str,
    path: str,
    headers: dict[str, str],
    body: dict[str, Any] | None = None,
) -> tuple[int, dict[str, str]]:
    """The status and headers of one HTTP request (the body read to its end)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(_base(router) + path, data, headers, method=method)
    context = None if cert is None else ssl.create_default_context(cafile=str(cert.cert))
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as r:
            r.read()
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def _cors(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("access-control-")}


PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
AUTHORIZED = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def test_an_allowed_origins_preflight_is_answered_before_the_key_is_asked_for(
    secure: RouterHarness, cert: Certificate
) -> None:
    status, headers = _ask(
        secure, cert, "OPTIONS", "/v1/chat/completions", {"Origin": ORIGIN, **PREFLIGHT}
    )
    assert status == 204
    assert _cors(headers) == {
        "access-control-allow-origin": ORIGIN,
        "access-control-allow-methods": "POST",
        "access-control-allow-headers": "authorization, content-type",
        "access-control-max-age": "600",
    }


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        (AUTHORIZED, CHAT, 200),
        (AUTHORIZED, {**CHAT, "stream": True}, 200),  # headers sent before the first token
        ({"Content-Type": "application/json"}, CHAT, 401),  # so the page can read the error
    ],
)
def test_an_allowed_origins_replies_name_it(
    secure: RouterHarness,
    cert: Certificate,
    workers: Any,
    headers: dict[str, str],
    body: dict[str, Any],
    status: int,
) -> None:
    got, replied = _ask(
        secure, cert, "POST", "/v1/chat/completions", {"Origin": ORIGIN, **headers}, body
    )
    assert got == status
    assert _cors(replied) == {"access-control-allow-origin": ORIGIN}
    assert "Origin" in replied["Vary"]


def test_another_origin_gets_no_cors_header(secure: RouterHarness, cert: Certificate) -> None:
    other = {"Origin": "https://evil.example.com"}
    _, headers = _ask(secure, cert, "OPTIONS", "/v1/chat/completions", {**other, **PREFLIGHT})
    assert _cors(headers) == {}
    status, headers = _ask(secure, cert, "GET", "/v1/models", {**other, **AUTHORIZED})
    assert status == 200 and _cors(headers) == {}


def test_cors_is_off_by_default(plain: RouterHarness) -> None:
    origin = {"Origin": ORIGIN}
    status, headers = _ask(plain, None, "OPTIONS", "/v1/chat/completions", {**origin, **PREFLIGHT})
    assert status == 405 and _cors(headers) == {}
    status, headers = _ask(plain, None, "GET", "/v1/models", origin)
    assert status == 200 and _cors(headers) == {}
