"""TLS for both front doors: one certificate and key (router.ssl_certfile, ssl_keyfile,
PEM), read once and checked before anything listens."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.config import ConfigError, RouterConfig


@dataclass(frozen=True)
class ServerTLS:
    """The same certificate as each front door takes it."""

    http: ssl.SSLContext
    grpc: grpc.ServerCredentials


def server_tls(config: RouterConfig) -> ServerTLS | None:
    """The front doors' TLS; None: plain text (no files set). ConfigError naming
    router.ssl_certfile when the pair cannot be read or does not load together."""
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
        chain, key = Path(config.ssl_certfile).read_bytes(), Path(config.ssl_keyfile).read_bytes()
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"router.ssl_certfile: cannot load {config.ssl_certfile} with the key "
            f"router.ssl_keyfile {config.ssl_keyfile}: {e}"
        ) from None
    return ServerTLS(context, grpc.ssl_server_credentials([(key, chain)]))
