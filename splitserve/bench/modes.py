"""Every engine mode side by side: batch-1 decode against the memory wall of its own bytes,
and a 1,024-token prefill; llama.cpp on the same GGUF and transformers in float32 as the
peers (each only if installed). Each mode, and the peers, run in a fresh process of their
own, as a served worker holds one engine: in one process, the last of six engines
measured its batch-1 step ~20% slower than the same engine first (gguf 4.11 against 3.39
ms; docs/benchmarks.md).

A mode's memory wall: the bytes one batch-1 decode step must read (every weight the
forward multiplies by, as stored: packed groups and their scales; the KV of the context)
over the best read bandwidth measured in this run. Efficiency = wall / measured step.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.model.checkpoint import read_spec
from cluster.engine.model.model_files import bundled_model_path
from cluster.types import SamplingParams
from splitserve import workload
from splitserve.bench import baselines, decode_cost
from splitserve.bench.decode_cost import DecodeEfficiency, timed

T = TypeVar("T")
MODES = (
    ("float32", "none"),
    ("bfloat16", "none"),
    ("bfloat16", "int8"),
    ("bfloat16", "int4"),
    ("bfloat16", "gguf"),
)
PREFILL_TOKENS = 1024
DECODE_PROMPT = 128
# Greedy agreement with llama.cpp on the same file: natural questions, chat-templated.
QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for learning to program.",
)
AGREEMENT_TOKENS = 32


@dataclass(frozen=True)
class Agreement:
    """Our gguf mode's greedy tokens against llama.cpp's on the same GGUF."""

    identical: int  # continuations identical over all AGREEMENT_TOKENS
    prompts: int
    common_prefix: list[int]  # per prompt, leading tokens that agree


@dataclass(frozen=True)
class ModeResult:
    name: str
    resident_bytes: int  # the weights as held in memory; 0: not known
    decode: DecodeEfficiency | None  # None for a peer we cannot take apart
    decode_tok_s: float  # 0: not timed
    prefill_tok_s: float


def llamacpp_agreement(threads: int) -> Agreement | None:
    """Greedy tokens of our gguf mode (bfloat16) against llama.cpp's, if installed."""
    from splitserve.bench import llamacpp

    if not llamacpp.available():
        return None
    engine = LLMEngine(
        EngineConfig(dtype="bfloat16", quantization="gguf", device="cpu", kv_cache_gb=0.25)
    )
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=AGREEMENT_TOKENS, ignore_eos=True)
    ours = [c.token_ids for c in engine.generate(prompts, greedy)]
    theirs = llamacpp.greedy(bundled_model_path(), prompts, AGREEMENT_TOKENS, threads)
    prefix = [_common_prefix(a, b) for a, b in zip(ours, theirs, strict=True)]
    return Agreement(sum(n == AGREEMENT_TOKENS for n in prefix), len(prompts), prefix)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def run_modes(steps: int, seed: int, bandwidths: list[float]) -> list[ModeResult]:
    """Each (dtype, quantization) in MODES, then the peers: each in a fresh process (the
    module docstring says why) on this process's thread count."""
    threads = torch.get_num_threads()
    results = []
    for i, (dtype, quantization) in enumerate(MODES):
        results.append(
            _in_a_process(_mode, dtype, quantization, steps, [seed, i], bandwidths, threads)
        )
    peers = [_in_a_process(_transformers, [seed, len(MODES)], threads)]
    return results + peers + _in_a_process(_llamacpp, steps, [seed, len(MODES) + 1], threads)


def _in_a_process(fn: Callable[..., T], *args: Any) -> T:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _mode(
    dtype: str,
    quantization: str,
    steps: int,
    seed: list[int],
    bandwidths: list[float],
    threads: int,
) -> ModeResult:
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    engine = LLMEngine(
        EngineConfig(
            dtype=dtype,
            quantization=quantization,
            device="cpu",
            kv_cache_gb=0.25,
            prefix_caching=False,  # every timed prefill computes all its tokens
            max_num_batched_tokens=PREFILL_TOKENS,
        )
    )
    vocab = engine.spec.vocab_size
    prompt = workload.random_prompt(rng, DECODE_PROMPT, vocab)
    decode = decode_cost.batch1_decode(engine, prompt, steps, 5, bandwidths)
    long = workload.random_prompt(rng, PREFILL_TOKENS, vocab)
    prefill_s = _prefill_s(engine, long)
    return ModeResult(
        f"splitserve {dtype}, {quantization}",
        engine.model.weight_bytes,
        decode,
        1 / decode.median_s,
        PREFILL_TOKENS / prefill_s,
    )


def _prefill_s(engine: LLMEngine, prompt: list[int]) -> float:
    """Best of two prefills of `prompt` (one token sampled), after a warm-up."""
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([prompt], one)
    return min(timed(lambda: engine.generate([prompt], one)) for _ in range(2))


def _transformers(seed: list[int], threads: int) -> ModeResult:
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    model = baselines.load_transformers(bundled_model_path(), torch.float32)
    long = workload.random_prompt(rng, PREFILL_TOKENS, model.config.vocab_size)
    prefill_s = _hf_prefill_s(model, long)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    return ModeResult("transformers float32", resident, None, 0.0, PREFILL_TOKENS / prefill_s)


def _llamacpp(steps: int, seed: list[int], threads: int) -> list[ModeResult]:
    """llama.cpp's row, if it is installed."""
    from splitserve.bench import llamacpp

    if not llamacpp.available():
        return []
    rng = np.random.default_rng(seed)
    gguf = bundled_model_path()
    vocab = read_spec(gguf).vocab_size
    prompt = workload.random_prompt(rng, DECODE_PROMPT, vocab)
    long = workload.random_prompt(rng, PREFILL_TOKENS, vocab)
    tok_s, prefill_tok_s = llamacpp.decode_and_prefill(gguf, prompt, steps, long, threads)
    size = gguf.stat().st_size
    return [ModeResult("llama.cpp, GGUF as stored", size, None, tok_s, prefill_tok_s)]


@torch.inference_mode()
def _hf_prefill_s(model: Any, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])
    model(ids)
    return min(timed(lambda: model(ids)) for _ in range(2))


def table(results: list[ModeResult], llama_tok_s: float | None) -> str:
    head = (
        "| engine | weights resident | bytes read / step | wall at best bandwidth | "
        "measured step | % of wall | decode tok/s (batch 1) | vs llama.cpp | prefill tok/s |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [head]
    for r in results:
        d = r.decode
        vs = f"{r.decode_tok_s / llama_tok_s:.2f}" if llama_tok_s and r.decode_tok_s else ""
        decode = f"{r.decode_tok_s:.1f}" if r.decode_tok_s else "not timed"
        rows.append(
            f"| {r.name} | {f'{r.resident_bytes / 2**20:.0f} MiB' if r.resident_bytes else ''} | "
            + (
                f"{(d.weight_bytes + d.kv_bytes) / 2**20:.0f} MiB | {d.wall_s * 1e3:.2f} ms | "
                f"{d.median_s * 1e3:.2f} ms | {d.efficiency:.0%} | "
                if d
                else "| | | | "
            )
            + f"{decode} | {vs} | {r.prefill_tok_s:.0f} |"
        )
    return "\n".join(rows)
