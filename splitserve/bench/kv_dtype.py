"""`splitserve bench kv-dtype`: a step's time with each KV cache dtype (issue 43's target:
8-bit pages no slower than the model's dtype at decode, batch 64 x 2,048 tokens of
context; prefill within 5%).

Each KV dtype gets an engine (the bundled model, its dtype as `--dtype` says) whose cache
holds every page the batch reads, so a step reads distinct pages as a full server's does
(decode_cost.ScatteredStep: random pages, the whole forward through our kernels); the best
of a few steps is taken, and each dtype is shown against the first (auto).
"""

from __future__ import annotations

import argparse

import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine, pick_dtype
from cluster.engine.kernels.attention_cpu import CpuBackend
from cluster.engine.kernels.kv_cache import KVLayout, kv_dtype
from cluster.engine.model.checkpoint import read_spec
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.sched.page_pool import pages_for
from splitserve.bench.decode_cost import ScatteredStep
from splitserve.hardware import host_line


def step_times(
    kv: str, dtype: str, batch: int, context: int, prefill: int, repeats: int
) -> tuple[float, float]:
    """Seconds of a decode step of `batch` x `context` and of a `prefill`-token prompt."""
    model_dtype = getattr(torch, pick_dtype(dtype, torch.device("cpu")))
    layout = KVLayout.of(read_spec(bundled_model_path()), 16, kv_dtype(kv, model_dtype))
    pages = batch * pages_for(context, 16) + 16
    gib = pages * layout.bytes_per_page / 2**30
    engine = LLMEngine(EngineConfig(dtype=dtype, kv_cache_dtype=kv, kv_cache_gb=gib))
    backend = CpuBackend(engine.layout, engine.device)
    decode = ScatteredStep(engine, batch, context, 1).best_s(backend, repeats)
    fill = ScatteredStep(engine, 1, prefill, prefill).best_s(backend, repeats)
    engine.close()
    return decode, fill


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
    first: tuple[float, float] | None = None
    for kv in args.kv_dtypes.split(","):
        d, p = step_times(kv, args.dtype, args.batch, args.context, args.prefill, args.repeats)
        first = first or (d, p)
        print(f"| {kv} | {d * 1e3:.1f} | {d / first[0]:.2f}x | {p * 1e3:.0f} | "
              f"{p / first[1]:.2f}x |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
