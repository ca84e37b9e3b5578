"""Offline throughput: one fixed-seed request set through transformers, llama.cpp and us.

In one process, on the CPU, same dtype, every request producing exactly its output
length (ignore_eos):
1. transformers `generate`, one request at a time (the first --hf-requests requests);
2. transformers `generate`, static left-padded batches (all requests);
3. splitserve's engine, continuous batching (all requests);
4. llama.cpp on the same GGUF, if installed: one at a time (the --hf-requests subset)
   and batched through its C API (all requests).
Then: batch-1 decode against the memory wall, KV waste paged versus contiguous, a decode
step with its pages gathered against read in place, and every engine mode side by side
(splitserve/bench/modes.py: dtype x quantization, batch-1 decode against its own memory
wall, 1,024-token prefill, llama.cpp and transformers as peers). Prints tables and the
targets, writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cluster.config import DTYPES, QUANTIZATIONS, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.model.checkpoint import read_spec
from cluster.engine.model.model_files import bundled_model_path
from cluster.types import SamplingParams
from splitserve import workload
from splitserve.bench import (
    RESULTS,
    baselines,
    decode_cost,
    llamacpp,
    modes,
    report,
    tensor_parallel,
    vllm_peer,
)
from splitserve.bench.baselines import Run
from splitserve.bench.decode_cost import DecodeEfficiency, GatherCost
from splitserve.bench.kv_waste import KVWaste, kv_waste
from splitserve.bench.report import Results
from splitserve.workload import LengthDist, Request

FULL: dict[str, Any] = {
    "num_requests": 64,
    "hf_requests": 8,
    "hf_batch": 16,
    "decode_steps": 50,
    "gather_batches": (1, 16, 64),
    "gather_contexts": (512, 2048),
}
QUICK: dict[str, Any] = {
    "num_requests": 8,
    "hf_requests": 4,
    "hf_batch": 4,
    "decode_steps": 20,
    "gather_batches": (1, 16),
    "gather_contexts": (512, 2048),
}
DECODE_PROMPT = 128
CONTEXT_CHUNK = 256  # a prefill chunk's tokens after its context, in the gather rows
PAD_ID = 2  # the bundled model's pad (= EOS) id; padded positions are masked anyway


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="splitserve.bench.offline", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small smoke run (~1-2 minutes)")
    p.add_argument("--num-requests", type=int, help="requests in the set (64; quick 8)")
    p.add_argument("--hf-requests", type=int, help="one-at-a-time subset (8; quick 4)")
    p.add_argument("--hf-batch", type=int, help="transformers static batch size (16; quick 4)")
    p.add_argument("--decode-steps", type=int, help="timed batch-1 decode steps (50; quick 20)")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none")
    p.add_argument(
        "--modes-only", action="store_true", help="only the engine modes table (~2 minutes)"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="only TP=N (a thread a rank) against TP=1 (N threads): splitserve/bench/"
        "tensor_parallel.py",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "offline.json")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def splitserve_run(engine: LLMEngine, requests: list[Request]) -> tuple[Run, list[list[int]]]:
    warm = baselines.WARMUP
    engine.generate([warm.prompt] * 2, SamplingParams(max_tokens=warm.output_len, ignore_eos=True))
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    done = engine.generate([r.prompt for r in requests], params)
    seconds = time.perf_counter() - start
    outputs = [c.token_ids for c in done]
    assert [len(o) for o in outputs] == [r.output_len for r in requests], "engine stopped early"
    cfg = engine.config
    note = (
        f"continuous batching, max_num_seqs {cfg.max_num_seqs}, "
        f"{cfg.max_num_batched_tokens} tokens/step, chunked prefill"
    )
    tokens = sum(r.output_len for r in requests)
    return Run("splitserve, continuous batching", len(requests), tokens, seconds, note), outputs


def throughput(
    args: argparse.Namespace, engine: LLMEngine, requests: list[Request]
) -> tuple[Run, Run, Run, list[Run]]:
    """transformers one at a time and static, ours, llama.cpp's (none if not installed)."""
    gguf = bundled_model_path()
    subset = requests[: args.hf_requests]
    say(f"transformers: loading {gguf.name} as {args.dtype}")
    model = baselines.load_transformers(gguf, getattr(torch, args.dtype))
    say(f"transformers: {len(subset)} requests one at a time")
    one, hf_outputs = baselines.transformers_one_at_a_time(model, subset, PAD_ID)
    say(f"transformers: {len(requests)} requests in static batches of {args.hf_batch}")
    static = baselines.transformers_static_batches(model, requests, args.hf_batch, PAD_ID)
    del model
    gc.collect()
    say(f"splitserve: {len(requests)} requests")
    ours, our_outputs = splitserve_run(engine, requests)
    same = sum(a == b for a, b in zip(hf_outputs, our_outputs, strict=False))
    note = f"first {len(subset)} requests; greedy ids identical to ours in {same}/{len(subset)}"
    one = dataclasses.replace(one, note=note)
    if not llamacpp.available():
        return one, static, ours, []
    threads = torch.get_num_threads()
    say(f"llama.cpp: {len(subset)} requests one at a time")
    lc_one = llamacpp.one_at_a_time(gguf, subset, threads)
    say(f"llama.cpp: {len(requests)} requests batched")
    return one, static, ours, [lc_one, llamacpp.batched(gguf, requests, threads)]


