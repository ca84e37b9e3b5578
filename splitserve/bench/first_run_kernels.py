"""The first run's kernel steps (splitserve/bench/first_run.py): micro-benchmarks of each
kernel alone, and the kernels and the CUDA graphs checked on the device.

Caches are built as the engine builds them (KVLayout, KVCache) and attention runs through
its backends' `prepare` and `forward`, so these steps follow the cache layout wherever it
goes. Shapes are Llama-3-8B's (32 heads, 8 KV heads of 128, hidden 4096, MLP 14336); a dry
run takes tiny ones.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from cluster.engine.kernels.kv_cache import KVCache, KVLayout
from cluster.engine.kernels.step_batch import StepBatch
from splitserve.bench.first_run_figures import Figures, device_of, seconds_per_call, share

PAGE = 16


@dataclass(frozen=True)
class Heads:
    heads: int
    kv_heads: int
    head_dim: int


LLAMA = Heads(32, 8, 128)
TINY = Heads(4, 2, 16)


def rope_tables(
    dim: int, positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed-sin tables [positions, dim], as LlamaModel builds them (rotate-half)."""
    inv = 1.0 / 500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = angles.cos(), angles.sin()
    return (
        torch.cat([cos, cos], -1).to(device).contiguous(),
        torch.cat([-sin, sin], -1).to(device).contiguous(),
    )


