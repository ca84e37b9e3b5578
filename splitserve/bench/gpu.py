"""`splitserve bench gpu`: the GPU data plane on one GPU, with no network and no model files.

Prints, in one run (about 5 minutes on one H200):
1. which attention kernel ran, and whether decode replays CUDA graphs;
2. greedy tokens of the GPU engine against the CPU engine on the bundled model (float32);
3. decode tok/s and its share of the HBM roofline (bytes of weights + KV read per step
   over this GPU's published bandwidth) at batch 1, 8 and 64 with 2k-token contexts, on
   random weights in the shapes of the bundled model and of Llama-3-8B (bfloat16);
4. prefill TFLOP/s of an 8k-token prompt (matmuls and causal attention), against this
   GPU's dense bfloat16 peak;
5. host syncs, PyTorch ops, Triton launches and graph replays of one decode step;
6. NIXL WRITE bandwidth between two processes' KV caches on the same GPU.

`--dry-run` runs the same code on the CPU at tiny sizes (a tiny random model, Triton
kernels under Triton's interpreter): a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from splitserve.bench import RESULTS
from splitserve.hardware import GPUS, Hardware

PAGE = 16  # tokens per KV page


@dataclass(frozen=True)
class Sizes:
    models: tuple[str, ...]  # splitserve.capacity.ARCHITECTURES names, or "tiny"
    batches: tuple[int, ...]
    context: int  # decode context per sequence
    prefill: int  # prefill prompt tokens
    steps: int  # timed decode steps
    greedy_tokens: int
    transfer_tokens: int


FULL = Sizes(("smollm2-135m", "llama-3-8b"), (1, 8, 64), 2048, 8192, 20, 16, 8192)
# The dry run prefills past its decode context, as the full run does (8k over 2k): a page
# table sized for decode alone fails it.
DRY = Sizes(("tiny",), (1, 2), 48, 96, 2, 2, 256)


def profile_of(device_name: str, memory_bytes: int) -> Hardware | None:
    """The published figures (splitserve.hardware.GPUS) of the GPU torch names
    `device_name` with `memory_bytes` of memory, matched by the words the name contains;
    None for one not known (no share is printed then)."""
    base = lambda p: p.name.split("-")[0]  # "A100-40GB" is sold as an A100
    named = [p for p in GPUS.values() if base(p) in device_name]
    # The longest name that matches ("H100 PCIe" over "H100"), then the nearest memory.
    fit = lambda p: (-len(base(p)), abs(p.memory_gb * 1e9 - memory_bytes))
    return min(named, key=fit, default=None)


def decode_bytes(spec: Any, weight_bytes: int, kv_bytes: int, item: int) -> int:
    """Bytes one decode step reads: every weight, less an untied embedding table (the step
    looks up one row a sequence; a tied one is read whole as the head), and the KV."""
    embedding = 0 if spec.tie_embeddings else spec.vocab_size * spec.hidden_size * item
    return weight_bytes - embedding + kv_bytes


@dataclass(frozen=True)
class Decode:
    model: str
    batch: int
    context: int
    step_s: float
    bytes_per_step: int
    bandwidth_gb_s: float | None  # the device's published figure; None: not known

    @property
    def tokens_s(self) -> float:
        return self.batch / self.step_s

    @property
    def roofline_share(self) -> float | None:
        if self.bandwidth_gb_s is None:
            return None
        return self.bytes_per_step / (self.bandwidth_gb_s * 1e9) / self.step_s


@dataclass(frozen=True)
class Prefill:
    model: str
    tokens: int
    seconds: float
    flops: float
    peak_tflops: float | None  # the device's dense bf16 figure; None: not known

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12

    @property
    def peak_share(self) -> float | None:
        return None if self.peak_tflops is None else self.tflops / self.peak_tflops


def spec_of(name: str) -> Any:
    """A named architecture's shape, or a tiny one for the dry run."""
    from splitserve.capacity import ARCHITECTURES

    if name == "tiny":
        return replace(
            ARCHITECTURES["smollm2-135m"],
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            name="tiny",
        )
    return ARCHITECTURES[name]


