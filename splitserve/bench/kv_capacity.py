"""`splitserve bench kv-capacity`: does KV memory bound how many sequences a worker batches?
Answered by measurement on the bundled model's engine, beside `splitserve plan capacity`'s
prediction for the same memory (issue 43's capacity question).

For each KV cache size (`--kv-gb`) and KV dtype (`--kv-dtypes`; auto is the model's), an
engine of that cache serves a chat load at each rate of `--rates`: `--requests` requests
arriving as a Poisson process (arrivals.send_offsets), each a prompt of random tokens
(no shared prefix, so the prefix cache holds nothing for another request) and a reply
(ignore_eos), greedy, their lengths uniform over `--prompt` and `--reply`. The default
is a KV-bound chat: short prompts (64-192 tokens, cheap to prefill) and long replies
(128-384), so sequences hold their pages for many steps while a decode step's time
hardly grows with the batch (it reads the weights once) and the cache, not the compute,
bounds how many run. A request's times are the
engine's, taken as its steps return (no router, no transport): TTFT from its arrival to
the step that samples its first token, TPOT the mean gap after it. Per run: the peak
number of sequences the scheduler ran at once, and their mean over the steps taken while
requests waited (the cache full, if KV binds), preemptions, TTFT and TPOT percentiles,
and the share of requests meeting both SLOs; per cache size and dtype, goodput: the
highest rate at which 90% do (DistServe's, interpolated between swept rates).

The prediction is plan capacity's own arithmetic (splitserve/capacity.py over the
engine's KVLayout): the sequences of the load's mean final length (prompt + reply) the
cache holds, as a user would ask it; and at the mean length a sequence holds over its life
(prompt + half its reply), which is what a full cache holds in steady state. `--plot`
draws KV GiB against the measured peak and goodput, one line per dtype, the prediction
dashed; `splitserve lab --kv-capacity FILE` shows the points.
The multi-turn half (a working set 10x the pool, with and without the KV tier) is
`splitserve bench kv-tier`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import RequestId, SamplingParams
from splitserve.arrivals import send_offsets
from splitserve.bench import RESULTS
from splitserve.capacity import kv_capacity
from splitserve.hardware import host_line
from splitserve.plan import pyplot
from splitserve.serve_metrics import RequestRecord, Slo, interpolated_goodput, summarize


def chat_load(
    n: int, vocab: int, seed: int, prompt: tuple[int, int], reply: tuple[int, int]
) -> list[tuple[list[int], int]]:
    """n (prompt, reply length) pairs, each length uniform in its [low, high]."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*reply))
        for _ in range(n)
    ]


