"""`splitserve generate` streams only the generated text to stdout; errors name the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.kernels.cpu_isa import fast_dtype
from cluster.types import SamplingParams
from splitserve.plan import SHORT_DTYPE


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_prints_what_the_engine_generates_in_the_auto_modes() -> None:
    engine = LLMEngine(EngineConfig(kv_cache_gb=0.05))  # the defaults: auto, auto
    assert (engine.dtype, engine.quantization) == (fast_dtype("cpu"), "gguf")
    prompt = "What is the capital of France?"
    chat = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    expected = engine.generate([chat], SamplingParams(max_tokens=12))[0].text
    done = _run("generate", prompt, "--chat", "--max-tokens", "12", "--kv-cache-gb", "0.05")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert "KV cache (" in done.stderr and "pages of 16 tokens" in done.stderr
    # The start-up line says what auto chose and why.
    assert f"dtype auto: {fast_dtype('cpu')} (" in done.stderr
    assert "quantization auto: gguf (the GGUF's blocks as stored)" in done.stderr


def test_bad_field_exits_2_naming_it():
    done = _run("generate", "hi", "--top-p", "1.5")
    assert done.returncode == 2
    assert "top_p" in done.stderr
    assert done.stdout == ""


def test_generate_serves_the_gguf_files_own_blocks() -> None:
    engine = LLMEngine(EngineConfig(quantization="gguf", dtype="float32", kv_cache_gb=0.05))
    expected = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    done = _run(
        "generate", "The capital of France is", "--max-tokens", "8", "--quantization", "gguf",
        "--dtype", "float32", "--kv-cache-gb", "0.05",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected[0].text + "\n"
    assert "quantization gguf" in done.stderr and "MiB resident" in done.stderr


def test_a_mode_the_model_cannot_take_exits_2_naming_the_field(tiny_llama_dir: Path) -> None:
    done = _run("generate", "hi", "--model", str(tiny_llama_dir), "--quantization", "gguf")
    assert done.returncode == 2
    assert "quantization: gguf:" in done.stderr


def test_plan_capacity_reads_a_model_file_and_measures_this_machine(tmp_path: Path) -> None:
    import os

    from cluster.engine.model.model_files import bundled_model_path

    done = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "plan", "capacity", "--model",
         str(bundled_model_path()), "--hardware", "this", "--measure", "--measure-budget-s",
         "5", "--kv-cache-gb", "1", "--kv-dtype", "float32"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "0.135B parameters" in done.stdout and "this machine" in done.stdout
    assert f"{SHORT_DTYPE[fast_dtype('cpu')]} TFLOP/s" in done.stdout  # the fast dtype here
    assert "1 GiB holds 1456 pages = 23296 tokens" in done.stdout  # the engine's own figure
    assert (tmp_path / "splitserve" / "hardware.json").is_file()  # cached for next time
