"""A self-signed certificate for the TLS tests, made by the `openssl` command (the
`cryptography` package is not installed here)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificate:
    cert: Path  # PEM; self-signed, so also the CA a client trusts
    key: Path  # PEM, unencrypted


def self_signed(directory: Path) -> Certificate:
    """A one-day P-256 certificate for localhost and 127.0.0.1 (its own CA)."""
    directory.mkdir(parents=True, exist_ok=True)
    made = Certificate(directory / "cert.pem", directory / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(made.key), "-out", str(made.cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return made