def serve_load(
    engine: LLMEngine, load: list[tuple[list[int], int]], offsets: list[float]
) -> tuple[list[RequestRecord], int, float]:
    """Each request added at its arrival, the engine stepped until all end: every request's
    record (times on one clock), the most sequences running at once, and their mean over
    the steps taken while requests waited (0 if none did)."""
    start = time.perf_counter()
    arrivals = deque(zip(offsets, load, strict=True))
    sent: dict[RequestId, tuple[float, int]] = {}
    messages: dict[RequestId, list[tuple[float, int]]] = {}
    records: list[RequestRecord] = []
    peak, full = 0, []
    while arrivals or engine.has_unfinished():
        now = time.perf_counter() - start
        while arrivals and arrivals[0][0] <= now:
            offset, (prompt, reply) = arrivals.popleft()
            sampling = SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True)
            rid = engine.add_request(prompt, sampling)
            sent[rid], messages[rid] = (start + offset, len(prompt)), []
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[0][0] - now))
            continue
        outputs = engine.step()
        at = time.perf_counter()
        running = len(engine.scheduler.running)
        peak = max(peak, running)
        if engine.scheduler.waiting:
            full.append(running)
        for out in outputs:
            if out.new_token_ids:
                messages[out.request_id].append((at, len(out.new_token_ids)))
            if out.finish_reason is not None:
                send_s, prompt_tokens = sent.pop(out.request_id)
                got = tuple(messages.pop(out.request_id))
                records.append(RequestRecord(send_s, at, got, prompt_tokens))
    return records, peak, statistics.mean(full) if full else 0.0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    slo = Slo(args.slo_ttft, args.slo_tpot)
    rows: list[dict[str, Any]] = []
    for gb in args.kv_gb:
        for kv in args.kv_dtypes:
            config = EngineConfig(dtype=args.dtype, kv_cache_dtype=kv, kv_cache_gb=gb)
            engine = LLMEngine(config)
            vocab = engine.spec.vocab_size
            load = chat_load(args.requests, vocab, args.seed, args.prompt, args.reply)
            prompt = statistics.mean(len(p) for p, _ in load)
            reply = statistics.mean(r for _, r in load)
            cap = kv_capacity(engine.spec, engine.layout.kv_name, 16, gb)
            assert cap.pages == engine.pool.num_pages, "plan and engine size the pool alike"
            engine.generate([load[0][0][:32]], SamplingParams(max_tokens=2))  # warm
            runs = []
            for rate in args.rates:
                before = engine.counts.preemptions
                offsets = send_offsets(args.requests, rate, args.seed)
                records, peak, held = serve_load(engine, load, offsets)
                s = summarize(records, slo)
                assert s.ttft_s is not None and s.tpot_s is not None
                runs.append({
                    "rate": rate, "peak_seqs": peak, "held_seqs": held,
                    "preemptions": engine.counts.preemptions - before,
                    "attainment": s.slo_attainment, "tok_s": s.output_throughput,
                    "ttft_p50": s.ttft_s.p50, "ttft_p99": s.ttft_s.p99,
                    "tpot_p50": s.tpot_s.p50, "tpot_p99": s.tpot_s.p99,
                })  # fmt: skip
                print(f"  {gb:g} GiB {kv}: rate {rate:g}/s peak {peak} seqs, "
                      f"{runs[-1]['preemptions']} preemptions, "
                      f"attainment {s.slo_attainment:.0%}", flush=True)  # fmt: skip
            engine.close()
            goodput = interpolated_goodput({r["rate"]: r["attainment"] for r in runs})
            rows.append({
                "kv_gb": gb, "kv_dtype": engine.layout.kv_name, "pages": cap.pages,
                "predicted_seqs": cap.sequences(round(prompt + reply)),
                "predicted_held": cap.sequences(round(prompt + reply / 2)),
                "peak_seqs": max(r["peak_seqs"] for r in runs),
                "held_seqs": max(r["held_seqs"] for r in runs),
                "goodput": goodput or 0.0, "runs": runs,
            })  # fmt: skip
    return {
        "host": host_line(), "requests": args.requests, "slo_ttft_s": args.slo_ttft,
        "slo_tpot_s": args.slo_tpot, "rows": rows,
    }  # fmt: skip


