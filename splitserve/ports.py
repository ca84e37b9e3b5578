"""The listening ports `splitserve serve` will bind, checked before anything starts: a
port another process holds would otherwise be found only after the workers loaded."""

from __future__ import annotations

import errno
import socket
from contextlib import ExitStack

from cluster.config import ConfigError, ServeConfig
from splitserve.serve_flags import FLAGS

# The flag beside each field it sets: --port is router.http_port, --grpc-port router.port.
FLAG_OF = {field: flag.name for flag in FLAGS for field in flag.fields}


def listening_ports(config: ServeConfig) -> dict[str, int]:
    """Each configured port by its field, with the flag that sets it where one does; port 0
    (any free one) and null (off) are left out. The embedded valkey-server takes a free
    port, so it has none here."""
    router = config.router
    ports = {
        "router.port": router.port,
        "router.http_port": router.http_port,
        "router.metrics_port": router.metrics_port,
    }
    return {
        f"{field} ({FLAG_OF[field]})" if field in FLAG_OF else field: port
        for field, port in ports.items()
        if port
    }


def check_ports(config: ServeConfig) -> None:
    """Bind every listening port on router.host, as the servers will, then let them go.
    Raises ConfigError naming the field and the port that is taken."""
    host = config.router.host
    claimed: dict[int, str] = {}
    with ExitStack() as held:  # held until all are checked, so two fields cannot share one
        for field, port in listening_ports(config).items():
            if port in claimed:
                raise ConfigError(f"{field}: {host}:{port} is {claimed[port]} too")
            try:
                for family, kind, proto, _, address in socket.getaddrinfo(
                    host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
                ):
                    sock = held.enter_context(socket.socket(family, kind, proto))
                    # As the servers do: a port left in TIME_WAIT is free to them.
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(f"{field}: {host}:{port} is in use by another process") from e
                raise ConfigError(f"{field}: cannot listen on {host}:{port}: {e}") from e
            claimed[port] = field
