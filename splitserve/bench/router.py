"""`splitserve bench router`: what the router adds per request (gRPC and HTTP), how fast it decides,
and what session affinity saves on a conversation's second turn.

One process and one asyncio loop run the client, the routers and the direct path, over real
Ray workers on the bundled model; each router has its own Dispatcher, the direct path another.
Wall-clock times (perf_counter). The client shares the loop, so its gRPC work is on the
critical path, as for any sequential client, and so is router work left running after a
reply (the session's Redis PUT).

1. Overhead. One decode worker (TransferConfig() defaults, EngineConfig(kv_cache_gb=0.2,
   threads=1)); a short prompt it prefills itself; max_tokens 4, greedy; sequential requests,
   four paths interleaved in one loop (order rotated per rep), `--reps` after `--warmup`.
   Latency: from the call to the stream's end. direct: Dispatcher.generate on the prompt's
   token ids. router: a gRPC Client sends the text; the router tokenizes, validates, routes
   and streams back over loopback. router+session: the same with a session id, so a Redis
   GET (EmbeddedRedis) before routing and a background PUT after the last token. http: an
   aiohttp client POSTs the text to the OpenAI API's /v1/completions (one JSON body). Added
   latency: median over reps of (router path - direct) within a rep. As the model's steps
   make each latency vary by milliseconds, also the in-band part outside the Router: median
   of (client latency - the reply's timing.total_ms, which spans Router.generate: Redis GET,
   routing, Dispatcher). Breakdown, medians of `--reps` calls on the same loop: a unary gRPC
   round trip (ListModels), `prepare` (tokenize+validate) inline, an asyncio.to_thread hop
   (the servicer runs `prepare` in a thread), a PlacementStore GET and PUT.
2. Routing. Decisions/s of the pure `route()` on snapshots of 2, 16 and 128 workers per pool,
   1,000-token prompts (a prefill worker is picked too), 0.3 s per cell. cache_aware gets a
   session hint and the prefix index's answer that 3 workers hold 640-960 prompt tokens;
   cache_aware_all, that every other worker of both pools holds 320 (a system prompt).
   Prefix lookups/s: the router's work per request before route(), hashing a 1,000-token
   prompt's pages and querying an index where each of 128 + 128 workers holds part of that
   prompt and 1,000 other blocks. Router cost with a stub worker (answers at once; no
   model, no Ray): mean ms per request through Dispatcher.generate, Router.generate, and a
   client over gRPC.
3. Affinity. 2 prefill + 2 decode workers (EngineConfig(kv_cache_gb=0.3, threads=1)), two
   routers over them: cache_aware with Redis; round_robin, whose turn two lands on the other
   workers and recomputes the prompt. `--conversations` per policy, interleaved, each with its
   own ~1,000-token first user message (a unique tag: prefix caches do not help across them):
   turn 1 (max_tokens 32), then turn 2 = turn 1 + the reply + a short user message (max_tokens
   8), same session id. TTFT: client time from sending turn 2 to its first streamed message;
   also the server's timing.first_token_ms and usage.cached_prompt_tokens. Reported: medians
   and the ratio of median client TTFTs, cache_aware / round_robin.
4. Token path: what serving adds to each token. For 1 and `--streams` concurrent requests
   (the same 32-token prompt ids, greedy, ignore_eos, `--path-tokens` each): the engine
   alone in this process (LLMEngine.step in a loop on one thread), then one colocated decode
   worker on the same EngineConfig (the auto modes, `--threads`: every core unless told)
   behind a router, streamed over the OpenAI API by bench serve's client (/v1/completions,
   stream true, logprobs 0 to count each message's tokens). Per request: TPOT as bench serve
   takes it (end - first token) / (tokens - 1), the end being the engine's last step or the
   stream's end; median over the requests. Ratio: served / engine (target <= 1.15, issue 22).
5. First token of a disaggregated request: what the path adds to the prefill's own compute.
   One prefill and one decode worker (EngineConfig(kv_cache_gb=0.2, threads=1) each), a
   Dispatcher, `--first-reps` sequential greedy requests (after `--warmup`) of 64-token
   prompts (past local_prefill_tokens, so the prefill worker computes them), each unique
   in its first page (no prefix cache helps), max_tokens 2. TTFT: from Dispatcher.generate's
   call to its first delta. Compute: right after each request, another prompt of the same
   length prefilled by an LLMEngine on the same config in this process, from add_request
   to the step that samples the token. Overhead: median of the paired differences, TTFT -
   compute; set beside a Ray round trip (median of a no-op actor call, `info`). Its parts,
   from the request's Progress: the reservation (the prefill worker's wait for the decode
   worker's pages, FirstToken's waited_s), the prefill worker's engine from admission to
   the token (FirstToken's computed_s; its excess over the lone engine's compute), and
   the hops (TTFT less both: the call reaching the prefill worker, its engine thread's
   turn, the token's way back).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace as Method
from typing import Any, cast

import aiohttp
import ray
from ray.actor import ActorHandle

from cluster.config import EngineConfig, RouterConfig, TransferConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer
from cluster.protocol import (
    DecodeHandle,
    DecodeStats,
    EngineCounts,
    KVEvent,
    KVEventKind,
    KVEvents,
)
from cluster.types import (
    BlockHash,
    FinishReason,
    ModelInfo,
    RequestId,
    SamplingParams,
    Submission,
    TokenDelta,
)
from decode_worker.worker import spawn as spawn_decode
from prefill_worker.worker import spawn as spawn_prefill
from router import policy as routing
from router.app import RouterApp, start_router
from router.dispatch import Dispatcher, Progress
from router.placement import Placement, PlacementStore
from router.prefix_index import PrefixIndex, prompt_hashes
from router.request import Prepared, prepare
from splitserve.bench import RESULTS
from splitserve.bench.serve_backend import connect
from splitserve.client import Client, request
from splitserve.redis_server import EmbeddedRedis
from splitserve.serve_metrics import RequestRecord
from splitserve_api.v1 import splitserve_pb2 as pb

PROMPT = "The capital of France is"
MAX_TOKENS = 4
SESSION = "bench-overhead"  # the router+session path's session id
POLICIES = ("cache_aware", "round_robin")
Call = Callable[[], Awaitable[Any]]
ADDED, OUTSIDE = "added_median_ms", "outside_router_median_ms"


def _ms(xs: list[float]) -> dict[str, float]:
    """Median and p90 of seconds, in ms."""
    return {
        "median_ms": 1e3 * statistics.median(xs),
        "p90_ms": 1e3 * statistics.quantiles(xs, n=10)[-1],
    }


async def _median_ms(call: Call, n: int) -> float:
    took = []
    for _ in range(n):
        started = time.perf_counter()
        await call()
        took.append(time.perf_counter() - started)
    return 1e3 * statistics.median(took)


async def _drain(stream: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in stream]


async def _value(value: Any) -> Any:
    return value


# --- 2. routing decisions and the router's own cost ------------------------------------------


def route_rates() -> dict[str, dict[str, float]]:
    """Decisions per second of `route()`, by workers per pool and policy."""
    out: dict[str, dict[str, float]] = {}
    for n in (2, 16, 128):
        decode = [routing.DecodeLoad(f"d{i}", "e", 400 + 37 * i % 200, 1000, 16, i % 5, i % 3)
                  for i in range(n)]  # fmt: skip
        prefill = [routing.PrefillLoad(f"p{i}", "e", 97 * i % 4000) for i in range(n)]
        snapshot = routing.Snapshot(tuple(decode), tuple(prefill))
        hint = routing.SessionHint(f"d{n // 2}", "e", f"p{n // 2}", 900)
        longer = {960: frozenset({f"d{n // 4}"}), 640: frozenset({f"d{n // 2}", f"p{n // 3}"})}
        names = {*(w.worker for w in decode), *(w.worker for w in prefill)}
        every = {**longer, 320: frozenset(names - longer[960] - longer[640])}
        cases = {p.value: (p, longer) for p in routing.PolicyName}
        cases["cache_aware_all"] = (routing.PolicyName.CACHE_AWARE, every)
        out[str(n)] = {}
        for name, (policy, cached) in cases.items():
            config = routing.PolicyConfig(policy)
            calls, started = 0, time.perf_counter()
            while time.perf_counter() - started < 0.3:
                for turn in range(100):
                    request = routing.RouteRequest(1000, 32, hint, turn, cached)
                    routing.route(config, snapshot, request)
                calls += 100
            out[str(n)][name] = calls / (time.perf_counter() - started)
    return out


def prefix_lookup_rate() -> float:
    """Prefix lookups per second (prompt_hashes + overlaps) for a 1,000-token prompt."""
    prompt = list(range(1000, 2000))
    chain = prompt_hashes(prompt, 16)
    index = PrefixIndex()
    for i in range(256):
        held = (*chain[: i % len(chain)], *(BlockHash(os.urandom(16)) for _ in range(1000)))
        index.apply(f"w{i}", KVEvents("e", True, (KVEvent(KVEventKind.STORED, held),), 0))
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < 0.3:
        for _ in range(100):
            index.overlaps(prompt_hashes(prompt, 16))
        calls += 100
    return calls / (time.perf_counter() - started)


class StubDecode:
    """A decode worker that answers at once: each request gets max_tokens one-token deltas.
    Its methods' `remote` return coroutines where Ray's return ObjectRefs; both are awaited."""

    def __init__(self) -> None:
        self._out: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._cursor = 0
        counts = EngineCounts(0, 0, 0, 0, 0)
        stats = DecodeStats("e", 1000, 1000, 16, 0, 0, 0, 0, 0, counts, 0, 0, 0, None, None)
        self.submit, self.outputs = Method(remote=self._submit), Method(remote=self._outputs)
        self.stats = Method(remote=lambda: _value(stats))
        self.kv_events = Method(remote=lambda epoch, after: _value(KVEvents("e", True, (), 0)))
        self.info = Method(remote=lambda: _value(ModelInfo("stub", 2048, 49152, 16)))
        self.abort = Method(remote=lambda rid: _value(None))

    async def _submit(self, submission: Submission) -> None:
        n = submission.sampling.max_tokens
        for i in range(n):
            end = FinishReason.LENGTH if i == n - 1 else None
            self._out.put_nowait(TokenDelta(submission.request_id, i, (100 + i,), "x", (), end))

    async def _outputs(
        self, reader: str, after: int, timeout_s: float
    ) -> tuple[int, list[TokenDelta]]:
        delta = await self._out.get()
        self._cursor += 1
        return self._cursor, [delta]


async def router_cost(dispatcher: Dispatcher, reps: int) -> dict[str, float]:
    """Mean ms per request over `reps` sequential requests to a stub worker, by path."""
    stub = cast(DecodeHandle, StubDecode())
    app = await start_router(
        RouterConfig(port=0, metrics_port=None, http_port=None), 32, {}, {"stub": stub}, None
    )
    sampling = SamplingParams(max_tokens=MAX_TOKENS)
    prepared = Prepared(list(range(100, 108)), sampling, None, None)
    out = {}
    async with Client(app.address) as client:
        paths: dict[str, Call] = {
            "dispatcher": lambda: _drain(dispatcher.generate(prepared.prompt_ids, sampling, stub)),
            "router": lambda: _drain(app.router.generate(prepared)),
            "grpc": lambda: client.generate(PROMPT, max_tokens=MAX_TOKENS),
        }
        for name, call in paths.items():
            for _ in range(reps // 10):  # warm-up
                await call()
            started = time.perf_counter()
            for _ in range(reps):
                await call()
            out[name + "_ms"] = 1e3 * (time.perf_counter() - started) / reps
    await app.stop(1.0)
    return out


# --- 1. router overhead ----------------------------------------------------------------------


async def overhead(
    tok: Tokenizer, dispatcher: Dispatcher, redis_url: str, reps: int, warmup: int
) -> dict[str, Any]:
    decode = spawn_decode("bench-overhead", EngineConfig(kv_cache_gb=0.2, threads=1),
                          TransferConfig(), num_cpus=0)  # fmt: skip
    info: ModelInfo = await decode.info.remote()
    local = TransferConfig().local_prefill_tokens
    config = RouterConfig(port=0, metrics_port=None, http_port=0)
    app = await start_router(config, local, {}, {"d": decode}, redis_url)
    store, http = app.placements, app.http
    assert store is not None and http is not None
    ids, sampling = tok.encode(PROMPT), SamplingParams(max_tokens=MAX_TOKENS)
    took: dict[str, list[float]] = {"direct": [], "router": [], "router+session": [], "http": []}
    edge: dict[str, list[float]] = {path: [] for path in took}  # e2e - the router's total_ms
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    try:
        async with Client(app.address) as client, aiohttp.ClientSession() as session:

            async def run(path: str) -> tuple[str, float]:
                """The text, and the router's own timing.total_ms (0 where not reported)."""
                if path == "direct":
                    deltas = await _drain(dispatcher.generate(ids, sampling, decode))
                    return tok.decode([t for d in deltas for t in d.token_ids]), 0.0
                if path == "http":
                    url = http.address + "/v1/completions"
                    async with session.post(url, json=body) as response:
                        reply = await response.json()
                    return reply["choices"][0]["text"], 0.0
                sid = SESSION if path == "router+session" else ""
                got = await client.generate(PROMPT, session_id=sid, max_tokens=MAX_TOKENS)
                return got.text, got.timing.total_ms / 1e3

            expected, _ = await run("direct")
            for rep in range(warmup + reps):
                turn = rep % len(took)
                order = list(took)[turn:] + list(took)[:turn]
                for path in order:
                    started = time.perf_counter()
                    got, inside = await run(path)
                    if rep >= warmup:
                        took[path].append(time.perf_counter() - started)
                        edge[path].append(took[path][-1] - inside)
                    assert got == expected, f"{path}: {got} != {expected} (greedy, same prompt)"
            breakdown = await _breakdown(client, store, tok, info, reps)
    finally:
        await app.stop(1.0)
    paths = {path: _ms(xs) for path, xs in took.items()}
    for path in ("router", "router+session", "http"):
        diffs = [a - b for a, b in zip(took[path], took["direct"], strict=True)]
        paths[path][ADDED] = 1e3 * statistics.median(diffs)
        if path != "http":  # the HTTP reply carries no server timing
            paths[path][OUTSIDE] = 1e3 * statistics.median(edge[path])
    samples = {path: [1e3 * x for x in xs] for path, xs in took.items()}
    return dict(prompt_tokens=len(ids), paths=paths, breakdown=breakdown, samples_ms=samples)