def report(result: dict[str, Any]) -> list[str]:
    """The table (markdown) and the targets' lines."""
    lines = [
        result["host"],
        f"{result['requests']} requests a rate; SLO TTFT {result['slo_ttft_s']:g} s, "
        f"TPOT {result['slo_tpot_s'] * 1e3:g} ms",
        "| KV GiB | KV dtype | pages | predicted seqs: final length / held | peak seqs | "
        "mean seqs while full | preemptions | goodput (req/s) | TTFT p50 / p99 (s) at it | "
        "TPOT p50 / p99 (ms) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        met = [r for r in row["runs"] if r["rate"] <= max(row["goodput"], row["runs"][0]["rate"])]
        at = met[-1]
        lines.append(
            f"| {row['kv_gb']:g} | {row['kv_dtype']} | {row['pages']} | "
            f"{row['predicted_seqs']} / {row['predicted_held']} | {row['peak_seqs']} | "
            f"{row['held_seqs']:.1f} | "
            f"{sum(r['preemptions'] for r in row['runs'])} | {row['goodput']:.2f} | "
            f"{at['ttft_p50']:.2f} / {at['ttft_p99']:.2f} | "
            f"{at['tpot_p50'] * 1e3:.0f} / {at['tpot_p99'] * 1e3:.0f} |"
        )
    by = {(r["kv_gb"], r["kv_dtype"]): r for r in result["rows"]}
    top = max(r["runs"][-1]["rate"] for r in result["rows"])
    for (gb, kv), row in by.items():
        base = next((by[gb, d] for d in ("bfloat16", "float32") if (gb, d) in by), None)
        if base is None or row is base or not base["goodput"]:
            continue
        ratio = row["goodput"] / base["goodput"]
        verdict = "met" if ratio >= 1.8 else "missed"
        if base["goodput"] >= top:  # the sweep ended before the model dtype's cache bound it
            verdict = f"not measured: both at the sweep's top rate, {top:g}/s"
        lines.append(f"target: {kv} goodput / {base['kv_dtype']} at {gb:g} GiB >= 1.8: "
                     f"{ratio:.2f}x ({verdict})")  # fmt: skip
    full = [r for r in result["rows"] if r["held_seqs"] > 0]  # the cache filled while some waited
    for measured, predicted, rows in (
        ("peak_seqs", "predicted_seqs", result["rows"]),
        ("held_seqs", "predicted_held", full),
    ):
        worst = max((abs(r[measured] / r[predicted] - 1) for r in rows), default=None)
        told = "no row" if worst is None else f"worst {worst:.1%}"
        verdict = "met" if worst is not None and worst <= 0.1 else "missed"
        lines.append(f"target: {measured} within 10% of plan capacity's {predicted} "
                     f"({len(rows)} rows): {told} ({verdict})")  # fmt: skip
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """KV GiB against sequences (measured solid, predicted dashed) and goodput."""
    plt = pyplot()
    fig, (seqs, goodput) = plt.subplots(1, 2, figsize=(10, 4))
    for kv in dict.fromkeys(r["kv_dtype"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["kv_dtype"] == kv]
        gbs = [r["kv_gb"] for r in rows]
        (line,) = seqs.plot(gbs, [r["peak_seqs"] for r in rows], "o-", label=f"{kv} peak")
        color = line.get_color()
        full = [r for r in rows if r["held_seqs"] > 0]
        seqs.plot([r["kv_gb"] for r in full], [r["held_seqs"] for r in full], "s-.",
                  color=color, label=f"{kv} mean while full")  # fmt: skip
        seqs.plot(gbs, [r["predicted_held"] for r in rows], "--", color=color,
                  label=f"{kv} plan capacity (held length)")  # fmt: skip
        goodput.plot(gbs, [r["goodput"] for r in rows], "o-", color=line.get_color(), label=kv)
    seqs.set(xlabel="KV cache (GiB)", ylabel="sequences running at once")
    goodput.set(xlabel="KV cache (GiB)", ylabel="goodput (requests/s, 90% within SLO)")
    for ax in (seqs, goodput):
        ax.set_xticks(sorted({r["kv_gb"] for r in result["rows"]}))
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("bench kv-capacity: the bundled model's engine, chat load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench kv-capacity", description=__doc__)
    floats = lambda text: [float(x) for x in text.split(",")]
    parser.add_argument("--kv-gb", type=floats, default=[0.02, 0.04])
    parser.add_argument("--kv-dtypes", type=lambda t: t.split(","), default=["auto", "int8"])
    parser.add_argument("--dtype", default="auto", help="the model's (engine.dtype)")
    parser.add_argument("--rates", type=floats, default=[0.25, 0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--requests", type=int, default=24, help="a rate's")
    span = lambda text: tuple(int(x) for x in text.split("-"))
    parser.add_argument("--prompt", type=span, default=(64, 192), help="tokens, low-high")
    parser.add_argument("--reply", type=span, default=(128, 384), help="tokens, low-high")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "kv-capacity.json")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG here")
    parser.add_argument(
        "--from", dest="source", type=Path, default=None, help="report (and plot) this result"
    )
    args = parser.parse_args(argv)
    if args.source is not None:
        result = json.loads(args.source.read_text())
    else:
        result = measure(args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print("\n".join(report(result)))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
