"""`splitserve bench chaos --scenario overload|flood`: the front doors under pressure, on a
real `splitserve serve` with one prefill and one decode worker.

overload, on each front door in turn (gRPC, then HTTP):
1. Reference: each of `--distinct` token-id prompts alone, greedy, `--stream-tokens` long.
2. `--max-pending` streams of those prompts start at once; once every one of them has
   its first token (all accepted streams running), a second process sends twice as many
   more (3x max_pending in all), each a refusal the client times: all at once, then again
   one after another (the server's answer alone, without the client's own queue of
   2x max_pending calls).
3. Every stream must end OK with exactly its reference's tokens (text over HTTP). The
   router process's CPU time from the streams' start to their end, over the tokens they
   streamed, bounds the router's work per token from above (it includes admitting the
   streams and the refusals).

flood, on gRPC:
1. Idle: `--normal` normal requests (a short prompt, `--normal-tokens` long), one after
   another: their latency alone.
2. `--flood-senders` senders, one client key between them, each sending texts of just
   under `max_model_len x MAX_CHARS_PER_TOKEN` characters (random words, more tokens
   than the context) for `--flood-s` seconds, while a second client sends normal requests
   one after another. The router process's CPU time over the flood, divided by the flood
   requests it answered, bounds each refusal's CPU from above (it includes the normal
   requests and the router's own polls).
3. Idle again, the normal requests after the flood.

The summary's figures are the issue's targets: refusal p99 <= 5 ms (overload), normal
latency during the flood <= 1.5x idle and <= 50 ms of CPU per flood refusal (flood).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import string
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, TypeVar

import psutil

from router.request import MAX_CHARS_PER_TOKEN
from splitserve.bench.chaos_doors import Call, Door, GrpcDoor, HttpDoor, Prompt
from splitserve.client import Client
from splitserve.serve_metrics import OK, percentile
from splitserve.serve_workload import VOCAB_SIZE

T = TypeVar("T")


def token_checked_weights() -> str:
    """The weights of a server whose every stream is checked against the same request served
    alone: the GGUF's own blocks on our kernel (cluster/engine/kernels/qmatmul.c), whose every
    row's result depends on that row alone, so a request's tokens are the same whatever its
    batch (and it decodes ~4x faster than on float weights); float weights where that kernel
    does not build, as torch's int4 kernel rounds differently with the batch's rows."""
    from cluster.engine.kernels import qmatmul

    return "gguf" if qmatmul.available() else "none"


def pressure_doc(args: argparse.Namespace) -> dict[str, Any]:
    """The server for a pressure scenario: every accepted stream fits the decode batch."""
    seqs = args.max_pending if args.scenario in ("overload", "burst") else 64
    router: dict[str, Any] = {"max_pending": args.max_pending, "http_port": 0}
    if args.max_pending_per_client is not None:
        router["max_pending_per_client"] = args.max_pending_per_client
    return {
        "engine": {"dtype": args.dtype, "quantization": token_checked_weights(),
                   "kv_cache_gb": args.kv_cache_gb or 1.5, "threads": 1, "max_num_seqs": seqs},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
        "router": router,
    }  # fmt: skip


def open_door(kind: str, target: str) -> Door:
    return GrpcDoor(target) if kind == "grpc" else HttpDoor(target)


def stats_ms(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    ms = [1e3 * x for x in xs]
    return {"n": len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms)}


# --- overload ------------------------------------------------------------------------


Sent = tuple[float, float, str]  # a request's start and end (perf_counter) and status


def burst(kind: str, target: str, n: int, prompt: Prompt) -> dict[str, list[Sent]]:
    """In a process of its own (the streams' client is busy): `n` requests at once, then
    `n` one after another; each one's start, end and status."""

    async def fire() -> dict[str, list[Sent]]:
        door = open_door(kind, target)
        try:
            await door.call(prompt, 1, "warm")  # connected before the clock starts
            at_once = await asyncio.gather(*(door.call(prompt, 1, "burst") for _ in range(n)))
            in_turn = [await door.call(prompt, 1, "burst") for _ in range(n)]
        finally:
            await door.close()
        return {mode: [(c.start, c.end, c.status) for c in calls]
                for mode, calls in (("at_once", at_once), ("one_by_one", in_turn))}  # fmt: skip

    return asyncio.run(fire())


def warm() -> None:
    """Imports done in the burst process before it is timed."""


def prompts_of(args: argparse.Namespace) -> list[Prompt]:
    """`--distinct` token-id prompts of `--prompt-tokens`, seeded."""
    rng = random.Random(args.seed)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(args.prompt_tokens)]
            for _ in range(args.distinct)]  # fmt: skip