async def _breakdown(
    client: Client, store: PlacementStore, tok: Tokenizer, info: ModelInfo, reps: int
) -> dict[str, float]:
    """Median ms of each piece of the router's path, measured alone on this loop."""
    msg, spot = request(PROMPT, max_tokens=4), Placement("d", "e", None, 9, time.time())
    return {
        "grpc_unary_round_trip_ms": await _median_ms(client.models, reps),
        "tokenize_validate_ms": await _median_ms(
            lambda: _value(prepare(msg, tok, info, 4096)), reps
        ),
        "to_thread_hop_ms": await _median_ms(lambda: asyncio.to_thread(int), reps),
        "redis_get_ms": await _median_ms(lambda: store.get(SESSION), reps),
        "redis_put_ms": await _median_ms(lambda: store.put("bench-put", spot), reps),
    }


# --- 3. second-turn TTFT with and without affinity -------------------------------------------


def first_message(tok: Tokenizer, tag: str, tokens: int) -> str:
    """A user message of about `tokens` tokens (chat template included), tagged throughout
    with `tag` so that no other conversation shares its prefix."""
    notes = [f"Conversation {tag}. Please read my notes."]
    chat = lambda: [{"role": "user", "content": " ".join(notes)}]
    while len(tok.encode_chat(chat())) < tokens:
        i = len(notes)
        notes.append(f"Note {i} ({tag}): the boat passed {7 * i % 13} lighthouses and {i} gulls.")
    return " ".join(notes)


