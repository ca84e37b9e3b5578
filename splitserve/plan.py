"""`splitserve plan`: the tables it prints. `capacity`: splitserve/capacity.py has the
math; `cluster`: splitserve/sim.py simulates, this file sweeps and summarizes."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import ConfigError, PoolConfig, ServeConfig, load_serve_config
from cluster.engine.model.checkpoint import ModelSpec
from router.policy import PolicyConfig, PolicyName
from splitserve.arrivals import send_offsets
from splitserve.capacity import (
    decode_bound,
    kv_bytes_per_token,
    kv_capacity,
    kv_heads_per_rank,
    num_params,
    weight_bytes,
)
from splitserve.hardware import Hardware
from splitserve.serve_metrics import GOODPUT_ATTAINMENT, Slo
from splitserve.serve_workload import WorkloadSpec, load_workload, make_conversations
from splitserve.sim import Cluster, Pool, Result, Simulation, weighted_percentile
from splitserve.step_cost import Linear, Roofline, StepCost

WEIGHTS = (("bf16", 16.0), ("int8", 8.0), ("int4", 4.0))
KV_GB = (1, 10, 20, 40, 80)
SHORT_DTYPE = {"bfloat16": "bf16", "float32": "fp32"}


def report(
    name: str,
    spec: ModelSpec,
    hw: Hardware,
    kv_dtype: str,
    page_size: int,
    kv_cache_gb: float,
    contexts: list[int],
    batches: list[int],
    tp: int = 1,
    link_gb_s: float = 0.0,  # with tp > 1: each device's link to the others, each way
) -> str:
    cap = kv_capacity(spec, kv_dtype, page_size, kv_cache_gb, tp)
    rank = " per device" if tp > 1 else ""
    lines = [
        f"{name}: {num_params(spec) / 1e9:.3g}B parameters; {spec.num_layers} layers, "
        f"{spec.num_kv_heads} KV heads of {spec.head_dim}",
        f"hardware {hw.name}: {hw.memory_gb:.0f} GB, {hw.bandwidth_gb_s:.0f} GB/s, "
        f"{hw.tflops:.3g} {SHORT_DTYPE[hw.compute_dtype]} TFLOP/s "
        f"(ridge {hw.ridge_flop_per_byte:.0f} FLOP/byte)",
    ]
    if tp > 1:
        lines.append(
            f"tensor parallel over {tp} devices: each holds 1/{tp} of the weights and "
            f"{kv_heads_per_rank(spec, tp)} of the {spec.num_kv_heads} KV heads; two "
            f"all-reduces a layer over {link_gb_s:g} GB/s links"
        )
    fit = lambda bits: weight_bytes(spec, bits, tp) + kv_cache_gb * 2**30 <= hw.memory_gb * 1e9
    lines += [
        "",
        f"weights{rank}: "
        + ", ".join(f"{w} {weight_bytes(spec, bits, tp) / 1e9:.3g} GB" for w, bits in WEIGHTS),
        f"with {kv_cache_gb:g} GiB of KV{rank}, the device's {hw.memory_gb:.0f} GB hold: "
        + ", ".join(f"{w} {'yes' if fit(bits) else 'no'}" for w, bits in WEIGHTS),
        f"KV cache ({kv_dtype}){rank}: {cap.bytes_per_token / 1024:.1f} KiB per token, "
        f"{cap.bytes_per_page / 2**20:.2f} MiB per page of {page_size}; {kv_cache_gb:g} GiB "
        f"holds {cap.pages} pages = {cap.tokens} tokens",
        "",
        f"sequences that fit at once, by KV cache size (GiB{rank}) and context (tokens):",
        f"{'KV GiB':>8} " + " ".join(f"{c:>9}" for c in contexts),
    ]
    for gb in sorted({*KV_GB, kv_cache_gb}):
        row = kv_capacity(spec, kv_dtype, page_size, gb, tp)
        lines.append(f"{gb:>8g} " + " ".join(f"{row.sequences(c):>9}" for c in contexts))
    context = contexts[len(contexts) // 2]
    lines += [
        "",
        f"decode floor (the memory wall) at context {context}: step time, tokens/s per user "
        "and in total, and what bounds it" + (", all-reduces included" if tp > 1 else ""),
        f"{'weights':>8} {'batch':>6} {'step ms':>9} {'tok/s/user':>11} {'tok/s':>10} {'bound':>8}"
        + (f" {'all-reduce ms':>14}" if tp > 1 else ""),
    ]
    for w, bits in WEIGHTS:
        for b in batches:
            d = decode_bound(spec, hw, bits, kv_dtype, b, context, tp, link_gb_s)
            lines.append(
                f"{w:>8} {b:>6} {d.step_s * 1e3:>9.2f} {d.tokens_per_s_per_user:>11.1f} "
                f"{d.tokens_per_s:>10.0f} {d.bound:>8}"
                + (f" {d.allreduce_s * 1e3:>14.2f}" if tp > 1 else "")
            )
    return "\n".join(lines)


# --- plan cluster -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One simulated cluster under one load."""

    prefill: int
    decode: int
    requests: int
    completed: int
    span_s: float
    ttft: tuple[float, float, float]  # p50, p90, p99 seconds
    tpot: tuple[float, float, float]
    itl: tuple[float, float, float]
    attainment: float  # of all requests, meeting both SLOs
    kv_use: tuple[tuple[float, float], ...]  # (time, mean decode KV use) at each tick
    transfer_gb: float
    devices: int  # the workers' devices: each worker's tensor parallel size, summed

    @property
    def kv_peak(self) -> float:
        """The highest mean decode KV use seen at a tick."""
        return max((kv for _, kv in self.kv_use), default=0.0)

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    @property
    def goodput(self) -> float:
        """Requests a second that met both SLOs."""
        return self.attainment * self.requests / self.span_s if self.span_s > 0 else 0.0


