"""`splitserve bench serve`: load a running server with a workload at a sweep of request rates.

`--backend grpc` (default) loads splitserve's gRPC API; `--backend openai` any
OpenAI-compatible server at a URL (splitserve's HTTP front door, vLLM, ...), streaming
`--endpoint` completions (token-id prompts: exact lengths) or chat. Both go through
splitserve/bench/serve_backend.py's one contract, so the same records and metrics come out.

1. Warm-up: `--warmup` conversations of the workload, one after another, not counted; if
   one fails the benchmark stops there.
2. Each rate of `--rates` is one run of `--num-requests` conversations (splitserve/workloads/,
   splitserve/serve_workload.py) arriving at splitserve/arrivals.py's offsets: Poisson, or
   gamma with
   `--burstiness`; `inf` sends them all at once. With `--concurrency N` at most N
   conversations are in flight; an arrival waits for a slot (with rate inf: a closed loop
   of N). For a multi-turn workload the rate counts conversations, and each turn is sent
   when the previous reply has ended. Every turn is one request, with max_tokens = its
   output length, ignore_eos, and a `--timeout-s` deadline: nothing hangs, and a request
   that fails is recorded by its status name (gRPC's, or HTTP_<code>; its partial reply,
   usually none, stays in its conversation, which goes on). Every run uses new token ids,
   same lengths.
3. Each run's records become its metrics (splitserve/serve_metrics.py: TTFT, TPOT, ITL, E2E,
   throughput, failures, SLO attainment against `--slo-ttft` and `--slo-tpot`); goodput
   is found over the sweep's finite rates. A table goes to stdout, JSON to `--out`: the
   config, the server's info, per rate the summary and every request's record. For a
   workload of shared system prompts, also each run's cached prompt tokens against the
   most a prefix cache could serve (serve_workload.ideal_cached_tokens, `--page-size`).

Client times are time.perf_counter, in this process's one asyncio loop: on a small machine
the client shares the CPUs with the server it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer
from splitserve.arrivals import send_offsets
from splitserve.bench import RESULTS
from splitserve.bench.serve_backend import Backend, connect
from splitserve.serve_metrics import (
    GOODPUT_ATTAINMENT,
    RequestRecord,
    RunSummary,
    Slo,
    Stats,
    highest_rate_meeting,
    interpolated_goodput,
    summarize,
)
from splitserve.serve_workload import (
    VOCAB_SIZE,
    Conversation,
    WorkloadSpec,
    ideal_cached_tokens,
    load_workload,
    make_conversations,
)

T = TypeVar("T")


class WarmupFailed(Exception):
    pass


class Progress:
    """One line on stderr, rewritten in place: `rate 1/s  37/100 done  2 failed`."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self._show()

    def add(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.ok
        self._show()

    def _show(self) -> None:
        line = f"{self.label}  {self.done}/{self.total} done  {self.failed} failed"
        end = "\n" if self.done == self.total else ""
        print(f"\r{line}", end=end, file=sys.stderr, flush=True)


async def converse(
    backend: Backend,
    conversation: Conversation,
    timeout_s: float,
    done: Callable[[RequestRecord], None],
) -> None:
    """The turns in order: each prompt is the previous prompt, its reply, the new text."""
    history: list[int] = []
    for turn in conversation.turns:
        prompt = history + turn.user
        record, reply = await backend.send(
            prompt, turn.output_len, conversation.session_id, timeout_s
        )
        done(record)
        history = prompt + reply


async def run(
    backend: Backend,
    conversations: list[Conversation],
    offsets: list[float],
    concurrency: int | None,
    timeout_s: float,
    label: str,
) -> list[RequestRecord]:
    """Start each conversation at its offset (at most `concurrency` at once); the records."""
    records: list[RequestRecord] = []
    progress = Progress(label, sum(len(c.turns) for c in conversations))
    slots = asyncio.Semaphore(concurrency or max(1, len(conversations)))
    start = time.perf_counter()

    def done(record: RequestRecord) -> None:
        records.append(record)
        progress.add(record)

    async def one(conversation: Conversation, offset: float) -> None:
        await asyncio.sleep(start + offset - time.perf_counter())
        async with slots:
            await converse(backend, conversation, timeout_s, done)

    await asyncio.gather(*(one(c, o) for c, o in zip(conversations, offsets, strict=True)))
    return records


async def sweep(
    args: argparse.Namespace, spec: WorkloadSpec
) -> tuple[dict[str, Any], list[list[RequestRecord]]]:
    """Warm up, then one run per rate: the server's info and each run's records."""
    runs = []
    async with connect(args.backend, args.target, args.endpoint, tokenizer(args, spec)) as backend:
        server = await backend.info()
        warm = run_conversations(args, spec, args.warmup, 0)
        records = await run(backend, warm, [0.0] * len(warm), 1, args.timeout_s, "warm-up")
        failed = sorted({r.status for r in records if not r.ok})
        if failed:
            raise WarmupFailed(f"warm-up failed: {', '.join(failed)}")
        for i, rate in enumerate(args.rates, start=1):
            conversations = run_conversations(args, spec, args.num_requests, i)
            offsets = send_offsets(len(conversations), rate, args.seed, args.burstiness)
            label = f"rate {rate:g}/s"
            runs.append(
                await run(backend, conversations, offsets, args.concurrency, args.timeout_s, label)
            )
    return server, runs


def run_conversations(
    args: argparse.Namespace, spec: WorkloadSpec, n: int, run: int
) -> list[Conversation]:
    """Run `run`'s conversations (0: the warm-up; rates count from 1)."""
    return make_conversations(spec, n, args.seed, run, args.vocab_size)


def ideal_cached(args: argparse.Namespace, spec: WorkloadSpec) -> list[int] | None:
    """Per rate, the prompt tokens a prefix cache could serve at best; None unless the
    workload shares system prompts."""
    if spec.prefix is None:
        return None
    runs = range(1, len(args.rates) + 1)
    return [
        ideal_cached_tokens(run_conversations(args, spec, args.num_requests, i), args.page_size)
        for i in runs
    ]


def tokenizer(args: argparse.Namespace, spec: WorkloadSpec) -> Tokenizer | None:
    """The bundled model's, when the openai backend needs one (see serve_backend.py)."""
    if args.backend == "openai" and (args.endpoint == "chat" or spec.multi_turn):
        return Tokenizer.load(bundled_model_path())
    return None


@dataclass(frozen=True)
class Goodput:
    """Over the sweep's finite rates; None when no rate meets the goal."""

    goodput_rps: float | None  # interpolated_goodput: the figure reported as goodput
    highest_swept_rps: float | None
    attainment_goal: float = GOODPUT_ATTAINMENT


def goodput(rates: list[float], summaries: list[RunSummary]) -> Goodput:
    attainment = {
        rate: s.slo_attainment for rate, s in zip(rates, summaries, strict=True) if rate < math.inf
    }
    return Goodput(interpolated_goodput(attainment), highest_rate_meeting(attainment))


def _rate(rate: float) -> float | str:
    """JSON has no infinity."""
    return rate if math.isfinite(rate) else "inf"


def _ms(s: Stats | None, field: str) -> str:
    return "-" if s is None else f"{1e3 * getattr(s, field):.0f}"


def report(
    args: argparse.Namespace,
    spec: WorkloadSpec,
    summaries: list[RunSummary],
    good: Goodput,
    ideals: list[int] | None = None,
) -> str:
    lines = [
        f"workload {spec.name}, {args.num_requests} conversations per rate, burstiness "
        f"{args.burstiness:g}, concurrency {args.concurrency or 'unlimited'}; "
        f"SLO: TTFT <= {args.slo_ttft:g} s, TPOT <= {args.slo_tpot:g} s",
        f"{'rate/s':>7} {'done':>5} {'fail':>5} {'req/s':>6} {'tok/s':>7} "
        f"{'TTFT p50':>9} {'p99':>6} {'TPOT p50':>9} {'p99':>6} {'ITL p99':>8} "
        f"{'E2E p50':>8} {'SLO met':>8}   (latencies in ms)",
    ]
    for rate, s in zip(args.rates, summaries, strict=True):
        failures = f"  failures: {s.failures}" if s.failures else ""
        lines.append(
            f"{rate:>7g} {s.completed:>5} {s.requests - s.completed:>5} "
            f"{s.request_throughput:>6.2f} {s.output_throughput:>7.1f} "
            f"{_ms(s.ttft_s, 'p50'):>9} {_ms(s.ttft_s, 'p99'):>6} {_ms(s.tpot_s, 'p50'):>9} "
            f"{_ms(s.tpot_s, 'p99'):>6} {_ms(s.itl_s, 'p99'):>8} {_ms(s.e2e_s, 'p50'):>8} "
            f"{s.slo_attainment:>8.0%}{failures}"
        )
    goal = f"{good.attainment_goal:.0%}"
    if good.goodput_rps is None:
        lines.append(f"goodput: at no swept finite rate do {goal} of requests meet both SLOs")
    else:
        lines.append(
            f"goodput: {good.goodput_rps:.3g} req/s ({goal} of requests meet both SLOs; "
            f"interpolated), highest swept rate meeting it: {good.highest_swept_rps:g}/s"
        )
    for rate, s, ideal in zip(args.rates, summaries, ideals or [], strict=False):
        share = f"{s.cached_prompt_tokens / ideal:.0%}" if ideal else "-"
        lines.append(
            f"rate {rate:g}/s: prefix cache served {s.cached_prompt_tokens:,} prompt tokens of "
            f"the ideal {ideal:,} ({share})"
        )
    return "\n".join(lines)


def _arg(kind: Callable[[str], T], ok: Callable[[T], bool], must: str) -> Callable[[str], T]:
    def parse(text: str) -> T:
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text}")
        return value

    return parse