async def _turn(
    client: Client, messages: list[dict[str, str]], session: str, max_tokens: int
) -> tuple[float, str, pb.GenerateResponse]:
    """(client TTFT in s, the reply's text, its last message)."""
    started, ttft, text, last = time.perf_counter(), 0.0, [], pb.GenerateResponse()
    async for piece in client.stream(messages, session_id=session, max_tokens=max_tokens):
        ttft = ttft or time.perf_counter() - started
        text.append(piece.text)
        last = piece
    return ttft, "".join(text), last


async def conversation(client: Client, tok: Tokenizer, tokens: int) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:10]
    messages = [{"role": "user", "content": first_message(tok, tag, tokens)}]
    _, reply, one = await _turn(client, messages, tag, 32)
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Thanks. Which note mentions the most gulls?"},
    ]
    ttft, _, two = await _turn(client, messages, tag, 8)
    return {
        "ttft_ms": 1e3 * ttft,
        "server_first_token_ms": two.timing.first_token_ms,
        "prompt_tokens": two.usage.prompt_tokens,
        "cached_prompt_tokens": two.usage.cached_prompt_tokens,
        "workers": [one.prefill_worker, one.decode_worker, two.prefill_worker, two.decode_worker],
    }


async def affinity(tok: Tokenizer, redis_url: str, conversations: int) -> dict[str, Any]:
    engine, transfer = EngineConfig(kv_cache_gb=0.3, threads=1), TransferConfig()
    prefill = {f"prefill-{i}": spawn_prefill(f"prefill-{i}", engine, transfer, 0) for i in (0, 1)}
    decode = {f"decode-{i}": spawn_decode(f"decode-{i}", engine, transfer, 0) for i in (0, 1)}
    infos = [h.info.remote() for h in prefill.values()] + [h.info.remote() for h in decode.values()]
    await asyncio.gather(*infos)
    apps: dict[str, RouterApp] = {}
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    try:
        for p in POLICIES:
            config, local = (
                RouterConfig(port=0, metrics_port=None, http_port=None, policy=p),
                transfer.local_prefill_tokens,
            )
            apps[p] = await start_router(config, local, prefill, decode, redis_url)
        clients = {p: Client(app.address) for p, app in apps.items()}
        await conversation(clients["round_robin"], tok, 200)  # warms up all four workers
        for k in range(conversations):
            for p in POLICIES[k % 2 :] + POLICIES[: k % 2]:
                runs[p].append(await conversation(clients[p], tok, 1000))
        await asyncio.gather(*(c.close() for c in clients.values()))
    finally:
        await asyncio.gather(*(app.stop(1.0) for app in apps.values()))
    keys = ("ttft_ms", "server_first_token_ms", "prompt_tokens", "cached_prompt_tokens")
    medians = {p: {k: statistics.median(r[k] for r in rs) for k in keys} for p, rs in runs.items()}
    ratio = medians["cache_aware"]["ttft_ms"] / medians["round_robin"]["ttft_ms"]
    return {"conversations": runs, "medians": medians, "ttft_ratio": ratio}