def outcome(prefill: int, decode: int, result: Result, slo: Slo, devices: int) -> Outcome:
    lat = result.latencies()
    ttft, tpot = lat["ttft"], lat["tpot"]
    done = [r for r in result.requests if not np.isnan(r.end)]
    met = sum(
        r.first_token - r.arrival <= slo.ttft_s
        and (r.output_len < 2 or (r.end - r.first_token) / (r.output_len - 1) <= slo.tpot_s)
        for r in done
    )
    span = max(r.end for r in done) - min(r.arrival for r in result.requests) if done else 0.0

    def pct(xs: np.ndarray) -> tuple[float, float, float]:
        if not len(xs):
            return (np.nan, np.nan, np.nan)
        p50, p90, p99 = np.percentile(xs, [50, 90, 99])
        return float(p50), float(p90), float(p99)

    itl = (
        tuple(weighted_percentile(result.itl, result.itl_weight, p) for p in (50, 90, 99))
        if len(result.itl)
        else (np.nan, np.nan, np.nan)
    )
    return Outcome(
        prefill,
        decode,
        len(result.requests),
        len(done),
        float(span),
        pct(ttft),
        pct(tpot),
        itl,  # type: ignore[arg-type]
        met / len(result.requests),
        tuple((t, kv) for t, _, _, kv in result.ticks),
        result.transfer_bytes / 1e9,
        devices,
    )


def simulate(
    cluster: Cluster,
    workload: WorkloadSpec,
    rate: float,
    requests: int,
    seed: int,
    burstiness: float = 1.0,
) -> Result:
    """One run of `requests` conversations of `workload` arriving at `rate` a second."""
    conversations = make_conversations(workload, requests, seed)
    arrivals = send_offsets(requests, rate, seed, burstiness)
    return Simulation(cluster, conversations, arrivals).run()


def sweep(
    make: Callable[[int, int], Cluster],
    workload: WorkloadSpec,
    rate: float,
    requests: int,
    seed: int,
    prefill: Sequence[int],
    decode: Sequence[int],
    slo: Slo,
    burstiness: float = 1.0,
    tp: tuple[int, int] = (1, 1),  # each prefill and each decode worker's devices
) -> list[Outcome]:
    return [
        outcome(
            p,
            d,
            simulate(make(p, d), workload, rate, requests, seed, burstiness),
            slo,
            p * tp[0] + d * tp[1],
        )
        for p in prefill
        for d in decode
    ]


