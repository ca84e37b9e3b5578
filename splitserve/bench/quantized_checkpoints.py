"""`splitserve bench quantized-checkpoints`: batch-1 decode of AWQ, GPTQ and FP8
checkpoints against our own int4 and int8 modes on the same shapes (issue 45's target: no
slower).

A random Llama of the bundled model's shape is written by transformers in bfloat16 (a
quantized checkpoint is not bundled), then its AWQ, GPTQ and FP8 (block) checkpoints
(checkpoint_formats.py; groups of `--group`: the bundled shape's 576 inputs take 64, not
128). Each is served on `auto`, the float one in int4 and int8; every engine is built
first and the timings interleaved round by round (decode_cost.batch1_decode), so drift
in the host's speed falls on all alike; the median of each engine's rounds is shown
beside the mode it should match.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.model.checkpoint import read_spec
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tokenizer import Tokenizer
from splitserve.bench.checkpoint_formats import write_quantized
from splitserve.bench.decode_cost import batch1_decode, read_bandwidths
from splitserve.hardware import host_line

# (name, checkpoint, quantization, the mode it is measured against)
ENGINES = (
    ("int4", "float", "int4", None),
    ("awq", "awq", "auto", "int4"),
    ("gptq", "gptq", "auto", "int4"),
    ("int8", "float", "int8", None),
    ("fp8", "fp8-block", "auto", "int8"),
)


def write_llama(root: Path) -> Path:
    """A random Llama of the bundled model's shape, in bfloat16, with its tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    s = read_spec(bundled_model_path())
    config = LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=s.tie_embeddings,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    path = root / "float"
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    Tokenizer.load(bundled_model_path()).hf.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench quantized-checkpoints")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--group", type=int, default=64, help="AWQ/GPTQ group, FP8 block")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps a round")
    args = parser.parse_args(argv)
    print(host_line())
    bandwidths = read_bandwidths()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        dirs = {"float": write_llama(root)}
        for fmt in ("awq", "gptq", "fp8-block"):
            dirs[fmt] = write_quantized(dirs["float"], root, fmt, args.group, False)[0]
        engines = {
            name: LLMEngine(
                EngineConfig(
                    model=str(dirs[ckpt]), dtype=args.dtype, quantization=mode, kv_cache_gb=0.1
                )
            )
            for name, ckpt, mode, _ in ENGINES
        }
        times: dict[str, list[float]] = {name: [] for name in engines}
        prompt = list(range(1000, 1064))
        for _ in range(args.rounds):
            for name, engine in engines.items():
                cost = batch1_decode(engine, prompt, args.steps, 3, bandwidths)
                times[name].append(cost.median_s)
    print("| engine | quantization | batch-1 decode | against | ratio |\n|---|---|---|---|---|")
    for name, _, _, against in ENGINES:
        ms = statistics.median(times[name]) * 1e3
        ratio = "" if against is None else f"{ms / (statistics.median(times[against]) * 1e3):.2f}x"
        mode = engines[name].quantization
        print(f"| {name} | {mode} | {ms:.2f} ms | {against or ''} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
