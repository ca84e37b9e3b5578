"""`python -m splitserve.bench.plan_check`: does `splitserve plan cluster` predict this machine?

For each `bench compare` result present (`--results`/compare-<workload>.json) and each of
its served configurations `disaggregated` (1 prefill + 1 decode worker, one core each) and
`colocated` (one decode worker on both cores, prefill unchunked), it simulates the same
requests (the same lengths and arrival times: splitserve/bench/serve.py's seeds) on a cluster built
from the same serve config, with step costs fitted to this machine's engine by
`splitserve plan calibrate` at 1 and 2 threads, and prints predicted against measured TTFT
and TPOT p50 per rate. Writes docs/plan.md's validation table when asked (--write).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cluster.config import EngineConfig, serve_config_from_dict
from cluster.engine.build import pick_dtype
from cluster.engine.model.checkpoint import read_spec
from cluster.engine.model.model_files import bundled_model_path
from router.policy import PolicyConfig, PolicyName
from splitserve.arrivals import send_offsets
from splitserve.bench import RESULTS
from splitserve.bench.compare import CONFIGS
from splitserve.calibrate import calibrate
from splitserve.capacity import kv_bytes_per_token, kv_capacity
from splitserve.plan import pyplot
from splitserve.serve_workload import load_workload, make_conversations
from splitserve.sim import Cluster, Pool, Simulation
from splitserve.step_cost import Linear

CHECKED = ("disaggregated", "colocated")
LINK_GB_S = 10.0  # NIXL WRITE of a prompt's KV on loopback (docs/benchmarks.md, bench transfer)
ROUTER_S = 0.002  # the router's added latency over gRPC (docs/benchmarks.md, bench router)
TOLERANCE = 0.2
PROBE_ROW_S = 0.001


def kv_name(engine: EngineConfig) -> str:
    """The KV dtype this CPU's engine stores (kv_cache_dtype auto: its model's dtype)."""
    if engine.kv_cache_dtype != "auto":
        return engine.kv_cache_dtype
    return pick_dtype(engine.dtype, torch.device("cpu"))


def cluster(config: str, costs: dict[int, Linear], overhead: tuple[float, float]) -> Cluster:
    """The serve config's cluster; `overhead` is (per decode row, per request) seconds."""
    row_s, request_s = overhead
    serve = serve_config_from_dict(CONFIGS[config])
    spec = read_spec(bundled_model_path())

    def pool(p: Any) -> Pool:
        e = p.engine
        pages = kv_capacity(spec, kv_name(e), e.page_size, e.kv_cache_gb).pages
        # threads None: torch's default, both cores here
        cost = costs[e.threads or 2]
        cost = dataclasses.replace(cost, per_row_s=cost.per_row_s + row_s)
        return Pool(p.replicas, e, pages, cost, p.autoscale)

    return Cluster(
        pool(serve.prefill),
        pool(serve.decode),
        PolicyConfig(
            PolicyName(serve.router.policy),
            serve.transfer.local_prefill_tokens,
            serve.router.affinity_slack_tokens,
            serve.router.seq_cost_tokens,
        ),
        kv_bytes_per_token(spec, kv_name(serve.decode.engine)),
        LINK_GB_S,
        router_s=ROUTER_S + request_s,
    )


def predict(
    result: dict[str, Any],
    config: str,
    costs: dict[int, Linear],
    overhead: tuple[float, float] = (0.0, 0.0),
) -> list[dict[str, float]]:
    plan, workload = result["plan"], load_workload(result["workload"])
    seed = result.get("seed", 0)
    rows = []
    for i, rate in enumerate(plan["rates"], start=1):
        conversations = make_conversations(workload, plan["num_requests"], seed, i)
        arrivals = send_offsets(len(conversations), rate, seed)
        sim = Simulation(cluster(config, costs, overhead), conversations, arrivals)
        lat = sim.run().latencies()
        measured = next(
            r["summary"] for r in result["configs"][config]["runs"] if r["rate"] == rate
        )
        rows.append(
            {
                "rate": rate,
                "ttft": float(np.percentile(lat["ttft"], 50)),
                "tpot": float(np.percentile(lat["tpot"], 50)),
                "ttft_measured": measured["ttft_s"]["p50"],
                "tpot_measured": measured["tpot_s"]["p50"],
            }
        )
    return rows