def costs(
    args: argparse.Namespace,
    engine: LLMEngine,
    requests: list[Request],
    prompts: LengthDist,
    outputs: LengthDist,
) -> tuple[DecodeEfficiency, list[KVWaste], int, list[GatherCost]]:
    """Batch-1 decode vs the memory wall, KV waste (and the budget in tokens), gather cost."""
    say("read bandwidth and batch-1 decode")
    bandwidths = decode_cost.read_bandwidths()
    vocab = engine.spec.vocab_size
    prompt = workload.random_prompt(np.random.default_rng(args.seed + 1), DECODE_PROMPT, vocab)
    decode = decode_cost.batch1_decode(engine, prompt, args.decode_steps, 5, bandwidths)
    page_size = engine.layout.page_size
    budget = engine.pool.num_pages * page_size
    waste = kv_waste(
        requests,
        page_size,
        max_tokens=outputs.high,  # the workload's cap, as a client would set it
        max_request_len=prompts.high + outputs.high,
        max_model_len=engine.max_model_len,
        budget_tokens=budget,
    )
    say("decode step and prefill after context: pages gathered or read in place")
    gathers = [
        decode_cost.gather_cost(engine, b, c, repeats=2)
        for c in args.gather_contexts
        for b in args.gather_batches
    ]
    gathers += [
        decode_cost.gather_cost(engine, 1, c, repeats=2, new_tokens=CONTEXT_CHUNK)
        for c in args.gather_contexts
    ]
    return decode, waste, budget, gathers


def vllm(args: argparse.Namespace, requests: list[Request]) -> vllm_peer.VLLMResult | None:
    """vLLM on the same requests, and its prefill and batch-1 decode; None if not set up."""
    if not vllm_peer.available():
        return None
    say(f"vLLM: {len(requests)} requests, prefill and batch-1 decode ({args.dtype})")
    rng = np.random.default_rng(args.seed + 2)
    vocab = read_spec(bundled_model_path()).vocab_size
    prefills = [workload.random_prompt(rng, modes.PREFILL_TOKENS, vocab) for _ in range(3)]
    prompt = workload.random_prompt(rng, modes.DECODE_PROMPT, vocab)
    cache = args.out.parent / "hf"
    return vllm_peer.run(
        bundled_model_path(), args.dtype, requests, prefills, prompt, args.decode_steps, cache
    )


