"""Hugging Face checkpoint directories load and match transformers' logits tightly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.sched.page_pool import pages_for
from cluster.engine.sched.scheduler import Step
from cluster.engine.sched.sequence import Sequence
from cluster.types import RequestId, SamplingParams
from tests.helpers import assert_no_leak


def _engine_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits at every position, from one prefill of the whole sequence through the pages."""
    rows = []  # positions 0, half - 1, then half .. len - 1
    seq = Sequence(RequestId("x"), ids[:1], 1, SamplingParams())
    seq.pages = engine.pool.allocate(pages_for(len(ids), engine.pool.page_size)) or []
    try:
        _, first = engine.runner.run(Step(decodes=[seq]))
        rows.append(first[0])
        seq.num_computed = 1
        half = len(ids) // 2
        seq.token_ids = ids[:half]
        _, chunk = engine.runner.run(Step(prefills=[(seq, half - 1)]))  # cached context + chunk
        rows.append(chunk[0])
        seq.num_computed = half
        for t in range(half, len(ids)):  # then paged decode, one token at a time
            seq.token_ids = ids[: t + 1]
            _, step = engine.runner.run(Step(decodes=[seq]))
            rows.append(step[0])
            seq.num_computed = t + 1
    finally:
        engine.pool.free(seq.pages)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "which",
    [
        "tiny_llama_dir",
        "tiny_qwen2_dir",
        "tiny_qwen3_dir",
        "tiny_phi3_dir",
        "tiny_mixtral_dir",
        "tiny_qwen3_moe_dir",
        "tiny_gemma_dir",
        "tiny_gemma2_dir",
        "tiny_gemma3_dir",
    ],
)
def test_logits_match_transformers(which: str, request: pytest.FixtureRequest):
    from transformers import AutoModelForCausalLM

    path: Path = request.getfixturevalue(which)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_gb=0.01))
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0]
    half = len(ids) // 2
    positions = [0, half - 1, *range(half, len(ids))]
    ours = _engine_logits(engine, ids)
    diff = (ours - ref[positions]).abs().max().item()
    print(f"{path.name}: logits max abs difference {diff:.2e}")
    assert diff < 1e-4
    assert_no_leak(engine)


@pytest.mark.parametrize(
    "which",
    [
        "tiny_llama_dir",
        "tiny_qwen3_dir",
        "tiny_phi3_dir",
        "tiny_mixtral_dir",
        "tiny_qwen3_moe_dir",
        "tiny_gemma2_dir",
        "tiny_gemma3_dir",
    ],
)
def test_generate_on_a_hf_checkpoint(which: str, request: pytest.FixtureRequest):
    from transformers import AutoModelForCausalLM

    path: Path = request.getfixturevalue(which)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_gb=0.01))
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = engine.tokenizer.encode("Hello there, tiny model")
    done = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    with torch.inference_mode():
        ref = ref_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False
        )
    assert done.token_ids == ref[0, len(prompt) :].tolist()
    assert_no_leak(engine)


# Loads a checkpoint into a bf16 model in a fresh process; prints the peak host memory the
# load added (VmHWM, reset to VmRSS just before) and the bytes the model keeps.
_LOAD_AND_MEASURE = """
import sys
from pathlib import Path
import safetensors, tqdm, torch
from cluster.engine.model.checkpoint import load_checkpoint
from cluster.engine.model.model import LlamaModel

def kib(field):
    return int(Path("/proc/self/status").read_text().split(field + ":")[1].split()[0])

torch.ones(8).to(torch.bfloat16).sum()  # first-use allocations happen before the baseline
Path("/proc/self/clear_refs").write_text("5")  # peak RSS := RSS
base = kib("VmRSS")
spec, weights = load_checkpoint(sys.argv[1], dtype=torch.bfloat16)
model = LlamaModel(spec, weights, torch.bfloat16, torch.device("cpu"))
held = [*model.tensors, model.cos, model.signed_sin]
assert all(t.dtype == torch.bfloat16 for t in held)
print((kib("VmHWM") - base) * 1024, sum(t.nbytes for t in held))
"""


