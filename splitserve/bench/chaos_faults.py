"""The faults `splitserve bench chaos` injects into a running `splitserve serve`, and how
it sees the server recover.

Processes are found among the serve process's descendants by their titles: Ray titles an
actor's worker process `ray::<class>` while it is idle (`ray::DecodeWorker`,
`ray::PrefillWorker`) and `ray::<actor name>:<class>.<method>` while a call runs
(`ray::decode-1:DecodeWorker.step`), and the embedded Redis runs as
`.../valkey-server 127.0.0.1:<port>`. Only descendants are looked at, so other servers on
the machine are never touched.

Recovery is observed through the server itself: GetServerInfo lists the workers the
router serves with (a killed one leaves the list when the router's next call to it
fails; the pool's replacement joins it once it is ready) and each one's free and total
KV pages; valkey has recovered when it answers PING on its port again.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from dataclasses import dataclass

import psutil
import redis.asyncio as aioredis

from splitserve.bench.chaos_report import Fault, WorkerPages
from splitserve.client import Client

TITLE = re.compile(r"ray::(?:[\w.-]+:)?(PrefillWorker|DecodeWorker)(?:\.\w+)?")
PHASES = {"PrefillWorker": "prefill", "DecodeWorker": "decode"}
VALKEY = "valkey-server"
POLL_S = 0.05


@dataclass(frozen=True)
class Victim:
    target: str  # "prefill", "decode" or "redis"
    pid: int


def _descendants(root: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(root).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


def _title(p: psutil.Process) -> str:
    """The process title (Ray's and valkey's titles overwrite argv, padded with blanks)."""
    try:
        return " ".join(p.cmdline()).strip()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ""


def workers(root: int, phases: tuple[str, ...]) -> list[Victim]:
    """The live worker processes of these phases under `root`."""
    found = []
    for p in _descendants(root):
        m = TITLE.fullmatch(_title(p))
        if m is not None and PHASES[m.group(1)] in phases:
            found.append(Victim(PHASES[m.group(1)], p.pid))
    return found


def valkey(root: int) -> tuple[Victim, int] | None:
    """The embedded valkey-server under `root` and its port; None when there is none."""
    for p in _descendants(root):
        title = _title(p)
        if VALKEY in title.split(" ", 1)[0]:
            port = int(title.split(" ")[1].rsplit(":", 1)[1])
            return Victim("redis", p.pid), port
    return None


def kill9(victim: Victim) -> float:
    """SIGKILL the process; when it was sent (monotonic). Returns once it is dead (gone,
    or a zombie its parent has not reaped: either way it holds no socket)."""
    os.kill(victim.pid, signal.SIGKILL)
    at = time.monotonic()
    try:
        process = psutil.Process(victim.pid)
        while process.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.001)
    except psutil.NoSuchProcess:
        pass
    return at


async def pool(client: Client, phase: str) -> set[str]:
    """The workers of `phase` the router serves with now."""
    info = await client.server_info()
    return {w.id for w in info.workers if w.role == phase}


async def pages(client: Client) -> list[WorkerPages]:
    info = await client.server_info()
    return sorted(
        (WorkerPages(w.id, w.free_pages, w.num_pages) for w in info.workers),
        key=lambda p: p.worker,
    )


async def kill_worker(client: Client, victim: Victim, replicas: int, timeout_s: float) -> Fault:
    """kill -9 a worker, then wait (up to timeout_s) until the router serves with
    `replicas` workers of its phase again, one of them new."""
    before = await pool(client, victim.target)
    at = kill9(victim)
    deadline = at + timeout_s
    while time.monotonic() < deadline:
        now = await pool(client, victim.target)
        if len(now) >= replicas and now - before:
            gone, new = before - now, now - before
            return Fault(victim.target, victim.pid, at, ",".join(sorted(gone)),
                         ",".join(sorted(new)), time.monotonic() - at)  # fmt: skip
        await asyncio.sleep(POLL_S)
    gone = before - await pool(client, victim.target)
    return Fault(victim.target, victim.pid, at, ",".join(sorted(gone)), "", None)


async def kill_valkey(root: int, timeout_s: float) -> Fault | None:
    """kill -9 the embedded valkey-server, then wait (up to timeout_s) until a new one
    answers PING on its port; None when the server runs none (an external Redis)."""
    found = valkey(root)
    if found is None:
        return None
    victim, port = found
    at = kill9(victim)
    deadline = at + timeout_s
    conn = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0)
    try:
        while time.monotonic() < deadline:
            try:
                if await conn.ping():
                    return Fault("redis", victim.pid, at, "", "", time.monotonic() - at)
            except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
                pass
            await asyncio.sleep(POLL_S)
    finally:
        await conn.aclose()
    return Fault("redis", victim.pid, at, "", "", None)