async def references(door: Door, prompts: list[Prompt], tokens: int) -> list[Call]:
    """Each prompt alone, `tokens` long: what its streams must stream."""
    reference = [await door.call(p, tokens, "streams") for p in prompts]
    if failed := [c for c in reference if c.status != OK]:
        raise RuntimeError(f"the reference run failed: {failed[0]}")
    return reference


async def beside_streams(
    door: Door, prompts: list[Prompt], args: argparse.Namespace,
    then: Callable[[], Awaitable[T]],
) -> tuple[list[Call], T | None]:  # fmt: skip
    """`--max-pending` streams of the prompts (in turn) at once, `--stream-tokens` long;
    once every one has its first token, `then()`. The streams' Calls and what `then`
    returned (None: the streams ended before all were running)."""
    running = 0
    all_running = asyncio.Event()

    def first() -> None:
        nonlocal running
        running += 1
        if running == args.max_pending:
            all_running.set()

    ended = asyncio.gather(*(
        door.call(prompts[i % len(prompts)], args.stream_tokens, "streams", first)
        for i in range(args.max_pending)
    ))  # fmt: skip
    waiting = asyncio.ensure_future(all_running.wait())
    either: list[asyncio.Future[Any]] = [waiting, ended]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    result = await then() if all_running.is_set() else None
    return list(await ended), result


