"""The offline benchmark's results: one record, printed as tables and targets, saved as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from splitserve.bench.baselines import Run
from splitserve.bench.decode_cost import DecodeEfficiency, GatherCost
from splitserve.bench.kv_waste import KVWaste


@dataclass(frozen=True)
class Target:
    name: str
    value: float
    threshold: float
    at_least: bool  # value >= threshold meets it; otherwise value <= threshold does

    @property
    def met(self) -> bool:
        return self.value >= self.threshold if self.at_least else self.value <= self.threshold


PEER_TARGETS = {"llama.cpp, batched": 1.5, "vLLM (CPU), offline LLM.generate": 1.0}


@dataclass(frozen=True)
class Results:
    hf_one: Run
    hf_static: Run
    ours: Run
    peers: list[Run]  # llama.cpp's and vLLM's, those installed
    decode: DecodeEfficiency
    waste: list[KVWaste]  # paged first
    kv_budget_tokens: int
    gathers: list[GatherCost]

    @property
    def runs(self) -> list[Run]:
        return [self.hf_one, self.hf_static, self.ours, *self.peers]

    def speedup(self, run: Run) -> float:
        """Our output tokens/s over `run`'s."""
        return self.ours.tokens_per_s / run.tokens_per_s

    @property
    def targets(self) -> list[Target]:
        return [
            Target(
                "splitserve >= 10x transformers one at a time", self.speedup(self.hf_one), 10, True
            ),
            Target(
                "splitserve >= 2x transformers static batches",
                self.speedup(self.hf_static),
                2,
                True,
            ),
            Target("batch-1 decode >= 60% of the memory wall", self.decode.efficiency, 0.6, True),
            Target("paged KV waste <= 4%", self.waste[0].waste, 0.04, False),
            *(
                Target(f"splitserve >= {least}x {run.method}", self.speedup(run), least, True)
                for run in self.peers
                for method, least in PEER_TARGETS.items()
                if run.method == method
            ),
        ]


def print_report(res: Results) -> None:
    print(f"\n{'method':<34}{'requests':>9}{'out tok':>9}{'seconds':>9}{'tok/s':>9}{'ours x':>8}")
    for r in res.runs:
        print(
            f"{r.method:<34}{r.requests:>9}{r.output_tokens:>9}{r.seconds:>9.1f}"
            f"{r.tokens_per_s:>9.1f}{res.speedup(r):>8.2f}"
        )
    print("  ours x: splitserve's output tokens/s over that row's")
    for r in res.runs:
        if r.note:
            print(f"  {r.method}: {r.note}")
    if not any(r.method.startswith("llama.cpp") for r in res.peers):
        print("llama.cpp: not installed (pip install llama-cpp-python)")
    if not any(r.method.startswith("vLLM") for r in res.peers):
        print("vLLM: not installed (scripts/setup-vllm)")

    d = res.decode
    low, high = min(d.bandwidths), max(d.bandwidths)
    print(
        f"\nbatch-1 decode: read bandwidth {high / 1e9:.1f} GB/s (torch.sum over 1 GiB, best of "
        f"{len(d.bandwidths)} buffers; slowest {low / 1e9:.1f}); a step reads "
        f"{d.weight_bytes / 1e6:.0f} MB of weights + {d.kv_bytes / 1e6:.1f} MB of KV (context "
        f"{d.context_len:.0f}) -> memory wall {d.wall_s * 1e3:.1f} ms "
        f"({d.wall_at(low) * 1e3:.1f} ms at the slowest)"
    )
    print(
        f"  engine.step() median {d.median_s * 1e3:.1f} ms (best {min(d.step_times) * 1e3:.1f} "
        f"of {len(d.step_times)}) -> {d.efficiency:.0%} of the wall "
        f"({d.wall_at(low) / d.median_s:.0%} at the slowest bandwidth)"
    )
    print(
        f"  torch.sum over the engine's own weights alone takes {d.weights_sum_s * 1e3:.1f} ms "
        f"({d.weight_bytes / d.weights_sum_s / 1e9:.1f} GB/s): the step is "
        f"{d.median_s / d.weights_sum_s:.1f}x that"
    )

    budget = res.kv_budget_tokens
    print(f"\nKV reserved vs written, same requests; fits = sequences in {budget} tokens")
    for w in res.waste:
        print(f"  {w.layout:<46} waste {w.waste:6.1%}  fits {w.fits:>5}")

    print(
        "\na step's forward with its K and V pages gathered into a copy (index_select; "
        "decodes into one reused workspace), and read in place by paged_attention.c"
    )
    for g in res.gathers:
        in_place = "no kernel" if g.in_place_s is None else f"{g.in_place_s * 1e3:7.1f} ms"
        faster = "" if g.speedup is None else f" ({g.speedup:.2f}x)"
        what = (
            f"decode batch {g.batch:>3} x context {g.context_len:>5}"
            if g.new_tokens == 1
            else f"{g.new_tokens} prompt tokens after {g.context_len - g.new_tokens:>5}"
        )
        print(f"  {what}: gathered {g.gathered_s * 1e3:7.1f} ms, in place {in_place}{faster}")

    print("\ntargets:")
    for t in res.targets:
        print(f"  [{'met' if t.met else 'MISS'}] {t.name}: {t.value:.3g}")


def to_json(res: Results) -> dict[str, Any]:
    d = res.decode
    return {
        "runs": [
            {**asdict(r), "tokens_per_s": r.tokens_per_s, "ours_x": res.speedup(r)}
            for r in res.runs
        ],
        "decode_batch1": {
            "bandwidths_gb_s": [b / 1e9 for b in d.bandwidths],
            "weight_bytes": d.weight_bytes,
            "weights_sum_ms": d.weights_sum_s * 1e3,
            "kv_bytes": d.kv_bytes,
            "context_len": d.context_len,
            "wall_ms": d.wall_s * 1e3,
            "median_ms": d.median_s * 1e3,
            "best_ms": min(d.step_times) * 1e3,
            "efficiency": d.efficiency,
        },
        "kv_waste": [{**asdict(w), "waste": w.waste} for w in res.waste],
        "kv_budget_tokens": res.kv_budget_tokens,
        "gather": [{**asdict(g), "speedup": g.speedup} for g in res.gathers],
        "targets": [{**asdict(t), "met": t.met} for t in res.targets],
    }
