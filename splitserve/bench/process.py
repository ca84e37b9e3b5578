"""A server under test as a child process: started in a session of its own, stopped with
it (SIGINT, then SIGKILL to the whole group, so no worker it spawned outlives it);
`splitserve serve` on a config of the caller's, until it says where it serves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

GRACE_S = 120.0


class DidNotStart(RuntimeError):
    """A server that exited or never became ready; the message ends with its log's tail
    (the log itself may be in a temporary directory that is gone by the time it is read)."""

    def __init__(self, name: str, log: Path, lines: int = 30) -> None:
        tail = log.read_text(errors="replace").splitlines()[-lines:] if log.is_file() else []
        super().__init__(f"{name} did not start; the end of its log ({log}):\n" + "\n".join(tail))


@contextmanager
def child(
    cmd: list[str], out: int | IO[str], env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`cmd` running, its stdout and stderr both to `out` (a file, or subprocess.PIPE:
    then read proc.stdout), until the block ends; then stopped: SIGINT, GRACE_S to exit,
    then SIGKILL to what is left of its process group."""
    proc = subprocess.Popen(
        cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(GRACE_S)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass(frozen=True)
class Served:
    """A running `splitserve serve`: its gRPC address, its process id (Ray's workers and
    the embedded valkey-server are among that process's descendants) and, when its config
    turns them on, its Prometheus metrics' URL and its OpenAI HTTP API's base URL."""

    address: str
    pid: int
    metrics_url: str | None = None
    http_url: str | None = None


@contextmanager
def splitserve(name: str, doc: dict[str, Any], log_dir: Path) -> Iterator[Served]:
    """`splitserve serve` on the config `doc` (written to log_dir/name.yaml, its log to
    log_dir/name.log), once it serves; stopped as `child` stops it. Ports the config
    leaves unset are any free port; the metrics and HTTP front doors are off unless it
    turns them on."""
    router = {"port": 0, "metrics_port": None, "http_port": None, **doc.get("router", {})}
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**doc, "router": router}))
    log_path = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--config", str(path)]
    with child(cmd, subprocess.PIPE) as proc:
        address: list[str] = []
        metrics: list[str] = []
        http: list[str] = []
        ready = threading.Event()

        def drain() -> None:  # keep its log, and the pipe from filling
            assert proc.stdout is not None
            with log_path.open("w") as log:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if m := re.search(r"Prometheus metrics on (\S+/metrics)", line):
                        metrics.append(m.group(1))
                    if m := re.search(r"OpenAI-compatible HTTP API on (\S+)/v1", line):
                        http.append(m.group(1))
                    if m := re.search(r"serving on (\S+);", line):
                        address.append(m.group(1))
                        ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(300) or not address:
            raise DidNotStart(name, log_path)
        yield Served(
            address[0], proc.pid, metrics[0] if metrics else None, http[0] if http else None
        )
