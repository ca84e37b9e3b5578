"""`splitserve bench kv-dtype`: a step's time with each KV cache dtype (issue 43's target:
8-bit pages no slower than the model's dtype at decode, batch 64 x 2,048 tokens of
context; prefill within 5%).

Each KV dtype gets an engine (the bundled model, its dtype as `--dtype` says) whose cache
holds every page the batch reads, so a step reads distinct pages as a full server's does
(decode_cost.ScatteredStep: random pages, the whole forward through our kernels). All are
built first, then timed round by round (each step once a round after a warm-up), the best
kept, and each dtype shown against the first (auto).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from cluster.config import EngineConfig
from cluster.engine.build import pick_dtype
from cluster.engine.engine import LLMEngine
from cluster.engine.kernels.attention_cpu import CpuBackend
from cluster.engine.kernels.kv_cache import KVLayout, kv_dtype
from cluster.engine.model.checkpoint import read_spec
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.sched.page_pool import pages_for
from splitserve.bench.decode_cost import ScatteredStep
from splitserve.hardware import host_line


@dataclass
class Rig:
    """One KV dtype's engine, its cache holding every page the batch reads, and its steps."""

    engine: LLMEngine
    backend: CpuBackend
    decode: ScatteredStep
    prefill: ScatteredStep


def rig(kv: str, dtype: str, batch: int, context: int, prefill: int) -> Rig:
    model_dtype = getattr(torch, pick_dtype(dtype, torch.device("cpu")))
    layout = KVLayout.of(read_spec(bundled_model_path()), 16, kv_dtype(kv, model_dtype))
    pages = batch * pages_for(context, 16) + 16
    gib = pages * layout.bytes_per_page / 2**30
    engine = LLMEngine(EngineConfig(dtype=dtype, kv_cache_dtype=kv, kv_cache_gb=gib))
    backend = CpuBackend(engine.layout, engine.device)
    decode = ScatteredStep(engine, batch, context, 1)
    return Rig(engine, backend, decode, ScatteredStep(engine, 1, prefill, prefill))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench kv-dtype", description=__doc__)
    parser.add_argument("--dtype", default="auto", help="the model's (engine.dtype)")
    parser.add_argument("--kv-dtypes", default="auto,int8,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=2048, help="a fresh prompt's tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(host_line())
    print(f"| KV dtype | decode B{args.batch} x {args.context} (ms) | vs first | "
          f"prefill {args.prefill} (ms) | vs first |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: |")
    rigs = {
        kv: rig(kv, args.dtype, args.batch, args.context, args.prefill)
        for kv in args.kv_dtypes.split(",")
    }
    best = {kv: [float("inf"), float("inf")] for kv in rigs}
    for _ in range(args.repeats):  # round by round, so drift in the host falls on all alike
        for kv, r in rigs.items():
            best[kv][0] = min(best[kv][0], r.decode.best_s(r.backend, 1))
            best[kv][1] = min(best[kv][1], r.prefill.best_s(r.backend, 1))
    first = next(iter(best.values()))
    for kv, (d, p) in best.items():
        print(f"| {kv} | {d * 1e3:.1f} | {d / first[0]:.2f}x | {p * 1e3:.0f} | "
              f"{p / first[1]:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
