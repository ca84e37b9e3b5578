"""The API key: which header carries it, where it comes from (flag over environment over
YAML), and that a router bound beyond loopback needs one."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from cluster.bearer import authorized
from cluster.config import ConfigError, RouterConfig, serve_config_from_dict
from router.auth import api_key
from splitserve.cli import build_parser, main
from splitserve.serve_flags import serve_config

KEY = "sk-test-123"


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {KEY}", True),
        (f"bearer {KEY}", True),  # the scheme is case-insensitive (RFC 7235)
        (None, False),
        ("", False),
        ("Bearer", False),
        ("Bearer ", False),
        (f"Basic {KEY}", False),
        (KEY, False),  # no scheme
        (f"Bearer {KEY}x", False),
        (f"Bearer {KEY[:-1]}", False),
        ("Bearer sk-test-12é", False),  # not ASCII: refused, not an error
    ],
)
def test_only_a_bearer_token_equal_to_the_key_is_authorized(header: str | None, ok: bool) -> None:
    assert authorized(header, (KEY,)) is ok
    assert authorized(header, ("other", KEY)) is ok  # any of several


def test_the_compare_is_constant_time() -> None:
    assert "hmac.compare_digest(" in inspect.getsource(authorized)


def test_the_key_comes_from_the_config_or_its_file(tmp_path: Path) -> None:
    assert api_key(RouterConfig()) is None
    assert api_key(RouterConfig(api_key=KEY)) == (KEY,)
    assert api_key(RouterConfig(api_key=[KEY, "k2"])) == (KEY, "k2")  # type: ignore[arg-type]
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    assert api_key(RouterConfig(api_key_file=str(path))) == (KEY,)
    path.write_text("\n")
    with pytest.raises(ConfigError, match=r"^router\.api_key_file: .* is empty"):
        api_key(RouterConfig(api_key_file=str(path)))
    with pytest.raises(ConfigError, match=r"^router\.api_key_file: cannot read"):
        api_key(RouterConfig(api_key_file=str(tmp_path / "absent")))


@pytest.mark.parametrize(
    ("router", "message"),
    [
        ({"api_key": ""}, "router.api_key: must be a non-empty string or null"),
        ({"api_key": 123}, "router.api_key: must be a non-empty string or null"),
        ({"api_key_file": " "}, "router.api_key_file: must be a non-empty string or null"),
        ({"api_key": "a", "api_key_file": "f"}, "router.api_key: give api_key or api_key_file"),
    ],
)
def test_a_bad_key_setting_is_refused_naming_its_field(router: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        serve_config_from_dict({"router": router})


def test_the_key_is_not_in_the_configs_repr() -> None:
    assert KEY not in repr(RouterConfig(api_key=KEY))


def _router(
    argv: list[str], environ: dict[str, str], yaml: dict[str, str], tmp_path: Path
) -> RouterConfig:
    config = tmp_path / "serve.yaml"
    config.write_text(f"router: {json.dumps(yaml)}\n")  # JSON is YAML
    args = build_parser().parse_args(["serve", "--config", str(config), *argv])
    return serve_config(args, environ).router


@pytest.mark.parametrize(
    ("argv", "environ", "yaml", "key", "key_file"),
    [
        ([], {}, {}, None, None),
        ([], {}, {"api_key": "yaml"}, "yaml", None),
        ([], {}, {"api_key_file": "y.key"}, None, "y.key"),
        ([], {"SPLITSERVE_API_KEY": "env"}, {"api_key": "yaml"}, "env", None),
        ([], {"SPLITSERVE_API_KEY": "env"}, {"api_key_file": "y.key"}, "env", None),
        ([], {"SPLITSERVE_API_KEY": ""}, {"api_key": "yaml"}, "yaml", None),  # empty: unset
        (["--api-key", "flag"], {"SPLITSERVE_API_KEY": "env"}, {"api_key": "yaml"}, "flag", None),
        (["--api-key-file", "f.key"], {"SPLITSERVE_API_KEY": "env"}, {}, None, "f.key"),
        (["--api-key", "flag"], {}, {"api_key_file": "y.key"}, "flag", None),
    ],
)
def test_the_flag_wins_over_the_environment_over_the_yaml(
    argv: list[str],
    environ: dict[str, str],
    yaml: dict[str, str],
    key: str | None,
    key_file: str | None,
    tmp_path: Path,
) -> None:
    router = _router(argv, environ, yaml, tmp_path)
    assert (router.api_key, router.api_key_file) == (key, key_file)


def test_both_flags_are_refused_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--api-key", "a", "--api-key-file", "f"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "splitserve: error: --api-key: router.api_key: give api_key or api_key_file, not both"
    ]


@pytest.mark.parametrize(
    ("host", "router", "refused"),
    [
        ("127.0.0.1", {}, False),
        ("localhost", {}, False),
        ("::1", {}, False),
        ("0.0.0.0", {}, True),
        ("10.1.2.3", {}, True),
        ("router.internal", {}, True),
        ("0.0.0.0", {"api_key": KEY}, False),
    ],
)
def test_a_router_bound_beyond_loopback_asks_for_a_key(
    host: str, router: dict[str, str], refused: bool
) -> None:
    config = RouterConfig(host=host, **router)
    if not refused:
        assert api_key(config) == ((router["api_key"],) if router else None)
        return
    with pytest.raises(ConfigError) as err:
        api_key(config)
    assert str(err.value).startswith(f"router.host: {host} is reachable from other machines")
    assert "router.api_key" in str(err.value)


def test_serve_on_a_wide_host_without_a_key_stops_before_anything_starts(
    started: list[Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert started == []
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("splitserve: error: router.host: 0.0.0.0 is reachable")
    monkeypatch.setenv("SPLITSERVE_API_KEY", KEY)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0", "--grpc-port", "0"]) == 0
    assert [config.router.host for config in started] == ["0.0.0.0"]


@pytest.mark.parametrize("argv", [["--api-key", "a", "b"], ["--api-key", "a", "--api-key", "b"]])
def test_several_api_keys_are_all_kept(argv: list[str], tmp_path: Path) -> None:
    router = _router(argv, {}, {}, tmp_path)
    assert api_key(router) == ("a", "b")
