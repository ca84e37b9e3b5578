"""The first run's engine step (splitserve/bench/first_run.py).

1. Llama-3-8B shapes on random bfloat16 weights (splitserve/bench/gpu.py's rig: the
   engine's model, KV cache and runner, stepped directly): decode at batch 1, 8 and 64 on
   2k contexts and an 8k prefill, as shares of the ceilings the `ceilings` step measured
   and of the device's published ones; the CUDA graphs' capture seconds, peak memory, the
   host syncs of a step, and profiler tables at batch 1 and 64 (OUT/profile-b*.txt).
2. The whole engine (scheduler, tokenizer, sampler) on a checkpoint written here: random
   Llama-shaped weights in safetensors, a word-level tokenizer.json; its greedy tokens in
   float32 on this device against the CPU engine's. No GGUF, no download.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from splitserve.bench.first_run_figures import Figures, device_of, published, share


def engine(f: Figures) -> None:
    device = device_of(f.dry)
    with f.each("rig"):
        rig_figures(f, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with f.each("checkpoint engine"):
        checkpoint_engine(f, device)


def rig_figures(f: Figures, device: torch.device) -> None:
    from splitserve.bench import gpu as g

    if f.dry:
        # Prefill past the decode context (a page table sized for decode alone fails it).
        name, sizes = "tiny", g.Sizes(("tiny",), (1, 2), 8, 32, 1, 0, 0)
    else:
        name, sizes = "llama-3-8b", g.Sizes(("llama-3-8b",), (1, 8, 64), 2048, 8192, 10, 0, 0)
    rig = g.Rig(g.spec_of(name), device, sizes)
    hw = published(device)
    f.add("rig", model=name, attention=rig.runner.attention.name,
          decode_graphs=rig.runner.graphs is not None, piecewise=rig.runner.pieces is not None,
          weight_gb=round(rig.model.weight_bytes / 1e9, 2), build_s=round(rig.build_s, 2),
          published=hw.name if hw else None)  # fmt: skip
    copy_gb_s, gemm_tflops = f.measured("copy", "gb_s"), f.measured("gemm", "tflops")
    for d in g.decode(rig, name, sizes):
        with f.each(f"decode batch {d.batch}"):
            gb_s = d.bytes_per_step / d.step_s / 1e9
            f.add(f"decode batch {d.batch}", context=d.context, ms=round(d.step_s * 1e3, 3),
                  tokens_s=round(d.tokens_s, 1), gb_s=round(gb_s, 1),
                  share_of_published=d.roofline_share,
                  share_of_measured_copy=share(gb_s, copy_gb_s))  # fmt: skip
    with f.each("prefill"):
        p = g.prefill(rig, name, sizes.prefill)
        f.add("prefill", tokens=p.tokens, ms=round(p.seconds * 1e3, 2), tflops=round(p.tflops, 2),
              share_of_published=p.peak_share,
              share_of_measured_gemm=share(p.tflops, gemm_tflops))  # fmt: skip
    with f.each("host syncs"):
        f.add("host syncs", **g.step_budget(rig, sizes.batches[-1], sizes.context))
    for batch in (sizes.batches[0], sizes.batches[-1]):
        with f.each(f"profile batch {batch}"):
            profile(f, rig, batch, sizes.context)
    if device.type == "cuda":
        gb = lambda n: round(n / 1e9, 2)
        f.add("memory", peak_reserved_gb=gb(torch.cuda.max_memory_reserved(device)),
              peak_allocated_gb=gb(torch.cuda.max_memory_allocated(device)))  # fmt: skip


def profile(f: Figures, rig: Any, batch: int, context: int) -> None:
    """One decode step under torch's profiler: its table in a file, its top ops a figure."""
    seqs = rig.sequences(batch, context)
    rig.decode_step(seqs)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if rig.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        rig.decode_step(seqs)
    sort = "device_time_total" if rig.device.type == "cuda" else "cpu_time_total"
    events = prof.key_averages()
    table = events.table(sort_by=sort, row_limit=30)
    (f.out / f"profile-b{batch}.txt").write_text(table + "\n")
    print(table, flush=True)
    top = sorted(events, key=lambda e: getattr(e, sort), reverse=True)[:8]
    f.add(f"profile batch {batch}", table=f"profile-b{batch}.txt",
          top_us={e.key[:60]: round(getattr(e, sort), 1) for e in top})  # fmt: skip


# --- a checkpoint written here ----------------------------------------------------------------

NEEDS = ("safetensors", "tokenizers", "transformers")


def checkpoint_engine(f: Figures, device: torch.device) -> None:
    lack = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if lack:
        f.add("checkpoint engine", skipped=f"no {' '.join(lack)} here (carry them in .whl/)")
        return
    with tempfile.TemporaryDirectory(prefix="first-run-") as where:  # not in OUT: ~1 GB
        run_checkpoint_engine(f, device, write_checkpoint(Path(where), tiny=f.dry))


def run_checkpoint_engine(f: Figures, device: torch.device, path: Path) -> None:
    from cluster.config import EngineConfig
    from cluster.engine.engine import LLMEngine
    from cluster.types import SamplingParams

    small = EngineConfig(
        model=str(path),
        dtype="float32",
        kv_cache_gb=0.05,
        max_model_len=256,
        max_num_seqs=4,  # few graphs to capture
        max_num_batched_tokens=64,
    )
    # A dry run's "device" engine is the Triton backend under its interpreter.
    backend = "triton" if f.dry else "auto"
    ours = LLMEngine(replace(small, device=device.type, attention_backend=backend))
    cpu = LLMEngine(replace(small, device="cpu"))
    prompts = ["t10 t20 t30 t40", "t90 t80 t70", "t5 " * (4 if f.dry else 40)]
    greedy = SamplingParams(max_tokens=3 if f.dry else 24, ignore_eos=True)
    got = [c.token_ids for c in ours.generate(prompts, greedy)]
    want = [c.token_ids for c in cpu.generate(prompts, greedy)]
    f.add("checkpoint engine", device=str(ours.device), attention=ours.runner.attention.name,
          cuda_graphs=ours.runner.graphs is not None, greedy_equal=got == want,
          tokens=got, cpu_tokens=want)  # fmt: skip


def special(i: int, token: str) -> dict[str, Any]:
    """tokenizer.json's entry for a special token."""
    flags = ("single_word", "lstrip", "rstrip", "normalized")
    return {"id": i, "content": token, **dict.fromkeys(flags, False), "special": True}


def write_checkpoint(path: Path, tiny: bool) -> Path:
    """A Llama checkpoint of random weights (config.json, model.safetensors) and a
    word-level tokenizer of tokens "t0".."tN" (tokenizer.json), as transformers reads them."""
    from safetensors.torch import save_file

    from splitserve.bench.gpu import random_weights, spec_of

    base = spec_of("tiny" if tiny else "llama-3-8b")
    spec = base if tiny else replace(base, num_layers=2, vocab_size=4096, intermediate_size=4096)
    torch.manual_seed(0)
    weights = random_weights(spec, torch.float32, torch.device("cpu"))
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, spec.vocab_size)}}
    tokenizer = {
        "version": "1.0",
        "added_tokens": [special(i, t) for i, t in enumerate(("<unk>", "<s>", "</s>"))],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                "eos_token": "</s>", "unk_token": "<unk>"}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path
