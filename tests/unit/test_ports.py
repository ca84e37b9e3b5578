"""`splitserve serve` stops within seconds, naming the field, when a port it would listen
on is taken; nothing (Redis, Ray, workers) has started."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ConfigError, RouterConfig, ServeConfig
from splitserve.cli import main
from splitserve.ports import check_ports, listening_ports


@pytest.fixture
def taken() -> Iterator[int]:
    """A port on 127.0.0.1 that a listener of this test holds."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# Each field with the flag that sets it: --port is the HTTP API's, as with `vllm serve`.
NAMED = {
    "port": "router.port (--grpc-port)",
    "http_port": "router.http_port (--port)",
    "metrics_port": "router.metrics_port",
}


@pytest.mark.parametrize("field", NAMED)
def test_a_taken_port_stops_serve_naming_its_field_before_anything_starts(
    field: str,
    taken: int,
    tmp_path: Path,
    started: list[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    ports = {"port": free_port(), "http_port": free_port(), "metrics_port": free_port()}
    ports[field] = taken
    config = tmp_path / "serve.yaml"
    config.write_text(f"router: {json.dumps(ports)}\n")  # JSON is YAML
    assert main(["serve", "--config", str(config)]) == 2
    assert started == []
    assert capsys.readouterr().err.splitlines() == [
        f"splitserve: error: {NAMED[field]}: 127.0.0.1:{taken} is in use by another process"
    ]


@pytest.mark.parametrize(("flag", "field"), [("--port", "http_port"), ("--grpc-port", "port")])
def test_a_taken_port_given_as_a_flag_names_that_flags_field(
    flag: str,
    field: str,
    taken: int,
    started: list[Any],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("router: {port: 0, http_port: 0, metrics_port: null}\n")
    assert main(["serve", "--config", str(config), flag, str(taken)]) == 2
    assert started == []
    assert capsys.readouterr().err.splitlines() == [
        f"splitserve: error: {NAMED[field]}: 127.0.0.1:{taken} is in use by another process"
    ]


def test_two_fields_on_one_port_are_refused_naming_both() -> None:
    port = free_port()
    config = ServeConfig(router=RouterConfig(port=port, http_port=port, metrics_port=None))
    with pytest.raises(ConfigError) as refused:
        check_ports(config)
    assert str(refused.value) == (
        f"router.http_port (--port): 127.0.0.1:{port} is router.port (--grpc-port) too"
    )


def test_free_ports_pass_and_stay_free() -> None:
    ports = {"port": free_port(), "http_port": free_port(), "metrics_port": free_port()}
    check_ports(ServeConfig(router=RouterConfig(**ports)))
    for port in ports.values():  # the check let each one go
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_port_zero_and_off_are_not_checked() -> None:
    config = ServeConfig(router=RouterConfig(port=0, http_port=None, metrics_port=0))
    assert listening_ports(config) == {}


def test_the_port_check_comes_before_the_models_header_is_read(
    taken: int, tmp_path: Path, started: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A taken port is found in milliseconds: before check_fit reads the model (a GGUF's
    header alone takes seconds to parse), here a model that does not exist."""
    missing = tmp_path / "missing.gguf"
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"router: {{port: 0, http_port: {taken}, metrics_port: null}}\n"
        f"prefill: {{engine: {{model: {missing}}}}}\ndecode: {{engine: {{model: {missing}}}}}\n"
    )
    assert main(["serve", "--config", str(config)]) == 2
    assert started == []
    assert capsys.readouterr().err.splitlines() == [
        f"splitserve: error: {NAMED['http_port']}: 127.0.0.1:{taken} is in use by another process"
    ]