# --- 5. first token of a disaggregated request ---------------------------------------------

FIRST_TOKENS = 64  # prompt tokens: past local_prefill_tokens, so a prefill worker runs it


def first_prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    """`n` prompts of FIRST_TOKENS tokens, each unique in its first page of 16 tokens."""
    text = " ".join(f"Line {i}: the tide rose {i % 7} feet." for i in range(FIRST_TOKENS))
    body = tok.encode(text)
    return [[*tok.encode(f"Request {k} {uuid.uuid4().hex[:8]}."), *body][:FIRST_TOKENS]
            for k in range(n)]  # fmt: skip


def prefill_compute(engine: LLMEngine, ids: list[int]) -> float:
    """Seconds from add_request to the step that samples the prompt's first token."""
    started = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=1), RequestId(uuid.uuid4().hex))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


async def first_token(tok: Tokenizer, reps: int, warmup: int) -> dict[str, Any]:
    config, transfer = EngineConfig(kv_cache_gb=0.2, threads=1), TransferConfig()
    prefill = spawn_prefill("bench-first-prefill", config, transfer, num_cpus=0)
    decode = spawn_decode("bench-first-decode", config, transfer, num_cpus=0)
    await asyncio.gather(prefill.info.remote(), decode.info.remote())
    dispatcher, run = Dispatcher(), asyncio.get_running_loop().run_in_executor
    prompts = first_prompts(tok, 2 * (warmup + reps))
    parts: list[FirstTokenParts] = []
    with ThreadPoolExecutor(1) as thread:
        engine = await run(thread, LLMEngine, config)
        try:
            for ids, alone in zip(prompts[::2], prompts[1::2], strict=True):
                started, progress = time.monotonic(), Progress()
                stream = dispatcher.generate(
                    ids, SamplingParams(max_tokens=2), decode, prefill, None, progress
                )
                async for _ in stream:
                    break
                await _drain(stream)
                compute = await run(thread, prefill_compute, engine, alone)
                parts.append(first_token_parts(started, progress, compute))
            rtt = await _median_ms(decode.info.remote, reps)
        finally:
            await dispatcher.close()
            for worker in (prefill, decode):
                ray.kill(cast(ActorHandle, worker))
    medians = {
        f"{name}_median_ms": 1e3 * statistics.median(getattr(p, name) for p in parts[warmup:])
        for name in (f.name for f in dataclasses.fields(FirstTokenParts))
    }
    return {"prompt_tokens": FIRST_TOKENS, "reps": reps, **medians, "ray_round_trip_ms": rtt}


