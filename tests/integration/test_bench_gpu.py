"""`splitserve bench gpu --dry-run`: the GPU benchmark's own code, run on the CPU at tiny
sizes, reports every figure it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


# Nightly: ~50 s of Triton's interpreter, for CI's time (issue 26); the kernels it times
# stay tested in every run (test_engine_triton.py, test_gpu_first_run.py's dry run).
@pytest.mark.nightly
def test_bench_gpu_dry_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    # Its own process: the dry run turns on Triton's interpreter before triton loads.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "bench", "gpu", "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["greedy"]["attention"] == "triton" and results["greedy"]["equal"]
    assert [(d["model"], d["batch"]) for d in results["decode"]] == [("tiny", 1), ("tiny", 2)]
    assert all(d["tokens_s"] > 0 for d in results["decode"])
    assert results["prefill"][0]["tflops"] > 0
    (budget,) = results["budget"]
    assert budget["syncs"] == ["tolist"] and budget["launches"] == 3 * 2  # 2 layers
    assert results["transfer_gbps"] > 0
    for line in ("attention kernel: triton", "% HBM roofline", "TFLOP/s", "host syncs", "NIXL"):
        assert line in run.stdout