class Rig:
    """A model of random weights with a KV cache and a runner: an engine without a
    checkpoint, scheduler or tokenizer, stepped directly."""

    def __init__(
        self, spec: Any, device: torch.device, sizes: Sizes, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        from cluster.engine.kernels.attention import resolve_backend
        from cluster.engine.kernels.kv_cache import KVCache, KVLayout
        from cluster.engine.model.model import LlamaModel
        from cluster.engine.runner import build_runner
        from cluster.engine.sched.page_pool import pages_for

        self.spec, self.device = spec, device
        self.profile = (
            profile_of(torch.cuda.get_device_name(device), torch.cuda.mem_get_info(device)[1])
            if device.type == "cuda"
            else None
        )
        self.model = LlamaModel(spec, random_weights(spec, dtype, device), dtype, device)
        self.layout = KVLayout.of(spec, PAGE, dtype)
        max_seqs, decode_len = max(sizes.batches), sizes.context + PAGE
        # Room for the largest decode batch, or for the one long prefill; the page table's
        # width (max_model_len) for the longest of both.
        pages = max(max_seqs * pages_for(decode_len, PAGE), pages_for(sizes.prefill, PAGE))
        self.max_model_len = max(decode_len, sizes.prefill)
        self.cache = KVCache(self.layout, pages, device)
        name = str(dtype).removeprefix("torch.")
        backend = (
            resolve_backend("auto", device, name, "auto") if device.type == "cuda" else "triton"
        )
        started = time.perf_counter()
        self.runner = build_runner(
            self.model, self.cache, backend, max_seqs, self.max_model_len, sizes.prefill, device
        )
        self.build_s = time.perf_counter() - started  # CUDA graphs' capture, on a GPU

    def sequences(self, batch: int, context: int) -> list[Any]:
        """`batch` sequences whose next token is at position context - 1, on pages of their own."""
        from cluster.engine.sched.page_pool import pages_for
        from cluster.engine.sched.sequence import Sequence
        from cluster.types import PageId, RequestId, SamplingParams

        ids = torch.randint(0, self.spec.vocab_size, (context,)).tolist()
        per = pages_for(context, PAGE)
        return [
            Sequence(
                RequestId(f"s{i}"),
                list(ids),
                context,
                SamplingParams(),
                pages=[PageId(i * per + p) for p in range(per)],
                num_computed=context - 1,
            )
            for i in range(batch)
        ]

    def decode_step(self, seqs: list[Any]) -> list[int]:
        """One decode step and its greedy tokens on the device (one copy back)."""
        from cluster.engine.sampler import sample
        from cluster.engine.sched.scheduler import Step

        sampled, logits = self.runner.run(Step(decodes=seqs))
        return sample(logits, [s.sampling for s in sampled], [None] * len(sampled))[0]


QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def random_weights(spec: Any, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Weights under Hugging Face names, drawn at the scale of a trained model's."""
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads
    d = spec.head_dim
    rand = lambda *shape: torch.randn(shape, dtype=dtype, device=device) * 0.02
    w: dict[str, Any] = {
        "model.embed_tokens.weight": rand(spec.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=dtype, device=device),
    }
    if not spec.tie_embeddings:
        w["lm_head.weight"] = rand(spec.vocab_size, h)
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        for name, shape in (
            ("self_attn.q_proj", (q * d, h)),
            ("self_attn.k_proj", (kv * d, h)),
            ("self_attn.v_proj", (kv * d, h)),
            ("self_attn.o_proj", (h, q * d)),
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        ):
            w[p + name + ".weight"] = rand(*shape)
            if spec.qkv_bias and name in QKV:
                w[p + name + ".bias"] = rand(shape[0])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[p + norm + ".weight"] = torch.ones(h, dtype=dtype, device=device)
    return w


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def decode(rig: Rig, name: str, sizes: Sizes) -> list[Decode]:
    out = []
    for batch in sizes.batches:
        seqs = rig.sequences(batch, sizes.context)
        step = lambda seqs=seqs: rig.decode_step(seqs)
        step()  # warm-up
        seconds = sorted(timed(step, rig.device) for _ in range(sizes.steps))
        kv = int(batch * sizes.context * rig.layout.bytes_per_token)
        read = decode_bytes(rig.spec, rig.model.weight_bytes, kv, rig.layout.dtype.itemsize)
        bandwidth = rig.profile.bandwidth_gb_s if rig.profile else None
        out.append(Decode(name, batch, sizes.context, seconds[len(seconds) // 2], read, bandwidth))
    return out


def prefill(rig: Rig, name: str, tokens: int) -> Prefill:
    from cluster.engine.sched.scheduler import Step

    s = rig.spec
    (seq,) = rig.sequences(1, tokens)
    seq.num_computed = 0
    run = lambda: rig.runner.run(Step(prefills=[(seq, tokens)]))
    run()
    seconds = min(timed(run, rig.device) for _ in range(2))
    # Every weight is multiplied by every token but the vocabulary matrices: the embedding
    # is looked up and the head runs on the last token only.
    vocab = s.vocab_size * s.hidden_size * (1 if s.tie_embeddings else 2)
    matmul = 2 * tokens * (rig.model.weight_bytes // 2 - vocab)
    attention = 2 * s.num_layers * s.num_heads * s.head_dim * tokens * tokens  # causal half
    peak = rig.profile.tflops if rig.profile else None
    return Prefill(name, tokens, seconds, matmul + attention, peak)


def step_budget(rig: Rig, batch: int, context: int) -> dict[str, Any]:
    from splitserve.bench.step_budget import counting

    seqs = rig.sequences(batch, context)
    rig.decode_step(seqs)
    with counting() as budget:
        rig.decode_step(seqs)
    return {"batch": batch, **asdict(budget)}


def greedy_agreement(device: torch.device, tokens: int) -> dict[str, Any]:
    """The bundled model in float32, GPU engine against CPU engine, greedy."""
    from cluster.config import EngineConfig
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    backend = "auto" if device.type == "cuda" else "triton"
    small = EngineConfig(dtype="float32", quantization="none", kv_cache_gb=0.1, max_model_len=512)
    gpu = LLMEngine(replace(small, device=device.type, attention_backend=backend))
    cpu = LLMEngine(replace(small, device="cpu"))
    greedy = SamplingParams(max_tokens=tokens)
    ours = [c.token_ids for c in gpu.generate(prompts, greedy)]
    want = [c.token_ids for c in cpu.generate(prompts, greedy)]
    return {
        "attention": gpu.runner.attention.name,
        "cuda_graphs": gpu.runner.graphs is not None,
        "gpu_tokens": ours,
        "cpu_tokens": want,
        "equal": ours == want,
    }


def transfer(device: torch.device, tokens: int) -> float:
    """NIXL WRITE GB/s of a prompt's KV (bundled layout) into another process's cache."""
    from cluster.engine.kernels.kv_cache import KVLayout
    from cluster.engine.model.checkpoint import read_spec
    from cluster.engine.model.model_files import bundled_model_path
    from cluster.transfer.wire import compat_hash
    from splitserve.bench.transfer import PAGE_SIZE, kv_bandwidth

    spec = read_spec(bundled_model_path())
    layout = KVLayout.of(spec, PAGE_SIZE, torch.bfloat16)
    compat = compat_hash(spec, "bfloat16", "auto", PAGE_SIZE, "none")
    (((_, _, _, gbps),),) = kv_bandwidth(layout, compat, 3, (tokens,), device.type)
    return gbps


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.1%}"


def report(results: dict[str, Any]) -> str:
    g = results["greedy"]
    dry = results["device"] == "cpu"
    lines = [
        "DRY RUN on the CPU (Triton's interpreter, a tiny model): a check, not a measurement"
        if dry
        else f"device: {results['device']}",
        f"attention kernel: {g['attention']}; CUDA-graph decode: {g['cuda_graphs']}",
        f"greedy tokens, GPU engine vs CPU engine (bundled model, float32): "
        f"{'equal' if g['equal'] else 'DIFFER'}",
        "",
        f"{'model':<14}{'batch':>6}{'context':>8}{'step ms':>9}{'tok/s':>10}{'% HBM roofline':>16}",
    ]
    for d in results["decode"]:
        lines.append(
            f"{d['model']:<14}{d['batch']:>6}{d['context']:>8}{d['step_s'] * 1e3:>9.2f}"
            f"{d['tokens_s']:>10.0f}{_percent(d['roofline_share']):>16}"
        )
    lines.append("")
    for p in results["prefill"]:
        lines.append(
            f"prefill {p['model']} {p['tokens']} tokens: {p['seconds'] * 1e3:.1f} ms, "
            f"{p['tflops']:.1f} TFLOP/s "
            f"({_percent(p['peak_share'])} of dense bf16 peak)"
        )
    for b in results["budget"]:
        lines.append(
            f"one decode step ({b['model']}, batch {b['batch']}): {len(b['syncs'])} host syncs "
            f"{b['syncs']}, {b['ops']} PyTorch ops, {b['launches']} Triton launches, "
            f"{b['replays']} graph replays"
        )
    lines.append(
        f"NIXL WRITE between two processes on one {results['device']}: "
        f"{results['transfer_gbps']:.1f} GB/s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench gpu", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (a check)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # Triton's interpreter runs the kernels on CPU
        device, sizes = torch.device("cpu"), DRY
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), FULL
    else:
        parser.error("no CUDA device: run with --dry-run to check the script on the CPU")
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    }
    results["greedy"] = greedy_agreement(device, sizes.greedy_tokens)
    results["decode"], results["prefill"], results["budget"] = [], [], []
    for name in sizes.models:
        rig = Rig(spec_of(name), device, sizes)
        results["decode"] += [
            {**asdict(d), "tokens_s": d.tokens_s, "roofline_share": d.roofline_share}
            for d in decode(rig, name, sizes)
        ]
        p = prefill(rig, name, sizes.prefill)
        results["prefill"].append({**asdict(p), "tflops": p.tflops, "peak_share": p.peak_share})
        results["budget"].append(
            {"model": name, **step_budget(rig, sizes.batches[-1], sizes.context)}
        )
        del rig
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["transfer_gbps"] = transfer(device, sizes.transfer_tokens)
    print(report(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0