def recommend(outcomes: Sequence[Outcome], goal: float = GOODPUT_ATTAINMENT) -> Outcome | None:
    """The fewest devices meeting the SLOs for `goal` of requests; then the most goodput."""
    meeting = [o for o in outcomes if o.attainment >= goal]
    return min(meeting, key=lambda o: (o.devices, -o.goodput)) if meeting else None


def cluster_report(outcomes: Sequence[Outcome], slo: Slo, header: str) -> str:
    ms = lambda xs: " / ".join(f"{x * 1e3:,.0f}" for x in xs)
    lines = [
        header,
        f"SLOs: TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s; goodput = requests/s "
        "meeting both",
        "",
        f"{'P':>3} {'D':>3} {'done':>7} {'TTFT p50/p90/p99 ms':>24} {'TPOT p50/p90/p99 ms':>22} "
        f"{'ITL p99':>8} {'SLO met':>8} {'goodput':>8} {'/device':>8} {'KV peak':>8} "
        f"{'KV moved GB':>11}",
    ]
    for o in outcomes:
        lines.append(
            f"{o.prefill:>3} {o.decode:>3} {o.completed:>7} {ms(o.ttft):>24} {ms(o.tpot):>22} "
            f"{o.itl[2] * 1e3:>8.0f} {o.attainment:>8.0%} {o.goodput:>8.2f} "
            f"{o.goodput / o.devices:>8.3f} {o.kv_peak:>8.0%} {o.transfer_gb:>11.2f}"
        )
    best = recommend(outcomes)
    lines.append("")
    if best is None:
        lines.append("no swept cluster meets the SLOs for 90% of requests: add workers")
    else:
        lines.append(
            f"recommended: {best.prefill} prefill + {best.decode} decode workers "
            f"({best.workers} in all, P:D = {best.prefill}:{best.decode}; {best.devices} "
            f"devices), the fewest that meet the SLOs for {best.attainment:.0%} of requests"
        )
    return "\n".join(lines)