@dataclass(frozen=True)
class FirstTokenParts:
    """Where one disaggregated request's first token went, in seconds."""

    ttft: float  # from the Dispatcher's call to the first token out of its stream
    compute: float  # the same prompt length prefilled by an engine in this process, alone
    overhead: float  # ttft - compute: what the path adds
    reserve: float  # the prefill worker's wait for the reservation (and the call's start)
    worker_prefill: float  # the prefill worker's engine, from admission to the token
    inflation: float  # worker_prefill - compute: the worker's prefill over the lone engine's
    hops: float  # ttft - reserve - worker_prefill: the call's way there, the token's back


def first_token_parts(started: float, progress: Progress, compute: float) -> FirstTokenParts:
    """The parts of one request's first token, from its Progress (time.monotonic())."""
    assert progress.first_token_at is not None and progress.admitted_at is not None
    assert progress.prefill_s is not None, "a prefill worker computed the prompt"
    ttft, reserve = progress.first_token_at - started, progress.admitted_at - started
    return FirstTokenParts(
        ttft,
        compute,
        ttft - compute,
        reserve,
        progress.prefill_s,
        progress.prefill_s - compute,
        ttft - reserve - progress.prefill_s,
    )


def report_first_token(f: dict[str, Any]) -> list[str]:
    return [
        f"5. First token, disaggregated (1 prefill + 1 decode worker, {f['prompt_tokens']}-token "
        f"unique prompts, {f['reps']} sequential requests, medians)",
        f"TTFT {f['ttft_median_ms']:.1f} ms, the prefill's own compute "
        f"{f['compute_median_ms']:.1f} ms: the path adds {f['overhead_median_ms']:.1f} ms "
        f"(median of paired differences); a Ray round trip {f['ray_round_trip_ms']:.2f} ms",
        f"of it: the reservation {f['reserve_median_ms']:.1f} ms, the prefill worker's engine "
        f"{f['worker_prefill_median_ms']:.1f} ms ({f['inflation_median_ms']:+.1f} ms against the "
        f"lone engine), the call there and the token back {f['hops_median_ms']:.1f} ms",
    ]


