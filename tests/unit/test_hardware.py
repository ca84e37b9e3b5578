"""`plan --measure` on this machine: bounded by its budget (a fake clock makes each timed
call look slow), in this CPU's fast dtype, and cached per CPU."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

from cluster.engine.kernels.cpu_isa import fast_dtype
from splitserve.hardware import Hardware, matmul_tflops, measure


def _ticking(step_s: float):  # type: ignore[no-untyped-def]
    """A clock that moves `step_s` each time it is read."""
    ticks = itertools.count()
    return lambda: next(ticks) * step_s


def test_a_slow_machine_stops_at_the_budget_and_says_so(tmp_path: Path) -> None:
    said: list[str] = []
    hw = measure(8.0, tmp_path / "hw.json", clock=_ticking(1.0), say=said.append)
    assert hw.name == "this machine" and hw.compute_dtype == fast_dtype("cpu")
    assert hw.bandwidth_gb_s > 0 and hw.tflops > 0 and hw.memory_gb > 0
    assert len(said) == 2
    assert said[0].startswith("bandwidth: 1 of 3 reads within its 2 s share")
    assert said[1].startswith(f"matmul: stopped at 256x256 ({fast_dtype('cpu')})")


def test_the_matmul_grows_while_the_next_size_fits() -> None:
    # Every clock read is 1 ms on: each run takes 1 ms, a size's two runs and its check
    # 5 ms, and the next size's two runs are guessed at 16 ms. After 256 the check reads
    # 5 + 16 ms, after 512 10 + 16 ms (within 28 ms), after 1024 15 + 16 ms: it stops.
    tflops, size = matmul_tflops("float32", 0.028, _ticking(0.001))
    assert size == 1024 and tflops > 0
    assert matmul_tflops("float32", 1e9, _ticking(0.001))[1] == 2048


def test_the_cache_serves_this_cpu_and_is_remeasured_for_another(tmp_path: Path) -> None:
    path = tmp_path / "hw.json"
    first = measure(8.0, path, clock=_ticking(1.0), say=lambda _: None)
    assert measure(8.0, path, say=lambda _: None) == first  # no clock read: from the cache
    fake = Hardware("this machine", 1.0, 1.0, 1.0, "float32")
    path.write_text(json.dumps({"cpu": "another CPU", "hardware": dataclasses.asdict(fake)}))
    assert measure(8.0, path, clock=_ticking(1.0), say=lambda _: None) != fake
    path.write_text(json.dumps({"name": "an older format", "bf16_tflops": 1}))
    assert measure(8.0, path, clock=_ticking(1.0), say=lambda _: None).tflops > 0
