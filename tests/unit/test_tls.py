"""TLS settings: both files or neither, a pair that does not load refused naming the
field, and `serve` refusing before anything starts."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ConfigError, RouterConfig, serve_config_from_dict
from router.tls import server_tls
from splitserve.cli import main
from tests.certificates import self_signed


def test_no_files_is_plain_text() -> None:
    assert server_tls(RouterConfig()) is None


def test_a_certificate_and_its_key_make_both_doors_contexts(tmp_path: Path) -> None:
    made = self_signed(tmp_path)
    tls = server_tls(RouterConfig(ssl_keyfile=str(made.key), ssl_certfile=str(made.cert)))
    assert tls is not None
    assert tls.http.protocol == ssl.PROTOCOL_TLS_SERVER
    assert tls.grpc is not None


@pytest.mark.parametrize(
    ("router", "message"),
    [
        ({"ssl_keyfile": "k.pem"}, "router.ssl_keyfile: TLS needs ssl_certfile too"),
        ({"ssl_certfile": "c.pem"}, "router.ssl_certfile: TLS needs ssl_keyfile too"),
        ({"ssl_certfile": "", "ssl_keyfile": "k"}, "router.ssl_certfile: must be a non-empty"),
    ],
)
def test_one_file_alone_is_refused_naming_it(router: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        serve_config_from_dict({"router": router})
    assert str(refused.value).startswith(message), refused.value


def test_a_pair_that_does_not_load_is_refused_naming_the_field(tmp_path: Path) -> None:
    one, other = self_signed(tmp_path / "one"), self_signed(tmp_path / "other")
    for cert, key in ((one.cert, other.key), (tmp_path / "absent.pem", one.key)):
        config = RouterConfig(ssl_keyfile=str(key), ssl_certfile=str(cert))
        with pytest.raises(ConfigError, match=rf"^router\.ssl_certfile: cannot load {cert}"):
            server_tls(config)


def test_serve_refuses_a_certificate_before_anything_starts(
    started: list[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    made = self_signed(tmp_path)
    made.cert.write_text("not a certificate\n")
    argv = ["serve", "--ssl-keyfile", str(made.key), "--ssl-certfile", str(made.cert)]
    assert main(argv) == 2
    assert started == []
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"splitserve: error: router.ssl_certfile: cannot load {made.cert}")
