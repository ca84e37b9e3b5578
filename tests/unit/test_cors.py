"""Which origins CORS lets in: the listed ones exactly, any with a `*` entry, none
without an Origin header."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from router.cors import allowed_origin

APP = "https://app.example.com"


@pytest.mark.parametrize(
    ("origins", "origin", "allowed"),
    [
        ((APP,), APP, APP),
        ((APP,), "https://app.example.com:8443", None),  # another port: another origin
        ((APP,), "http://app.example.com", None),  # another scheme too
        ((APP,), "https://evil.example.com", None),
        ((APP,), None, None),
        (("*",), "https://any.example.org", "https://any.example.org"),
        (("*",), None, None),  # not a browser's cross-origin request
    ],
)
def test_an_origin_is_allowed_when_listed_or_by_star(
    origins: tuple[str, ...], origin: str | None, allowed: str | None
) -> None:
    headers = {} if origin is None else {"Origin": origin}
    request = make_mocked_request("GET", "/v1/models", headers=headers)
    assert allowed_origin(request, origins) == allowed