def _rates(text: str) -> list[float]:
    rate = _arg(float, lambda v: v > 0, "> 0 (or inf)")
    return [rate(r) for r in text.split(",")]


def parse_args(argv: list[str]) -> argparse.Namespace:
    positive, count = _arg(float, lambda v: v > 0, "> 0"), _arg(int, lambda v: v >= 1, ">= 1")
    p = argparse.ArgumentParser(prog="splitserve bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="grpc: HOST:PORT; openai: its base URL")
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="openai: the API to call")  # fmt: skip
    p.add_argument("--workload", default="chat",
                   help="chat, long-prompt, multi-turn, shared-prefix or a .yaml")  # fmt: skip
    p.add_argument("--rates", type=_rates, default=[1.0], help="comma-separated req/s, or inf")
    p.add_argument("--burstiness", type=positive, default=1.0, help="gamma shape; 1: Poisson")
    p.add_argument("--concurrency", type=count, default=None, help="most conversations at once")
    p.add_argument("--num-requests", type=count, default=100, help="conversations per rate")
    p.add_argument("--warmup", type=_arg(int, lambda v: v >= 0, ">= 0"), default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=positive, required=True, help="seconds")
    p.add_argument("--slo-tpot", type=positive, required=True, help="seconds")
    p.add_argument("--timeout-s", type=positive, default=300.0, help="per request")
    p.add_argument("--vocab-size", type=count, default=VOCAB_SIZE, help="for random prompts")
    p.add_argument("--page-size", type=count, default=16, help="the server's, for the ideal")
    p.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    spec = load_workload(args.workload)
    try:
        server, runs = asyncio.run(sweep(args, spec))
    except WarmupFailed as e:
        print(f"splitserve bench serve: {e}", file=sys.stderr)
        return 1
    slo = Slo(args.slo_ttft, args.slo_tpot)
    summaries = [summarize(records, slo) for records in runs]
    good = goodput(args.rates, summaries)
    ideals = ideal_cached(args, spec)
    print(report(args, spec, summaries, good, ideals))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "rates", "workload")}
    results = {
        "config": {**config, "rates": [_rate(r) for r in args.rates], "workload": asdict(spec)},
        "server": server,
        "runs": [
            {"rate": _rate(rate), "summary": asdict(s), "records": [asdict(r) for r in records]}
            | ({"ideal_cached_prompt_tokens": ideals[i]} if ideals else {})
            for i, (rate, s, records) in enumerate(zip(args.rates, summaries, runs, strict=True))
        ],
        "goodput": asdict(good),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nresults: {args.out}")
    return 0