def cache_of(h: Heads, pages: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    """One layer's cache of `pages` pages, filled with normal noise."""
    cache = KVCache(KVLayout(1, h.kv_heads, h.head_dim, PAGE, dtype), pages, device)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def batch_of(
    decode_lens: list[int], chunks: list[tuple[int, int]], table: torch.Tensor
) -> StepBatch:
    """Decodes of `decode_lens` tokens, then prefill chunks (new tokens, context with them),
    sequence i on row i of `table`."""
    nd = len(decode_lens)
    lens = decode_lens + [c for _, c in chunks]
    starts, positions = [0], []
    for i, n in enumerate(lens):
        new = 1 if i < nd else chunks[i - nd][0]
        positions.append(torch.arange(n - new, n))
        starts.append(starts[-1] + new)
    owner = torch.cat([torch.full((len(p),), i) for i, p in enumerate(positions)])
    pos = torch.cat(positions)
    slots = table[owner, pos // PAGE] * PAGE + pos % PAGE
    return StepBatch(nd, starts, lens, table, slots, pos)


def table_of(lens: list[int], pages: int, last: bool = False) -> torch.Tensor:
    """A page table [seqs, width] of distinct pages; `last`: the cache's last pages, so
    they lie past 2^31 elements in a big cache."""
    width = max(-(-n // PAGE) for n in lens)
    need = len(lens) * width
    assert need <= pages, (need, pages)
    first = pages - need if last else 0
    order = torch.randperm(need, generator=torch.Generator().manual_seed(0)) + first
    return order.view(len(lens), width)


def triton_backend(h: Heads, device: torch.device, positions: int) -> Any:
    from cluster.engine.kernels.attention_triton import TritonBackend

    return TritonBackend(device, h.kv_heads, rope_tables(h.head_dim, positions, device))


def qkv(h: Heads, rows: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    return [
        torch.randn(rows, n, h.head_dim, dtype=dtype, device=device)
        for n in (h.heads, h.kv_heads, h.kv_heads)
    ]


# --- kernels: each one alone ------------------------------------------------------------------


def kernels(f: Figures) -> None:
    device = device_of(f.dry)
    for batch in (1, 2) if f.dry else (1, 64):  # the interpreter runs a program at a time
        with f.each(f"decode attention batch {batch}"):
            decode_attention(f, device, batch)
    with f.each("prefill attention"):
        prefill_attention(f, device)
    with f.each("fused kernels"):
        fused_kernels(f, device)
    with f.each("decode matmul"):
        matmuls(f, device)


def decode_attention(f: Figures, device: torch.device, batch: int) -> None:
    """KV GB/s of one layer's decode attention (store, split-K decode and its reduce)."""
    h, context = (TINY, 16) if f.dry else (LLAMA, 2048)
    lens = [context] * batch
    cache = cache_of(h, batch * -(-context // PAGE), torch.bfloat16, device)
    backend = triton_backend(h, device, context)
    step = batch_of(lens, [], table_of(lens, cache.num_pages))
    md = backend.prepare(step)
    q, k, v = qkv(h, batch, torch.bfloat16, device)
    s = seconds_per_call(lambda: backend.forward(0, q, k, v, cache, md), device, 1 if f.dry else 50)
    kv_bytes = batch * context * cache.layout.bytes_per_token
    gb_s = kv_bytes / s / 1e9
    f.add(f"decode attention batch {batch}", context=context, splits=md.num_splits,
          us=round(s * 1e6, 1), kv_bytes=kv_bytes, gb_s=round(gb_s, 1),
          share_of_measured_copy=share(gb_s, f.measured("copy", "gb_s")))  # fmt: skip


def prefill_attention(f: Figures, device: torch.device) -> None:
    """TFLOP/s of one layer's causal attention over an 8k-token prompt (its KV store, ~1%
    of the time, included)."""
    h, n = (TINY, 32) if f.dry else (LLAMA, 8192)
    cache = cache_of(h, -(-n // PAGE), torch.bfloat16, device)
    backend = triton_backend(h, device, n)
    step = batch_of([], [(n, n)], table_of([n], cache.num_pages))
    md = backend.prepare(step)
    q, k, v = qkv(h, n, torch.bfloat16, device)
    s = seconds_per_call(lambda: backend.forward(0, q, k, v, cache, md), device, 1 if f.dry else 10)
    flops = 2 * h.heads * h.head_dim * n * n  # QK^T and PV over the causal half
    tflops = flops / s / 1e12
    f.add("prefill attention", tokens=n, ms=round(s * 1e3, 3), tflops=round(tflops, 2),
          share_of_measured_gemm=share(tflops, f.measured("gemm", "tflops")))  # fmt: skip


def fused_kernels(f: Figures, device: torch.device) -> None:
    """Microseconds a call of add_rms_norm, the RoPE + KV store and silu_mul, at a decode
    batch's 64 rows and a prefill's 8192."""
    for rows in (4, 16) if f.dry else (64, 8192):
        f.add("fused kernels", rows=rows, us_per_call=fused_per_call(f.dry, device, rows))


def fused_per_call(dry: bool, device: torch.device, rows: int) -> dict[str, float]:
    from cluster.engine.kernels import layer_kernels, paged_kernels

    h, hidden, inner = (TINY, 64, 128) if dry else (LLAMA, 4096, 14336)
    dt = torch.bfloat16
    x = torch.randn(rows, hidden, dtype=dt, device=device)
    delta, weight = torch.randn_like(x), torch.ones(hidden, dtype=dt, device=device)
    gate_up = torch.randn(rows, 2 * inner, dtype=dt, device=device)
    cache = cache_of(h, -(-rows // PAGE), dt, device)
    cos, signed_sin = rope_tables(h.head_dim, rows, device)
    q, k, v = qkv(h, rows, dt, device)
    slots = torch.arange(rows, device=device)
    calls = {
        "add_rms_norm": lambda: layer_kernels.add_rms_norm(x, delta, weight, 1e-5),
        "rope_store_kv": lambda: paged_kernels.rope_store_kv(
            q, k, v, cache.k[0], cache.v[0], cache.layout, slots, slots, cos, signed_sin
        ),
        "silu_mul": lambda: layer_kernels.silu_mul(gate_up),
    }
    reps = 1 if dry else 100
    return {name: round(seconds_per_call(c, device, reps) * 1e6, 2) for name, c in calls.items()}


def matmuls(f: Figures, device: torch.device) -> None:
    """The decode matmul (DenseLinear: the weight stored [in, out]) against F.linear on the
    weight as checkpoints store it ([out, in]), Llama-3-8B's MLP up projection."""
    from cluster.engine.model.quantization import DenseLinear

    n_in, n_out = (64, 128) if f.dry else (4096, 14336)
    w = torch.randn(n_out, n_in, dtype=torch.bfloat16, device=device) * 0.02
    dense = DenseLinear(w, None)
    for rows in (1, 8, 64, 8192) if not f.dry else (1, 8):
        x = torch.randn(rows, n_in, dtype=torch.bfloat16, device=device)
        reps = 2 if f.dry else 50
        ours = seconds_per_call(partial(dense, x), device, reps)
        theirs = seconds_per_call(partial(F.linear, x, w), device, reps)
        weight_gb_s = w.numel() * w.element_size() / ours / 1e9
        f.add("decode matmul", rows=rows, shape=[n_in, n_out], dense_us=round(ours * 1e6, 2),
              f_linear_us=round(theirs * 1e6, 2), dense_over_f_linear=round(ours / theirs, 3),
              dense_tflops=round(2 * rows * n_in * n_out / ours / 1e12, 2),
              dense_weight_gb_s=round(weight_gb_s, 1))  # fmt: skip


# --- correctness on the device ----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    backend: str
    dtype: torch.dtype
    heads: Heads
    pages: int  # 140000 pages of 16 x 8 x 128: 2.3e9 elements a cache, > 2^31


TOLERANCE = {torch.bfloat16: 5e-2, torch.float32: 1e-4}


def cases(dry: bool) -> list[Case]:
    if dry:
        return [Case("triton", torch.bfloat16, TINY, 40), Case("triton", torch.float32, TINY, 40)]
    small = Heads(9, 3, 64)  # a GQA group of 3
    out = [Case("triton", torch.bfloat16, LLAMA, 140000)]
    if importlib.util.find_spec("flashinfer") is not None:
        out += [Case("flashinfer", torch.bfloat16, LLAMA, 140000)]
    return [
        *out,
        Case("triton", torch.bfloat16, small, 4000),
        Case("triton", torch.float32, small, 4000),
    ]


def correctness(f: Figures) -> None:
    device = device_of(f.dry)
    first, *rest = cases(f.dry)
    check(f, first, device)  # on a GPU: the cache past 2^31 elements
    with f.each("graphs vs eager"):
        graphs_against_eager(f, device)
    for case in rest:
        check(f, case, device)


def check(f: Figures, case: Case, device: torch.device) -> None:
    dt = str(case.dtype).removeprefix("torch.")
    h = case.heads
    name = f"{case.backend} {dt} H{h.heads}/KV{h.kv_heads} D{h.head_dim} vs float32"
    with f.each(name):
        f.add(name, **against_reference(case, device, f.dry))
    if device.type == "cuda":
        torch.cuda.empty_cache()


def against_reference(case: Case, device: torch.device, dry: bool) -> dict[str, Any]:
    """A step of ragged decodes and prefill chunks after cached context, by the backend on
    the device, and in float32 by the CPU backend's gather-and-SDPA path on a float32 copy
    of the pages the step reads: the largest difference of each part, OK within the dtype's
    tolerance. The pages are the cache's last ones: past 2^31 elements in a big cache."""
    from cluster.engine.kernels.attention import make_backend
    from cluster.engine.kernels.attention_cpu import CpuBackend
    from cluster.engine.model.model import rotate

    h, cpu = case.heads, torch.device("cpu")
    decodes = [1, 17] if dry else [1, 17, 255, 256, 257, 1000, 4097]
    chunks = [(5, 5), (3, 20)] if dry else [(100, 100), (100, 1000), (257, 4097)]
    lens = decodes + [c for _, c in chunks]
    cache = cache_of(h, case.pages, case.dtype, device)
    table = table_of(lens, case.pages, last=True)
    used = table.flatten()
    reference = KVCache(replace(cache.layout, dtype=torch.float32), len(used), cpu)
    for mine, theirs in ((reference.k, cache.k), (reference.v, cache.v)):
        mine.copy_(theirs[:, used.to(device)].float().cpu())  # dim 1: pages, in any layout
    step = batch_of(decodes, chunks, table)
    rope = rope_tables(h.head_dim, max(lens), device)
    backend = make_backend(case.backend, cache.layout, h.heads, device, rope)
    q, k, v = qkv(h, step.positions.shape[0], case.dtype, device)
    cos, signed_sin = (t[step.positions.to(device)][:, None] for t in rope)
    turned = [rotate(x.float(), cos, signed_sin) for x in (q, k)]  # float32
    if backend.fuses_rope:
        got = backend.forward(0, q.clone(), k, v, cache, backend.prepare(step))
    else:
        qr, kr = (x.to(case.dtype) for x in turned)
        got = backend.forward(0, qr, kr, v, cache, backend.prepare(step))
    exact = CpuBackend(reference.layout, cpu, in_place=False)
    own = batch_of(decodes, chunks, torch.arange(len(used)).view(table.shape))
    q32, k32, v32 = (x.cpu() for x in (*turned, v.float()))
    want = exact.forward(0, q32, k32, v32, reference, exact.prepare(own))
    got = got.float().cpu()
    nd = len(decodes)
    decode_err = (got[:nd] - want[:nd]).abs().max().item()
    prefill_err = (got[nd:] - want[nd:]).abs().max().item()
    elements = cache.k[0].numel()
    return {
        "cache_elements": elements,
        "past_2_31": elements > 2**31,
        "decode_err": decode_err,
        "prefill_err": prefill_err,
        "ok": max(decode_err, prefill_err) < TOLERANCE[case.dtype],
    }


def graphs_against_eager(f: Figures, device: torch.device) -> None:
    """A random float32 model (SmolLM2-135M's shapes; a dry run: tiny): a decode step of 3
    by the runner (a CUDA graph on a GPU) and a 100-token prefill (the piecewise graphs)
    against the same steps run eagerly on the same cache."""
    from cluster.engine.runner import ModelRunner
    from cluster.engine.sched.scheduler import Step
    from splitserve.bench import gpu as g

    context, prompt_len = (8, 12) if f.dry else (40, 100)
    sizes = g.Sizes(("tiny",), (4,), context, 128, 1, 0, 0)
    spec = g.spec_of("tiny" if f.dry else "smollm2-135m")
    torch.manual_seed(0)
    rig = g.Rig(spec, device, sizes, torch.float32)
    eager = ModelRunner(rig.model, rig.cache, rig.runner.attention, device, rig.max_model_len)
    (prompt,) = rig.sequences(1, prompt_len)
    prompt.num_computed = 0
    steps = {
        "decode": Step(decodes=rig.sequences(3, context)),
        "prefill": Step(prefills=[(prompt, prompt_len)]),
    }
    for name, step in steps.items():
        got = rig.runner.run(step)[1].clone()
        want = eager.run(step)[1]
        err = (got - want).abs().max().item()
        kind = "decode graph" if name == "decode" else "piecewise graphs"
        graphs = rig.runner.graphs if name == "decode" else rig.runner.pieces
        f.add("graphs vs eager", part=name, replayed=f"{kind}: {graphs is not None}",
              max_abs_err=err, ok=err <= 1e-4 * max(1.0, want.abs().max().item()))  # fmt: skip