def test_loading_holds_at_most_one_shard_in_host_memory_beyond_the_model(tmp_path: Path):
    """A bf16 checkpoint of several shards loads into a bf16 model: host memory peaks at
    what the model keeps plus at most 1.2x one shard (converting the whole checkpoint to
    float32 first, as loading once did, peaked at 3x the model)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="32MB")
    shards = [f.stat().st_size for f in tmp_path.glob("*.safetensors")]
    assert len(shards) >= 2
    run = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_MEASURE, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    peak, kept = map(int, run.stdout.split())
    mib = 2**20
    print(f"peak {peak / mib:.1f} MiB, model {kept / mib:.1f} MiB, shard {max(shards) / mib:.1f}")
    assert peak <= kept + 1.2 * max(shards)


def test_a_hugging_face_id_is_served_from_the_local_cache(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`splitserve generate --model org/tiny-llama` with the checkpoint in a Hugging Face
    cache laid out as huggingface_hub leaves it (refs/main naming a snapshot), offline; the
    engine serves it under the id. An id not there fails naming the cache."""
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    (repo / "snapshots").mkdir(parents=True)
    (repo / "snapshots" / "0123abc").symlink_to(tiny_llama_dir, target_is_directory=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cli = [sys.executable, "-m", "splitserve.cli", "generate", "Hello", "--max-tokens", "4"]
    done = subprocess.run(
        [*cli, "--model", "org/tiny-llama", "--kv-cache-gb", "0.01", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    engine = LLMEngine(EngineConfig(model="org/tiny-llama", dtype="float32", kv_cache_gb=0.01))
    assert engine.model_info.name == "org/tiny-llama"
    want = engine.generate([engine.tokenizer.encode("Hello")], SamplingParams(max_tokens=4))
    assert done.stdout.strip() == want[0].text.strip()
    missing = subprocess.run([*cli, "--model", "org/not-here"], capture_output=True, text=True)
    assert missing.returncode == 2
    assert f"not in the Hugging Face cache at {tmp_path / 'hub'}" in missing.stderr


@pytest.mark.parametrize("which", ["tiny_gemma2_gguf", "tiny_gemma3_gguf"])
def test_a_gemma_gguf_gives_its_checkpoint_s_logits(
    which: str, request: pytest.FixtureRequest
) -> None:
    # The same float32 weights, one as llama.cpp writes a gemma2 / gemma3 GGUF (norms as
    # 1 + w, the sublayer norms' names, windows, soft-caps and RoPE from its keys and its
    # rules): the same numbers, past the 8-token window.
    ckpt, gguf = request.getfixturevalue(which)
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    logits, specs = [], []
    for path in (ckpt, gguf):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_gb=0.01))
        logits.append(_engine_logits(engine, ids))
        specs.append(engine.spec)
        assert_no_leak(engine)
    fields = ("windows", "query_scale", "attn_softcap", "final_softcap", "local_rope_theta")
    assert [getattr(specs[1], f) for f in fields] == [getattr(specs[0], f) for f in fields]
    assert torch.equal(*logits)


@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_qwen3_moe", "tiny_mixtral"])
def test_a_gguf_gives_its_checkpoint_s_logits(family: str, request: pytest.FixtureRequest) -> None:
    # The same float32 weights, one as llama.cpp writes a qwen3 GGUF (qwen3moe, and
    # Mixtral's llama with experts: each layer's experts stacked): the same numbers.
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    logits, specs = [], []
    for fixture in (f"{family}_dir", f"{family}_gguf"):
        path = request.getfixturevalue(fixture)
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_gb=0.01))
        if family != "tiny_mixtral":
            assert engine.spec.qk_norm and engine.spec.head_dim == 32  # not hidden / heads
        logits.append(_engine_logits(engine, ids))
        specs.append(engine.spec)
        assert_no_leak(engine)
    fields = ("experts", "experts_per_token", "expert_size", "renormalize_experts")
    assert [getattr(specs[1], f) for f in fields] == [getattr(specs[0], f) for f in fields]
    assert torch.equal(*logits)
