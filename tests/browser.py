"""A real headless Chromium (Debian's `chromium` package) for the tests of web pages,
driven over the DevTools protocol's websocket (aiohttp's client): open a page, run a
script in it, wait until it shows something."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import subprocess
import threading
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp


def chromium() -> str | None:
    """The browser's path, if this machine has one (scripts/setup installs it)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """Headless Chromium in its own profile directory; `page()` opens a tab to drive."""

    def __init__(self, executable: str, profile: Path) -> None:
        self.process = subprocess.Popen(
            [
                executable,
                "--headless=new",
                "--no-sandbox",  # root in a container has no user namespace to sandbox with
                "--disable-gpu",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stderr is not None
        for line in self.process.stderr:  # it prints where its protocol listens, then waits
            if m := re.search(r"DevTools listening on ws://([^/]+)/", line):
                self.host = m.group(1)
                break
        else:
            raise RuntimeError(f"chromium exited ({self.process.wait()}) before listening")
        # It goes on logging: read the rest, or a full pipe would stall it.
        threading.Thread(target=self.process.stderr.read, daemon=True).start()

    def page(self) -> str:
        """A new tab's DevTools websocket URL."""
        request = urllib.request.Request(f"http://{self.host}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as reply:
            target: dict[str, str] = json.load(reply)
        return target["webSocketDebuggerUrl"]

    def close(self) -> None:
        self.process.kill()
        self.process.wait(30)


class Page:
    """One tab over its websocket; use as `async with Page(url) as page`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Page:
        self.session = aiohttp.ClientSession()
        self.ws = await self.session.ws_connect(self.url, max_msg_size=0)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.ws.close()
        await self.session.close()

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """A protocol command's result (events that arrive meanwhile are dropped)."""
        id_ = next(self._ids)
        await self.ws.send_json({"id": id_, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json(timeout=60)
            if message.get("id") == id_:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    async def eval(self, expression: str) -> Any:
        """The value of a script expression in the page (promises awaited)."""
        reply = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", f"{url} to load")

    async def wait_for(self, expression: str, what: str, timeout_s: float = 60) -> Any:
        """The expression's first truthy value, polled; AssertionError naming `what` if it
        stays falsy for timeout_s (a bound on a hang, not a measurement)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            value = await self.eval(expression)
            if value:
                return value
            assert loop.time() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.1)
