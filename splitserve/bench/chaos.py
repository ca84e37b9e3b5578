"""`splitserve bench chaos`: kill -9 workers of a real `splitserve serve` under load, and
check every request against the same request on an idle server.

1. Start `splitserve serve` (splitserve.bench.process.splitserve) with `--prefill` prefill and
   `--decode` decode workers on the bundled model; each pool keeps its size, so it
   replaces a worker that dies.
2. Idle run: each request of a fixed, seeded mix (token-id prompts of mixed lengths,
   greedy, ignore_eos, mixed output lengths) alone, one after another: the reference
   tokens and latencies.
3. Loaded run: `--concurrency` streams over gRPC, each sending the mix's requests in turn
   (every request at least once), while every `--interval-s` seconds a worker process gets
   kill -9 (a random phase of `--kill-phase`, then a random process of that phase;
   splitserve/bench/chaos_faults.py says how they are found), `--kills` times; the next kill waits
   until the pool has replaced the last victim, so each recovery is measured alone. With
   `--redis-kill`, the embedded valkey-server is killed too, once, halfway. The streams
   stop once the kills are done.
4. At the end, every worker's free KV pages (GetServerInfo, which reports the stats the
   router polls from each worker) must come back to its total within `--settle-s`.

Prints requests sent, completed, failed by status and message class, wrong-token
requests (first divergence), recovery times, the extra latency of requests in flight at a
kill (and of the others, for the batching cost alone), and the pages at the end
(splitserve/bench/chaos_report.py). `--kills 0 --no-redis-kill` is the control: the same
load with no fault, the floor of wrong tokens from batching alone.

`--scenario overload` and `--scenario flood` put the front doors under pressure instead
(splitserve/bench/chaos_pressure.py): refusals timed at 3x `max_pending` while every accepted stream
runs, and a flood of near-limit inputs against a normal client's latency. `--scenario
burst` (splitserve/bench/chaos_burst.py) times a burst's refusals at once, from clients
already connected, against the running streams' inter-token latency and the router's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc

from splitserve.bench.chaos_burst import burst_run, burst_table
from splitserve.bench.chaos_faults import Victim, kill_valkey, kill_worker, pages, workers
from splitserve.bench.chaos_pressure import (
    flood,
    overload,
    pressure_doc,
    pressure_table,
    token_checked_weights,
)
from splitserve.bench.chaos_report import (
    Fault,
    Outcome,
    WorkerPages,
    message_class,
    summarize,
    table,
)
from splitserve.bench.process import Served, splitserve
from splitserve.client import Client
from splitserve.serve_workload import VOCAB_SIZE
from splitserve.workload import LengthDist, Request, make_requests

WARMUP = 2  # requests before the idle run, not recorded (first calls pay one-time costs)


def make_mix(args: argparse.Namespace) -> list[Request]:
    prompts = LengthDist(args.prompt_median, 0.8, args.prompt_min, args.prompt_max)
    outputs = LengthDist(args.output_median, 0.6, args.output_min, args.output_max)
    return make_requests(args.mix, VOCAB_SIZE, args.seed, prompts, outputs)


def serve_doc(args: argparse.Namespace) -> dict[str, Any]:
    engine = {"dtype": args.dtype, "quantization": token_checked_weights(),
              "kv_cache_gb": args.kv_cache_gb or 0.25, "threads": 1}  # fmt: skip
    return {
        "engine": engine,
        "prefill": {"replicas": args.prefill},
        "decode": {"replicas": args.decode},
    }


async def send(client: Client, item: int, request: Request, timeout_s: float) -> Outcome:
    """One greedy request streamed to its end; its outcome, failures included."""
    tokens: list[int] = []
    start = time.monotonic()
    try:
        async for piece in client.stream(
            request.prompt, timeout_s, max_tokens=request.output_len, ignore_eos=True,
            temperature=0.0,
        ):  # fmt: skip
            tokens.extend(piece.token_ids)
    except grpc.aio.AioRpcError as e:
        detail = message_class(e.details() or "")
        return Outcome(item, start, time.monotonic(), tuple(tokens), e.code().name, detail)
    return Outcome(item, start, time.monotonic(), tuple(tokens))


async def idle_run(client: Client, mix: list[Request], timeout_s: float) -> list[Outcome]:
    for request in mix[:WARMUP]:
        await send(client, -1, request, timeout_s)
    idle = [await send(client, i, r, timeout_s) for i, r in enumerate(mix)]
    if failed := [o for o in idle if o.status != "OK"]:
        raise RuntimeError(f"the idle run failed, nothing to compare with: {failed[0]}")
    return idle


def _seconds(s: float | None) -> str:
    return "never" if s is None else f"{s:.2f} s"


async def inject(client: Client, args: argparse.Namespace, root: int, faults: list[Fault]) -> None:
    """`args.kills` worker kills, `args.interval_s` apart at least, each waited on until
    the pool replaced it; the valkey-server kill (if asked) before the middle one."""
    rng = random.Random(args.seed)
    phases = ("prefill", "decode") if args.kill_phase == "any" else (args.kill_phase,)
    replicas = {"prefill": args.prefill, "decode": args.decode}
    redis_at = args.kills // 2 if args.redis_kill else None
    next_at = time.monotonic() + args.interval_s
    for k in range(args.kills):
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if k == redis_at and (fault := await kill_valkey(root, args.recovery_timeout_s)):
            faults.append(fault)
            back = _seconds(fault.recovered_s)
            print(f"  kill -9 valkey-server: answering again after {back}", file=sys.stderr)
        phase = rng.choice(phases)  # then one of its processes: each phase as often
        candidates = sorted(v.pid for v in workers(root, (phase,)))
        if not candidates:
            print(f"  no {phase} worker process found; stopping the kills", file=sys.stderr)
            return
        victim = Victim(phase, rng.choice(candidates))
        fault = await kill_worker(client, victim, replicas[victim.target], args.recovery_timeout_s)
        faults.append(fault)
        print(
            f"  kill {k + 1}/{args.kills}: {fault.gone or victim.target} (pid {victim.pid}) -> "
            f"{fault.replacement or 'not replaced'} after {_seconds(fault.recovered_s)}",
            file=sys.stderr,
        )
        next_at = fault.at + args.interval_s


async def loaded_run(
    client: Client, mix: list[Request], args: argparse.Namespace, root: int
) -> tuple[list[Outcome], list[Fault]]:
    """The mix over `args.concurrency` streams while the faults are injected."""
    outcomes: list[Outcome] = []
    faults: list[Fault] = []
    numbers = itertools.count()
    faults_done = asyncio.Event()

    async def stream() -> None:
        for n in numbers:
            if n >= len(mix) and faults_done.is_set():
                return
            item = n % len(mix)
            outcomes.append(await send(client, item, mix[item], args.request_timeout_s))

    async def faults_then_stop() -> None:
        try:
            await inject(client, args, root, faults)
        finally:
            faults_done.set()

    await asyncio.gather(faults_then_stop(), *(stream() for _ in range(args.concurrency)))
    return outcomes, faults


async def settle(client: Client, timeout_s: float) -> tuple[list[WorkerPages], float]:
    """Each worker's pages once all are free, or as they are after timeout_s; and how
    long that took."""
    start = time.monotonic()
    while True:
        now = await pages(client)
        if all(p.free == p.total for p in now) or time.monotonic() - start > timeout_s:
            return now, time.monotonic() - start
        await asyncio.sleep(0.1)


async def run(args: argparse.Namespace, served: Served) -> dict[str, Any]:
    mix = make_mix(args)
    async with Client(served.address) as client:
        print(f"idle run: {len(mix)} requests, one at a time", file=sys.stderr)
        idle = await idle_run(client, mix, args.request_timeout_s)
        print(f"loaded run: {args.concurrency} streams, {args.kills} kills", file=sys.stderr)
        start = time.monotonic()
        outcomes, faults = await loaded_run(client, mix, args, served.pid)
        duration = time.monotonic() - start
        final, settle_s = await settle(client, args.settle_s)
    summary = summarize(idle, outcomes, faults, final)
    return {
        "summary": {**summary, "loaded_run_s": duration, "pages_settled_s": settle_s},
        "faults": [asdict(f) for f in faults],
        "mix": [{"prompt_tokens": len(r.prompt), "output_tokens": r.output_len} for r in mix],
        "idle_latency_s": [o.latency_s for o in idle],
        "requests": [_record(o, start) for o in outcomes],
    }


async def _scenario(args: argparse.Namespace, served: Served) -> dict[str, Any]:
    if args.scenario == "overload":
        targets = {"grpc": served.address, "http": served.http_url or ""}
        doors = args.doors.split(",")
        return {"overload": [await overload(d, targets[d], served.pid, args) for d in doors]}
    if args.scenario == "burst":
        targets = {"grpc": served.address, "http": served.http_url or ""}
        doors = args.doors.split(",")
        return {"burst": [await burst_run(d, targets[d], served.pid, args) for d in doors]}
    if args.scenario == "flood":
        return {"flood": await flood(served.address, served.pid, args)}
    return await run(args, served)


def _record(o: Outcome, start: float) -> dict[str, Any]:
    """One loaded request for the JSON: its tokens' count, not the tokens."""
    return {
        "item": o.item,
        "start_s": o.start - start,
        "latency_s": o.latency_s,
        "tokens": len(o.tokens),
        "status": o.status,
        "detail": o.detail,
    }


