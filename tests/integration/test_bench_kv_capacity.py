"""`splitserve bench kv-capacity` in small: one cache size, the model's KV dtype and int8,
one rate; the result file and its report."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.engine.model.checkpoint import read_spec
from cluster.engine.model.model_files import bundled_model_path
from splitserve.bench.kv_capacity import main, report
from splitserve.capacity import kv_capacity


def test_the_sweep_reports_peaks_beside_plan_capacity(tmp_path: Path) -> None:
    out = tmp_path / "kv-capacity.json"
    args = ["--kv-gb", "0.01", "--kv-dtypes", "auto,int8", "--rates", "8", "--requests", "2"]
    args += ["--prompt", "200-300", "--reply", "8-16"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    model, int8 = result["rows"]
    assert int8["kv_dtype"] == "int8" and model["kv_dtype"] in ("bfloat16", "float32")
    spec = read_spec(bundled_model_path())
    for row in result["rows"]:
        assert row["pages"] == kv_capacity(spec, row["kv_dtype"], 16, 0.01).pages
        [run] = row["runs"]
        assert run["rate"] == 8 and 1 <= run["peak_seqs"] <= 2 and run["preemptions"] >= 0
        assert row["predicted_held"] >= row["predicted_seqs"] >= 0
    assert int8["pages"] >= 1.95 * model["pages"]
    lines = report(result)
    assert lines[0] == result["host"] and len([x for x in lines if x.startswith("| 0.01 |")]) == 2
    assert lines[-2].startswith("target: peak_seqs within 10% of plan capacity's predicted_seqs")