def counts(text: str) -> list[int]:
    """Worker counts from "2", "1-4" or "1,2,4"."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            return list(range(lo, hi + 1))
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"worker counts: 2, 1-4 or 1,2,4, got {text!r}") from None


def plan_cluster(args: argparse.Namespace, spec: ModelSpec, hw: Hardware) -> str:
    """`splitserve plan cluster`: sweep the worker counts, print the table, maybe plot."""
    serve = load_serve_config(args.config) if args.config else ServeConfig()
    # quantization none: float32 weights beside float32 KV, else bfloat16
    none = 32.0 if args.kv_dtype == "float32" else 16.0
    bits = {"none": none, "int8": 8.0, "int4": 4.0, "gguf": 4.5}
    tps = (args.prefill_tp, args.decode_tp)
    if min(tps) < 1 or (args.calibration and tps != (1, 1)):
        raise ConfigError(
            f"prefill_tp, decode_tp: at least 1, and 1 with --calibration (this engine's "
            f"measured steps are on one device), got {tps}"
        )

    calibrated = Linear.load(Path(args.calibration)) if args.calibration else None

    def cost(tp: int) -> StepCost:
        if calibrated is not None:
            return calibrated
        weight_bits = bits[args.quantization]
        return Roofline(
            spec, hw, weight_bits, args.kv_dtype, args.efficiency, tp, args.tp_link_gb_s
        )

    def pool(phase: str, config: PoolConfig, replicas: int, tp: int) -> Pool:
        engine = replace(config.engine, page_size=args.page_size)
        if not args.config:
            engine = replace(engine, kv_cache_gb=args.kv_cache_gb)
        if engine.kv_cache_gb is None:
            raise ConfigError(
                "engine.kv_cache_gb: plan cluster sizes each worker's KV cache from it; "
                "gpu_memory_utilization depends on the device at start"
            )
        gb = engine.kv_cache_gb  # on each of the worker's devices
        weights = weight_bytes(spec, bits[args.quantization], tp)
        if weights + gb * 2**30 > hw.memory_gb * 1e9:
            raise ConfigError(
                f"{phase}: weights {weights / 1e9:.3g} GB + KV {gb:g} GiB per "
                f"device exceed {hw.name}'s {hw.memory_gb:g} GB at tensor parallel {tp}; "
                f"split the model over more devices (--prefill-tp / --decode-tp) or shrink "
                f"the KV cache"
            )
        pages = kv_capacity(spec, args.kv_dtype, engine.page_size, gb, tp).pages
        return Pool(replicas, engine, pages, cost(tp), config.autoscale)

    policy = PolicyConfig(
        PolicyName(serve.router.policy),
        serve.transfer.local_prefill_tokens,
        serve.router.affinity_slack_tokens,
        serve.router.seq_cost_tokens,
        serve.router.prefill_by_cost,
    )

    def make(p: int, d: int) -> Cluster:
        return Cluster(
            pool("prefill", serve.prefill, p, tps[0]),
            pool("decode", serve.decode, d, tps[1]),
            policy,
            kv_bytes_per_token(spec, args.kv_dtype, page_size=args.page_size),
            args.link_gb_s,
        )

    slo = Slo(args.slo_ttft, args.slo_tpot)
    workload = load_workload(args.workload)
    outcomes = sweep(
        make, workload, args.rate, args.requests, args.seed,
        counts(args.prefill), counts(args.decode), slo, args.burstiness, tps,
    )  # fmt: skip
    model = f"{args.model} ({num_params(spec) / 1e9:.3g}B, {args.quantization}, KV {args.kv_dtype})"
    where = f"step costs {calibrated.source}" if calibrated is not None else (
        f"roofline of {hw.name} at {args.efficiency:.0%}"
    )  # fmt: skip
    if tps != (1, 1):
        where += f", tensor parallel {tps[0]} per prefill and {tps[1]} per decode worker"
    header = (
        f"{model} on {where}; workload {workload.name} at {args.rate:g}/s, "
        f"{args.requests} requests, seed {args.seed}"
    )
    if args.plot:
        plot_cluster(outcomes, Path(args.plot), header)
    return cluster_report(outcomes, slo, header)


def plot_cluster(outcomes: Sequence[Outcome], path: Path, title: str) -> None:
    """Goodput per worker against the P:D ratio, one line per cluster size; and beside it
    (PATH-kv.png) each cluster's decode KV use over time."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for o in outcomes:
        ax.plot(*zip(*o.kv_use, strict=True), label=f"{o.prefill}P {o.decode}D", linewidth=0.8)
    ax.set_ylim(0, 1)
    _save(fig, ax, "simulated time (s)", "mean decode KV use", title,
          path.with_name(f"{path.stem}-kv{path.suffix}"))  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 4))
    for size in sorted({o.workers for o in outcomes}):
        pts = sorted((o.prefill / o.decode, o.goodput / o.workers) for o in outcomes
                     if o.workers == size and o.decode)  # fmt: skip
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"{size} workers")
    _save(fig, ax, "prefill : decode workers", "goodput per worker (req/s meeting SLOs)", title,
          path)  # fmt: skip


def plot_capacity(spec: ModelSpec, kv_dtype: str, page_size: int, contexts: Sequence[int],
                  path: Path, title: str) -> None:  # fmt: skip
    """Sequences that fit against KV cache GiB, one line per context length."""
    plt = pyplot()
    gbs = np.linspace(1, 80, 80)
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in contexts:
        seqs = [kv_capacity(spec, kv_dtype, page_size, float(gb)).sequences(c) for gb in gbs]
        ax.plot(gbs, seqs, label=f"context {c}")
    _save(fig, ax, "KV cache (GiB)", "sequences that fit at once", title, path)


def _save(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, path: Path) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plot: needs matplotlib (pip install matplotlib)") from None
    return plt