# --- report ----------------------------------------------------------------------------------


# --- 4. the token path -------------------------------------------------------------------

PATH_PROMPT = list(range(1000, 1032))  # 32 token ids: no tokenizer on either path


def engine_per_token(engine: LLMEngine, streams: int, tokens: int) -> float:
    """Median TPOT (serve_metrics' definition) of `streams` requests run together here, each
    token's time taken as its step returns."""
    sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    sent = time.perf_counter()
    messages: dict[RequestId, list[tuple[float, int]]] = {}
    for i in range(streams):
        rid = RequestId(f"path-{streams}-{i}-{uuid.uuid4().hex[:6]}")
        engine.add_request(PATH_PROMPT, sampling, rid)
        messages[rid] = []
    while engine.has_unfinished():
        for out in engine.step():
            messages[out.request_id].append((time.perf_counter(), len(out.new_token_ids)))
    records = [RequestRecord(sent, m[-1][0], tuple(m), len(PATH_PROMPT)) for m in messages.values()]
    return statistics.median(_tpot(r) for r in records)


def _tpot(record: RequestRecord) -> float:
    assert record.ok and record.tpot is not None, record
    return record.tpot


async def token_path(streams: int, tokens: int, threads: int) -> dict[str, Any]:
    """Per-token time through the engine alone and served, at 1 and `streams` streams."""
    # `threads` on both paths (a Ray actor's torch would get one thread per CPU it asked
    # for); the engine alone on one thread of its own, as a worker's runs on its loop's.
    config = EngineConfig(kv_cache_gb=0.5, threads=threads)
    with ThreadPoolExecutor(1) as thread:
        run = asyncio.get_running_loop().run_in_executor
        engine = await run(thread, LLMEngine, config)
        alone = {}
        for n in (1, streams):
            await run(thread, engine_per_token, engine, n, tokens)  # warm-up
            alone[n] = await run(thread, engine_per_token, engine, n, tokens)
        mode = f"{engine.dtype}/{engine.quantization}".replace("torch.", "")
        del engine
    decode = spawn_decode("bench-token-path", config, TransferConfig(), num_cpus=0)
    await decode.info.remote()
    router = RouterConfig(port=0, metrics_port=None, http_port=0)
    app = await start_router(router, 32, {}, {"d": decode}, None)
    assert app.http is not None
    served = {}
    try:
        async with connect("openai", app.http.address, "completions", None) as backend:
            for n in (1, streams):
                for _ in range(2):  # the first round warms up
                    runs = [backend.send(PATH_PROMPT, tokens, "", 120.0) for _ in range(n)]
                    records = [record for record, _ in await asyncio.gather(*runs)]
                served[n] = statistics.median(_tpot(r) for r in records)
    finally:
        await app.stop(1.0)
        ray.kill(cast(ActorHandle, decode))  # typed by its Protocol, it is Ray's handle
    return {
        "mode": mode,
        "threads": threads,
        "tokens": tokens,
        "rows": [
            {"streams": n, "engine_ms": 1e3 * alone[n], "served_ms": 1e3 * served[n],
             "ratio": served[n] / alone[n]}
            for n in (1, streams)
        ],
    }  # fmt: skip


