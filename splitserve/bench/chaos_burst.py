"""`splitserve bench chaos --scenario burst`: `--burst` x max_pending requests at once
while max_pending streams run, on a real `splitserve serve` (chaos_pressure.pressure_doc's
server), on each front door in turn (gRPC, then HTTP).

1. Reference: each of `--distinct` token-id prompts alone, greedy, `--stream-tokens` long.
2. `--max-pending` streams of those prompts start at once and run until every one has
   its first token.
3. `--burst-clients` processes (the streams' client is busy) open their connections
   first (a gRPC channel each; over HTTP, one keep-alive connection per request, by as
   many GET /health at once), so no refusal's latency includes the client's connection
   setup, within `--setup-s`. Then, for `--before-s`, the router process's CPU time is
   only read (/proc, user + system): the streams' own cost per second. Then every client
   sends its share of the burst at one moment; a refusal's latency is from its call's
   start to its status, on its client's clock (the JSON's `sent_ms`: how long the
   clients took to start every call, their own pace on a shared machine).
4. The streams' inter-token gaps (between pieces: gRPC messages, HTTP events) ending in
   the quiet `--before-s` are "before"; those overlapping the burst (its first send to its
   last answer) are "during". Router CPU per refused request: the CPU over the burst less
   the streams' rate over its span, over the requests refused (`raw`: without the
   subtraction, an upper bound).
5. Every stream must end OK with exactly its reference's output (all its tokens).

The summary's figures are the issue's targets: refusal p99 <= 5 ms over gRPC and <= 20 ms
over HTTP, accepted streams' ITL p99 during <= 1.5x before, <= 50 us of router CPU per
refused request.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

import psutil

from splitserve.bench.chaos_doors import Call, HttpDoor, Prompt
from splitserve.bench.chaos_pressure import (
    beside_streams,
    open_door,
    overload_summary,
    prompts_of,
    references,
    stats_ms,
    warm,
)
from splitserve.serve_metrics import OK


@dataclass(frozen=True)
class Burst:
    """What the burst's clients saw: the quiet window and the burst (perf_counter seconds,
    one clock for every process on Linux), the router's CPU seconds over each, every
    request's Call, and how many clients were connected only after `fired_at`."""

    quiet_from: float
    fired_at: float
    cpu_quiet_s: float
    cpu_burst_s: float
    calls: list[Call]
    late_clients: int = 0


def _cpu(pid: int) -> float:
    return sum(psutil.Process(pid).cpu_times()[:2])


def client(
    kind: str, target: str, pid: int, n: int, prompt: Prompt, fire_at: float
) -> tuple[float, list[Call], float]:
    """One of the burst's clients, in a process of its own: connect (over HTTP, one
    keep-alive connection per request it will send), wait for `fire_at`, send `n`
    requests at once. When it was connected, its Calls, and the router's CPU seconds as
    its last answer came."""

    async def fire() -> tuple[float, list[Call], float]:
        door = open_door(kind, target)
        try:
            await door.call(prompt, 1, "warm")  # connected before the clock starts
            if isinstance(door, HttpDoor):
                await asyncio.gather(*(_health(door) for _ in range(n)))
            ready = time.perf_counter()
            await asyncio.sleep(fire_at - ready)
            calls = await asyncio.gather(*(door.call(prompt, 1, "burst") for _ in range(n)))
            return ready, list(calls), _cpu(pid)
        finally:
            await door.close()

    return asyncio.run(fire())


async def _health(door: HttpDoor) -> None:
    async with door.http.get(f"{door.url}/health") as r:
        await r.read()  # its connection goes back to the pool, open


