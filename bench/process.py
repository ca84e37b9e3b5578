"""A server under test as a child process: started in a session of its own, stopped with
it (SIGINT, then SIGKILL to the whole group, so no worker it spawned outlives it)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

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