def table(results: dict[str, dict[str, list[dict[str, float]]]]) -> str:
    lines = [
        "| workload | configuration | rate/s | TTFT p50 predicted / measured (ms) | error "
        "| TPOT p50 predicted / measured (ms) | error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for workload, configs in results.items():
        for config, rows in configs.items():
            for r in rows:
                e1 = r["ttft"] / r["ttft_measured"] - 1
                e2 = r["tpot"] / r["tpot_measured"] - 1
                lines.append(
                    f"| {workload} | {config} | {r['rate']:g} | {r['ttft'] * 1e3:,.0f} / "
                    f"{r['ttft_measured'] * 1e3:,.0f} | {e1:+.0%} | {r['tpot'] * 1e3:,.1f} / "
                    f"{r['tpot_measured'] * 1e3:,.1f} | {e2:+.0%} |"
                )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, list[dict[str, float]]]], path: Path) -> None:
    """Predicted against measured p50s, TTFT and TPOT side by side; the band is +-20%."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        top = 0.0
        for label, configs in results.items():
            for config, rows in configs.items():
                x = [r[f"{metric}_measured"] * 1e3 for r in rows]
                y = [r[metric] * 1e3 for r in rows]
                top = max(top, *x, *y)
                marker = "o" if "overhead" in label else "x"
                ax.scatter(x, y, marker=marker, label=f"{label}: {config}")
        line = np.array([0, top * 1.1])
        ax.plot(line, line, color="black", linewidth=0.8)
        ax.fill_between(line, line * (1 - TOLERANCE), line * (1 + TOLERANCE), alpha=0.1)
        ax.set_xlabel(f"{metric.upper()} p50 measured (ms)")
        ax.set_ylabel(f"{metric.upper()} p50 predicted (ms)")
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitserve.bench.plan_check", description=__doc__)
    p.add_argument("--calibration", nargs=2, metavar=("ONE_THREAD", "TWO_THREADS"),
                   help="plan calibrate outputs to use instead of calibrating now")  # fmt: skip
    p.add_argument("--out", default=None, help="write the table (markdown) here")
    p.add_argument("--plot", default=None, help="write the predicted-vs-measured PNG here")
    p.add_argument("--results", type=Path, default=RESULTS, help="bench compare's JSON directory")
    args = p.parse_args(argv)
    if args.calibration:
        costs = {t: Linear.load(Path(f)) for t, f in zip((1, 2), args.calibration, strict=True)}
    else:
        engine = EngineConfig()  # the auto modes, as served
        costs = {t: calibrate(dataclasses.replace(engine, threads=t), 900)[0] for t in (1, 2)}
    found = {p.stem.removeprefix("compare-"): p for p in args.results.glob("compare-*.json")}
    if "chat" not in found:
        raise SystemExit(f"no chat result in {args.results}: run `splitserve bench compare`")
    loaded = {w: json.loads(found[w].read_text()) for w in ("chat", "long-prompt") if w in found}
    # The serving overheads (each token streamed through Ray, the router and gRPC to the
    # load generator, all sharing the two cores; each request's calls between them) are
    # fitted once per configuration at chat's lowest rate: per decode row, so that the
    # TPOT p50 matches (secant steps), then per request, the TTFT p50 left over. Every
    # other figure is a prediction.
    overhead = {}
    for c in CHECKED:
        tpot = lambda row_s: predict(loaded["chat"], c, costs, (row_s, 0.0))[0]["tpot"]  # noqa: B023
        target = predict(loaded["chat"], c, costs)[0]["tpot_measured"]
        (x0, y0), x1 = (0.0, tpot(0.0)), PROBE_ROW_S
        for _ in range(4):
            y1 = tpot(x1)
            (x0, y0), x1 = (x1, y1), x1 + (target - y1) * (x1 - x0) / (y1 - y0)
        at_fit = predict(loaded["chat"], c, costs, (x1, 0.0))[0]
        overhead[c] = (x1, at_fit["ttft_measured"] - at_fit["ttft"])
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for label, fitted in (("engine only", False), ("with serving overhead", True)):
        for workload, result in loaded.items():
            results[f"{workload}, {label}"] = {
                c: predict(result, c, costs, overhead[c] if fitted else (0.0, 0.0))
                for c in CHECKED
                if c in result["configs"]
            }
    out = table(results)
    for t, cost in costs.items():
        out += f"\n\nstep cost, {t} thread(s): {cost}"
    for c, (row_s, request_s) in overhead.items():
        out += (
            f"\n\nserving overhead, {c}: {row_s * 1e3:.2f} ms a decode row, "
            f"{request_s * 1e3:.1f} ms a request"
        )
    print(out)
    if args.plot:
        plot(results, Path(args.plot))
    if args.out:
        Path(args.out).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