async def burst(
    pool: ProcessPoolExecutor, kind: str, target: str, pid: int, prompt: Prompt,
    args: argparse.Namespace,
) -> Burst:  # fmt: skip
    """`--burst` x max_pending requests from `--burst-clients` processes at one moment,
    after `--setup-s` for them to connect and `--before-s` of quiet."""
    loop = asyncio.get_running_loop()
    n, k = args.burst * args.max_pending, args.burst_clients
    quiet_from = time.perf_counter() + args.setup_s
    fired_at = quiet_from + args.before_s
    shares = [n // k + (i < n % k) for i in range(k)]
    jobs = [loop.run_in_executor(pool, client, kind, target, pid, m, prompt, fired_at)
            for m in shares if m]  # fmt: skip
    await asyncio.sleep(quiet_from - time.perf_counter())
    cpu = _cpu(pid)
    await asyncio.sleep(fired_at - time.perf_counter())
    cpu_quiet = _cpu(pid) - cpu
    done = await asyncio.gather(*jobs)
    last = max(done, key=lambda d: max(c.end for c in d[1]))
    calls = [c for _, cs, _ in done for c in cs]
    late = sum(ready > fired_at for ready, _, _ in done)
    return Burst(quiet_from, fired_at, cpu_quiet, last[2] - cpu - cpu_quiet, calls, late)


def _gaps(streams: list[Call], lo: float, hi: float, overlap: bool) -> list[float]:
    """The streams' gaps between pieces ending in [lo, hi) (`overlap`: overlapping
    [lo, hi] at all), in seconds."""
    out = []
    for c in streams:
        for a, b in zip(c.arrivals, c.arrivals[1:], strict=False):
            if (a <= hi and b >= lo) if overlap else (lo <= b < hi):
                out.append(b - a)
    return out


def burst_summary(streams: list[Call], b: Burst) -> dict[str, Any]:
    """The burst against the quiet window before it (pure: from the records alone)."""
    ended = max((c.end for c in b.calls), default=b.fired_at)
    span = ended - b.fired_at
    quiet = b.fired_at - b.quiet_from
    before = stats_ms(_gaps(streams, b.quiet_from, b.fired_at, overlap=False))
    during = stats_ms(_gaps(streams, b.fired_at, ended, overlap=True))
    refused = [c for c in b.calls if c.status != OK]
    net = b.cpu_burst_s - b.cpu_quiet_s / max(quiet, 1e-9) * span
    per = max(1, len(refused))
    return {
        "sent": len(b.calls),
        "by_status": dict(Counter(f"{c.status}: {c.detail}" for c in b.calls)),
        "refusal_ms": stats_ms([c.latency_s for c in refused]),
        "sent_ms": 1e3 * (max(c.start for c in b.calls) - b.fired_at) if b.calls else 0.0,
        "span_ms": 1e3 * span,
        "late_clients": b.late_clients,
        "itl_before_ms": before,
        "itl_during_ms": during,
        "itl_p99_during_vs_before": None
        if before is None or during is None
        else during["p99"] / before["p99"],
        "streams_through_burst": sum(c.end >= ended for c in streams),
        "router_cpu_s": {"quiet": b.cpu_quiet_s, "quiet_s": quiet, "burst": b.cpu_burst_s},
        "router_cpu_us_per_refusal": 1e6 * max(0.0, net) / per,
        "router_cpu_us_per_refusal_raw": 1e6 * b.cpu_burst_s / per,
    }


async def burst_run(kind: str, target: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """One front door: reference, max_pending streams, the burst beside them."""
    prompts = prompts_of(args)
    loop = asyncio.get_running_loop()
    door = open_door(kind, target)
    with ProcessPoolExecutor(args.burst_clients, mp_context=get_context("spawn")) as pool:
        # Started before any stream: it takes seconds.
        await asyncio.gather(*(loop.run_in_executor(pool, warm) for _ in range(args.burst_clients)))
        try:
            reference = await references(door, prompts, args.stream_tokens)

            async def fire() -> Burst:
                return await burst(pool, kind, target, pid, prompts[0], args)

            streams, fired = await beside_streams(door, prompts, args, fire)
        finally:
            await door.close()
    summary = overload_summary(kind, reference, streams, {})
    del summary["burst"]  # overload's; this scenario's is below
    return {**summary, "burst": None if fired is None else burst_summary(streams, fired)}


def _ms(s: dict[str, float] | None, key: str) -> str:
    return "-" if s is None else f"{s[key]:.1f}"


def burst_table(runs: list[dict[str, Any]]) -> str:
    lines = []
    for r in runs:
        lines.append(
            f"burst over {r['door']}: {r['streams_ok']}/{r['streams']} streams OK "
            f"(failed {r['streams_failed'] or 0}, wrong output {r['streams_wrong_output']})"
        )
        b = r["burst"]
        if b is None:
            lines.append("  the streams ended before all were running: no burst sent")
            continue
        x, ratio = b["refusal_ms"], b["itl_p99_during_vs_before"]
        lines += [
            f"  {b['sent']} at once: {b['by_status']}; refusal p50 {_ms(x, 'p50')} ms, "
            f"p99 {_ms(x, 'p99')} ms, max {_ms(x, 'max')} ms; the clients sent them within "
            f"{b['sent_ms']:.0f} ms ({b['late_clients']} late), all answered within "
            f"{b['span_ms']:.0f} ms",
            f"  streams' ITL p99: before {_ms(b['itl_before_ms'], 'p99')} ms, during "
            f"{_ms(b['itl_during_ms'], 'p99')} ms "
            f"({'-' if ratio is None else f'{ratio:.2f}x'}); "
            f"{b['streams_through_burst']} streams ran past the burst",
            f"  router CPU per refused request: {b['router_cpu_us_per_refusal']:.0f} us "
            f"({b['router_cpu_us_per_refusal_raw']:.0f} us with the streams' share)",
        ]
    return "\n".join(lines)