def engine_modes(
    args: argparse.Namespace, bandwidths: list[float], peer: vllm_peer.VLLMResult | None
) -> list[modes.ModeResult]:
    say("engine modes: batch-1 decode and 1,024-token prefill per dtype and quantization")
    results = modes.run_modes(args.decode_steps, args.seed, bandwidths)
    if peer is not None:
        name = f"vLLM (CPU) {args.dtype}, HF copy"
        results.append(modes.ModeResult(name, 0, None, peer.decode_tok_s, peer.prefill_tok_s))
    llama = [r.decode_tok_s for r in results if r.name.startswith("llama.cpp")]
    print(f"\nEngine modes (read bandwidth: best of {[f'{b / 1e9:.1f}' for b in bandwidths]} GB/s)")
    print(modes.table(results, llama[0] if llama else None))
    agreement = modes.llamacpp_agreement(torch.get_num_threads())
    if agreement is not None:
        print(
            f"gguf mode vs llama.cpp, greedy, {modes.AGREEMENT_TOKENS} tokens of "
            f"{agreement.prompts} chat prompts: {agreement.identical} identical; leading "
            f"tokens that agree per prompt {agreement.common_prefix}"
        )
    return results


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.tensor_parallel_size > 1:
        return _tensor_parallel(args, argv)
    if args.modes_only:
        results = engine_modes(args, decode_cost.read_bandwidths(), None)
        doc = {
            "command": ["python", "-m", "splitserve.bench.offline", *argv],
            "modes": _modes_json(results),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        return 0
    engine = LLMEngine(EngineConfig(dtype=args.dtype, quantization=args.quantization, device="cpu"))
    prompts, outputs = workload.PROMPTS, workload.OUTPUTS
    if args.quick:
        prompts, outputs = workload.QUICK_PROMPTS, workload.QUICK_OUTPUTS
    requests = workload.make_requests(
        args.num_requests, engine.spec.vocab_size, args.seed, prompts, outputs
    )
    prompt_lens = [len(r.prompt) for r in requests]
    output_lens = [r.output_len for r in requests]
    say(
        f"{len(requests)} requests: prompt tokens {sum(prompt_lens)} (mean "
        f"{np.mean(prompt_lens):.0f}), output tokens {sum(output_lens)} (mean "
        f"{np.mean(output_lens):.0f}); {torch.get_num_threads()} torch threads"
    )
    hf_one, hf_static, ours, llama_runs = throughput(args, engine, requests)
    decode, waste, budget, gathers = costs(args, engine, requests, prompts, outputs)
    del engine
    gc.collect()
    peer = vllm(args, requests)
    peers = llama_runs + ([peer.run] if peer else [])
    res = Results(hf_one, hf_static, ours, peers, decode, waste, budget, gathers)
    report.print_report(res)
    mode_results = engine_modes(args, decode.bandwidths, peer)
    wall = time.perf_counter() - started
    print(f"\nwall time {wall:.0f} s: python -m splitserve.bench.offline {' '.join(argv)}")
    doc = {
        "command": ["python", "-m", "splitserve.bench.offline", *argv],
        "wall_s": wall,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "modes": _modes_json(mode_results),
        "threads": torch.get_num_threads(),
        "workload": {
            "seed": args.seed,
            "prompts": dataclasses.asdict(prompts),
            "outputs": dataclasses.asdict(outputs),
            "prompt_lens": prompt_lens,
            "output_lens": output_lens,
        },
        **report.to_json(res),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    say(f"wrote {args.out}")
    return 0


def _tensor_parallel(args: argparse.Namespace, argv: list[str]) -> int:
    size = args.tensor_parallel_size
    vocab = read_spec(bundled_model_path()).vocab_size
    prompts, outputs = workload.QUICK_PROMPTS, workload.QUICK_OUTPUTS
    requests = workload.make_requests(args.num_requests, vocab, args.seed, prompts, outputs)
    say(f"TP={size} against TP=1: {len(requests)} requests, {args.decode_steps} decode steps")
    results = tensor_parallel.compare(
        size, args.dtype, args.quantization, args.decode_steps, args.seed, requests
    )
    print(f"\n{args.dtype}, quantization {args.quantization}")
    print(tensor_parallel.table(results))
    doc = {
        "command": ["python", "-m", "splitserve.bench.offline", *argv],
        "tensor_parallel": [dataclasses.asdict(r) for r in results],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _modes_json(results: list[modes.ModeResult]) -> list[dict[str, Any]]:
    return [
        {
            "name": r.name,
            "resident_bytes": r.resident_bytes,
            "decode_tok_s": r.decode_tok_s,
            "prefill_tok_s": r.prefill_tok_s,
            **(
                {
                    "step_bytes": r.decode.weight_bytes + r.decode.kv_bytes,
                    "wall_s": r.decode.wall_s,
                    "median_step_s": r.decode.median_s,
                    "efficiency": r.decode.efficiency,
                }
                if r.decode
                else {}
            ),
        }
        for r in results
    ]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