async def overload(kind: str, target: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    prompts = prompts_of(args)
    loop = asyncio.get_running_loop()
    door = open_door(kind, target)
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        await loop.run_in_executor(pool, warm)  # before any stream: it takes seconds
        try:
            reference = await references(door, prompts, args.stream_tokens)

            async def refuse() -> dict[str, list[Sent]]:
                n = 2 * args.max_pending
                return await loop.run_in_executor(pool, burst, kind, target, n, prompts[0])

            router = psutil.Process(pid)
            cpu = sum(router.cpu_times()[:2])
            calls, refusals = await beside_streams(door, prompts, args, refuse)
            cpu = sum(router.cpu_times()[:2]) - cpu
        finally:
            await door.close()
    summary = overload_summary(kind, reference, calls, refusals or {})
    tokens = args.stream_tokens * summary["streams_ok"]  # ignore_eos: each gets them all
    return {**summary, "router_cpu_s": cpu, "router_cpu_us_per_token": 1e6 * cpu / max(1, tokens)}


def overload_summary(
    kind: str,
    reference: list[Call],
    streams: list[Call],
    refusals: dict[str, list[Sent]],
) -> dict[str, Any]:
    """Streams against their references (stream i ran prompt i mod len(reference))."""
    wrong = sum(
        1 for i, c in enumerate(streams)
        if c.status == OK and c.output != reference[i % len(reference)].output
    )  # fmt: skip
    return {
        "door": kind,
        "streams": len(streams),
        "streams_ok": sum(c.status == OK for c in streams),
        "streams_failed": dict(Counter(c.status for c in streams if c.status != OK)),
        "streams_wrong_output": wrong,
        "burst": {mode: _burst(sent) for mode, sent in refusals.items()},
    }


def _burst(sent: list[Sent]) -> dict[str, Any]:
    """`sent_ms`: from the first request's start to the last one's (the client's own
    pace); `span_ms`: to the last answer."""
    starts, ends = [a for a, _, _ in sent], [b for _, b, _ in sent]
    return {
        "sent": len(sent),
        "by_status": dict(Counter(s for _, _, s in sent)),
        "refusal_ms": stats_ms([b - a for a, b, s in sent if s != OK]),
        "sent_ms": 1e3 * (max(starts) - min(starts)),
        "span_ms": 1e3 * (max(ends) - min(starts)),
    }


# --- flood ---------------------------------------------------------------------------


def near_limit_text(max_model_len: int, seed: int) -> str:
    """Random words, just under the characters the router lets through to the tokenizer
    (and several times more tokens than the context)."""
    rng = random.Random(seed)
    chars = max_model_len * MAX_CHARS_PER_TOKEN - 200
    words: list[str] = []
    size = 0
    while size < chars:
        words.append("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))))
        size += len(words[-1]) + 1
    return " ".join(words)[:chars]


async def flood(target: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    async with Client(target) as client:
        [model] = await client.models()
    text = near_limit_text(model.max_model_len, args.seed)
    rng = random.Random(args.seed)
    normal_prompt = [rng.randrange(VOCAB_SIZE) for _ in range(args.prompt_tokens)]
    normal, flooder = GrpcDoor(target), GrpcDoor(target)
    try:

        async def normals(n: int | None, until: float = 0.0) -> list[Call]:
            out: list[Call] = []
            while (len(out) < n) if n is not None else (time.monotonic() < until):
                out.append(await normal.call(normal_prompt, args.normal_tokens, "normal"))
            return out

        await normals(2)  # warm-up: first calls pay one-time costs
        before = await normals(args.normal)
        floods: list[Call] = []
        stop_at = time.monotonic() + args.flood_s

        async def sender() -> None:
            while time.monotonic() < stop_at:
                floods.append(await flooder.call(text, 1, "flood"))

        router, me = psutil.Process(pid), psutil.Process()
        cpu, mine = sum(router.cpu_times()[:2]), sum(me.cpu_times()[:2])
        senders = asyncio.gather(*(sender() for _ in range(args.flood_senders)))
        during = await normals(None, stop_at)
        await senders
        cpu, mine = sum(router.cpu_times()[:2]) - cpu, sum(me.cpu_times()[:2]) - mine
        after = await normals(args.normal)
    finally:
        await normal.close()
        await flooder.close()
    return {**flood_summary(before, during, after, floods, cpu, len(text)), "client_cpu_s": mine}


def flood_summary(
    before: list[Call], during: list[Call], after: list[Call], floods: list[Call],
    router_cpu_s: float, text_chars: int,
) -> dict[str, Any]:  # fmt: skip
    idle = [c.latency_s for c in before if c.status == OK]
    loaded = [c.latency_s for c in during if c.status == OK]
    ratio = None
    if idle and loaded:
        ratio = percentile(loaded, 50) / percentile(idle, 50)
    return {
        "text_chars": text_chars,
        "normal_idle_ms": stats_ms(idle),
        "normal_during_ms": stats_ms(loaded),
        "normal_after_ms": stats_ms([c.latency_s for c in after if c.status == OK]),
        "normal_failed": sum(c.status != OK for c in [*before, *during, *after]),
        "normal_during_vs_idle_p50": ratio,
        "flood_requests": len(floods),
        "flood_by_status": dict(Counter(c.status for c in floods)),
        "flood_latency_ms": stats_ms([c.latency_s for c in floods]),
        "router_cpu_s": router_cpu_s,
        "router_cpu_ms_per_flood_request": 1e3 * router_cpu_s / max(1, len(floods)),
    }


def _ms(s: dict[str, float] | None, key: str) -> str:
    return "-" if s is None else f"{s[key]:.1f}"


def pressure_table(result: dict[str, Any]) -> str:
    lines = []
    for o in result.get("overload", []):
        lines.append(
            f"overload over {o['door']}: {o['streams_ok']}/{o['streams']} streams OK "
            f"(failed {o['streams_failed'] or 0}, wrong output {o['streams_wrong_output']}); "
            f"router CPU {o['router_cpu_us_per_token']:.0f} us per streamed token"
        )
        for mode, b in o["burst"].items():
            r = b["refusal_ms"]
            lines.append(
                f"  {b['sent']} more {mode.replace('_', ' ')}: {b['by_status']}; refusal "
                f"p50 {_ms(r, 'p50')} ms, p99 {_ms(r, 'p99')} ms, max {_ms(r, 'max')} ms; "
                f"all sent within {b['sent_ms']:.0f} ms, answered within {b['span_ms']:.0f} ms"
            )
    if (f := result.get("flood")) is not None:
        ratio = f["normal_during_vs_idle_p50"]
        times = "-" if ratio is None else f"{ratio:.2f}x"
        lines.append(
            f"flood of {f['text_chars']}-character texts: {f['flood_requests']} requests "
            f"{f['flood_by_status']}, latency p50 {_ms(f['flood_latency_ms'], 'p50')} ms; "
            f"router CPU {f['router_cpu_ms_per_flood_request']:.1f} ms per flood request "
            f"({f['router_cpu_s']:.1f} s in all; the client's {f.get('client_cpu_s', 0):.1f} s)"
        )
        lines.append(
            f"  normal request p50: idle {_ms(f['normal_idle_ms'], 'p50')} ms, during "
            f"{_ms(f['normal_during_ms'], 'p50')} ms ({times}), "
            f"after {_ms(f['normal_after_ms'], 'p50')} ms; failed {f['normal_failed']}"
        )
    return "\n".join(lines)