def _target(what: str, value: float, limit: float, unit: str = "") -> str:
    met = "met" if value <= limit else "MISSED"
    return f"target: {what} <= {limit}{unit}: {value:.3g}{unit} ({met})"


def report(r: dict[str, Any]) -> str:
    o, b, cost, a = r["overhead"], r["overhead"]["breakdown"], r["router_cost"], r["affinity"]
    lines = [
        f"1. Router overhead: one decode worker, {o['prompt_tokens']}-token prompt, max_tokens "
        f"{MAX_TOKENS}, greedy, {r['reps']} interleaved reps after {r['warmup']} warm-up",
        f"{'path':<16} {'median':>9} {'p90':>9} {'added: median paired diff':>26} "
        f"{'e2e - router total_ms':>22}",
    ]
    for name, p in o["paths"].items():
        added, edge = (f"{p[k]:+.2f} ms" if k in p else "-" for k in (ADDED, OUTSIDE))
        lines.append(
            f"{name:<16} {p['median_ms']:>6.2f} ms {p['p90_ms']:>6.2f} ms {added:>26} {edge:>22}"
        )
    lines += [
        f"breakdown (medians): gRPC unary round trip {b['grpc_unary_round_trip_ms']:.2f} ms, "
        f"tokenize+validate {b['tokenize_validate_ms']:.2f} ms, to_thread hop "
        f"{b['to_thread_hop_ms']:.2f} ms,\n  Redis GET {b['redis_get_ms']:.2f} ms, Redis PUT "
        f"(background) {b['redis_put_ms']:.2f} ms",
        f"stub workers (mean per request): Dispatcher {cost['dispatcher_ms']:.3f} ms, "
        f"Router.generate {cost['router_ms']:.3f} ms, over gRPC {cost['grpc_ms']:.3f} ms",
    ]
    for name in ("router", "router+session", "http"):
        lines.append(_target(f"{name} added median", o["paths"][name][ADDED], 1, " ms"))
    names = list(next(iter(r["route_rates"].values())))
    lines += ["", "2. Routing decisions per second, pure route() (1,000-token prompt)",
              f"{'workers/pool':>12} " + " ".join(f"{p:>15}" for p in names)]  # fmt: skip
    for n, rates in r["route_rates"].items():
        lines.append(f"{n:>12} " + " ".join(f"{rates[p]:>15,.0f}" for p in names))
    lines.append(f"prefix lookups/s (hash + index, 256 workers): {r['prefix_lookups']:,.0f}")
    lines += [
        "",
        f"3. Second-turn TTFT, ~1,000-token conversations, {r['conversations']} per policy, "
        "2 prefill + 2 decode workers (medians)",
        f"{'policy':<12} {'client TTFT':>12} {'server 1st tok':>15} {'prompt':>7} {'cached':>7}",
    ]
    for policy, m in a["medians"].items():
        lines.append(
            f"{policy:<12} {m['ttft_ms']:>9.1f} ms {m['server_first_token_ms']:>12.1f} ms "
            f"{m['prompt_tokens']:>7.0f} {m['cached_prompt_tokens']:>7.0f}"
        )
    lines.append(_target("TTFT cache_aware / round_robin", a["ttft_ratio"], 0.5))
    tail = [*report_token_path(r["token_path"]), "", *report_first_token(r["first_token"])]
    return "\n".join([*lines, "", *tail])