def _tree() -> dict[str, Any]:
    """The code the server ran: the commit, and the files changed since (uncommitted)."""
    git = ["git", "-C", str(Path(__file__).resolve().parent)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    return {"commit": head.stdout.strip(), "uncommitted": dirty.stdout.splitlines()}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitserve bench chaos", description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=["kills", "overload", "flood", "burst"], default="kills")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (the pool's size)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (the pool's size)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="per worker (default: 0.25; overload and flood 1.5, for every stream at once)",
    )
    p.add_argument("--mix", type=int, default=48, help="distinct requests in the mix")
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-median", type=int, default=100)
    p.add_argument("--prompt-max", type=int, default=400)
    p.add_argument("--output-min", type=int, default=16)
    p.add_argument("--output-median", type=int, default=48)
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16, help="streams in the loaded run")
    p.add_argument("--kills", type=int, default=10, help="worker kills (0: the control run)")
    p.add_argument("--interval-s", type=float, default=5.0, help="at least this between kills")
    p.add_argument("--kill-phase", choices=["any", "prefill", "decode"], default="any")
    p.add_argument(
        "--redis-kill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kill -9 the embedded valkey-server once, halfway through the kills",
    )
    p.add_argument("--recovery-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=180.0,
        help="each request's gRPC deadline: one stuck past it counts as DEADLINE_EXCEEDED",
    )
    p.add_argument("--settle-s", type=float, default=60.0, help="for pages to come back")
    p.add_argument("--seed", type=int, default=0)
    pressure = p.add_argument_group(
        "overload, flood and burst (splitserve/bench/chaos_pressure.py, chaos_burst.py)"
    )
    pressure.add_argument("--max-pending", type=int, default=256, help="the router's limit")
    pressure.add_argument(
        "--max-pending-per-client", type=int, default=None, help="the router's per-client limit"
    )
    pressure.add_argument("--doors", default="grpc,http", help="overload, burst: in turn")
    pressure.add_argument("--prompt-tokens", type=int, default=16)
    pressure.add_argument("--distinct", type=int, default=4, help="overload: distinct prompts")
    pressure.add_argument(
        "--stream-tokens", type=int, default=None, help="each stream's (overload 32, burst 64)"
    )
    pressure.add_argument("--burst", type=int, default=2, help="burst: x max_pending at once")
    pressure.add_argument(
        "--before-s", type=float, default=1.0, help="burst: the streams watched before it"
    )
    pressure.add_argument("--burst-clients", type=int, default=4, help="burst: processes")
    pressure.add_argument(
        "--setup-s", type=float, default=3.0, help="burst: for its clients to connect"
    )
    pressure.add_argument("--normal", type=int, default=16, help="flood: idle normal requests")
    pressure.add_argument("--normal-tokens", type=int, default=16)
    pressure.add_argument("--flood-senders", type=int, default=32)
    pressure.add_argument("--flood-s", type=float, default=15.0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--log-dir", default=None, help="the server's config and log (default: tmp)")
    args = p.parse_args(argv)
    if args.stream_tokens is None:  # a burst's streams must outlast its quiet window
        args.stream_tokens = 64 if args.scenario == "burst" else 32
    for phase in ("prefill", "decode"):
        if args.kill_phase == phase and getattr(args, phase) == 0:
            p.error(f"--kill-phase {phase}: there are no {phase} workers (--{phase} 0)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="splitserve-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server config and log: {log_dir}", file=sys.stderr)
    tree = _tree()  # as the server starts: the tree may change while it runs
    doc = serve_doc(args) if args.scenario == "kills" else pressure_doc(args)
    with splitserve("chaos", doc, log_dir) as served:
        result = asyncio.run(_scenario(args, served))
    result["command"] = shlex.join(["splitserve", "bench", "chaos", *argv])
    result["serve_config"] = doc
    result["tree"] = tree
    if args.scenario == "kills":
        print(table(f"chaos ({args.kills} kills, {args.concurrency} streams)", result["summary"]))
    elif args.scenario == "burst":
        print(burst_table(result["burst"]))
    else:
        print(pressure_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
