"""scripts/gpu-first-run --dry-run: the GPU first run's every step, on the CPU at tiny
sizes, runs to its end and writes its figures to one file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_every_step_and_logs_to_one_file(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        [ROOT / "scripts" / "gpu-first-run", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    log = (tmp_path / "log.txt").read_text()
    assert run.returncode == 0, log[-3000:]
    assert [line.split()[2].rstrip(".") for line in log.splitlines() if line.startswith("===")] == [
        "0",
        "1",
        "2",
        "3",
        "4",
        "done:",
    ]
    assert "bfloat16 H8/KV2 D16" in log and "float32 H6/KV2 D16" in log
    assert log.count(" OK\n") == 2 and "WRONG" not in log
    assert "SKIPPED" not in log  # every module a step needs is installed here
    for test in (
        "test_paged_decode_matches_reference_on_a_ragged_batch",
        "test_add_rms_norm_adds_in_place_and_norms_the_sum",
        "test_cuda_greedy_matches_cpu",
        "test_cuda_graph_decode_matches_the_cpu_engine",
    ):
        assert test in log  # collected by the tests' step
    for figure in ("decode B1:", "decode B2:", "prefill 32:", "one decode step at batch 2"):
        assert figure in log
    assert log.rstrip().endswith("done: every step ran")
