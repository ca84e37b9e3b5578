"""`splitserve bench experts`: batch-1 decode of a Mixture-of-Experts model against the
memory wall of what one token reads (issue 45's target: >= 50% on the CPU).

A token reads every weight outside the experts (a tied embedding once, as the lm_head;
an untied one a row), each layer's router and the `top_k` experts it chose, and its KV:
that over the best read bandwidth of this run is the wall; efficiency = wall / the median
measured step (decode_cost.batch1_decode). No MoE checkpoint is bundled, so the model is a
random Mixtral of the shape asked, written by transformers in bfloat16 to a temporary
directory with the bundled tokenizer beside it, and served in each mode asked.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.model.experts import Experts
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer
from splitserve.bench.decode_cost import batch1_decode, read_bandwidths, weights
from splitserve.hardware import host_line


def write_mixtral(root: Path, args: argparse.Namespace) -> Path:
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=49152,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=4096,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = root / "mixtral"
    model.save_pretrained(path)
    Tokenizer.load(bundled_model_path()).hf.save_pretrained(path)
    return path


def active_bytes(engine: LLMEngine) -> int:
    """The weight bytes one token reads: all of decode_cost.weights' but the experts its
    router did not choose (each layer's top_k of them, at their mean size)."""
    read = sum(t.numel() * t.element_size() for t in weights(engine))
    for layer in engine.model.layers:
        if isinstance(layer.mlp, Experts):
            sizes = [
                sum(t.numel() * t.element_size() for t in e.tensors) for e in layer.mlp.experts
            ]
            read -= sum(sizes) - layer.mlp.top_k * sum(sizes) // len(sizes)
    return read


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench experts", description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2048, help="each expert's")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--modes", default="bfloat16:none,bfloat16:int8,bfloat16:int4",
                        help="dtype:quantization pairs, comma-separated")  # fmt: skip
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=128, help="the prompt's tokens")
    args = parser.parse_args(argv)
    print(host_line())
    bandwidths = read_bandwidths()
    print(f"read bandwidth: best {max(bandwidths) / 1e9:.1f} GB/s of {len(bandwidths)} buffers")
    print(
        "| mode | weights resident | read a token | wall | measured step | % of wall | tok/s |\n"
        "|---|---|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as d:
        path = write_mixtral(Path(d), args)
        for mode in args.modes.split(","):
            dtype, quantization = mode.split(":")
            config = EngineConfig(
                model=str(path), dtype=dtype, quantization=quantization, kv_cache_gb=0.1
            )
            engine = LLMEngine(config)
            prompt = list(range(1000, 1000 + args.prompt))
            cost = batch1_decode(engine, prompt, args.steps, 5, bandwidths)
            active = active_bytes(engine)
            wall = (active + cost.kv_bytes) / max(bandwidths)
            print(
                f"| {mode} | {engine.model.weight_bytes / 2**20:.0f} MiB | "
                f"{(active + cost.kv_bytes) / 2**20:.0f} MiB | {wall * 1e3:.2f} ms | "
                f"{cost.median_s * 1e3:.2f} ms | {wall / cost.median_s:.0%} | "
                f"{1 / cost.median_s:.1f} |"
            )
            del engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