def report_token_path(t: dict[str, Any]) -> list[str]:
    lines = [
        f"4. Token path: ms per token after the first, {t['tokens']}-token greedy replies, "
        f"engine {t['mode']} on {t['threads']} threads (medians over the requests)",
        f"{'streams':>7} {'engine alone':>13} {'served (HTTP)':>14} {'served / engine':>16}",
    ]
    for row in t["rows"]:
        lines.append(
            f"{row['streams']:>7} {row['engine_ms']:>10.1f} ms {row['served_ms']:>11.1f} ms "
            f"{row['ratio']:>16.2f}"
        )
    for row in t["rows"]:
        lines.append(_target(f"served / engine at {row['streams']} streams", row["ratio"], 1.15))
    return lines


async def _run(args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    if args.token_path_only:
        return {"token_path": await token_path(args.streams, args.path_tokens, args.threads)}
    tok = await asyncio.to_thread(Tokenizer.load, bundled_model_path())
    if args.first_token_only:
        return {"first_token": await first_token(tok, args.first_reps, args.warmup)}
    results: dict[str, Any] = {k: getattr(args, k) for k in ("reps", "warmup", "conversations")}
    results["route_rates"] = route_rates()
    results["prefix_lookups"] = prefix_lookup_rate()
    dispatcher = Dispatcher()  # the direct path's
    results["router_cost"] = await router_cost(dispatcher, 20 * args.reps)
    results["overhead"] = await overhead(tok, dispatcher, redis_url, args.reps, args.warmup)
    results["affinity"] = await affinity(tok, redis_url, args.conversations)
    results["token_path"] = await token_path(args.streams, args.path_tokens, args.threads)
    results["first_token"] = await first_token(tok, args.first_reps, args.warmup)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench router", description=__doc__)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--streams", type=int, default=16, help="token path: the many-stream row")
    parser.add_argument("--path-tokens", type=int, default=64, help="token path: tokens a reply")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="token path: the engine's threads"
    )
    parser.add_argument("--token-path-only", action="store_true", help="section 4 alone")
    parser.add_argument("--first-reps", type=int, default=30, help="first token: requests")
    parser.add_argument("--first-token-only", action="store_true", help="section 5 alone")
    parser.add_argument("--out", type=Path, default=RESULTS / "router.json")
    args = parser.parse_args(argv)
    redis = EmbeddedRedis()
    redis_url = redis.start()
    try:
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
        results = asyncio.run(_run(args, redis_url))
    finally:
        ray.shutdown()
        redis.stop()
    if args.token_path_only:
        print("\n".join(report_token_path(results["token_path"])))
    elif args.first_token_only:
        print("\n".join(report_first_token(results["first_token"])))
    else:
        print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nresults: {args.out}")
    return 0
