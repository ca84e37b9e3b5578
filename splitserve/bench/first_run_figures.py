"""What the first run's steps share (splitserve/bench/first_run.py): the figures file, one
JSON line a figure, and how a step times a call and compares it with a ceiling."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

FIGURES = "figures.jsonl"


class Figures:
    """One step's figures: each appended to OUT/figures.jsonl as one JSON line (flushed, so a
    step killed by its timeout keeps what it measured) and printed."""

    def __init__(self, out: Path, step: str, dry: bool, deadline: float) -> None:
        self.out, self.step, self.dry = out, step, dry
        self.deadline = deadline  # time.monotonic()'s, a little before the step's limit
        out.mkdir(parents=True, exist_ok=True)

    def add(self, figure: str, **values: Any) -> None:
        line = json.dumps({"step": self.step, "figure": figure, **values}, default=str)
        with (self.out / FIGURES).open("a") as f:
            f.write(line + "\n")
        print(line, flush=True)

    @contextmanager
    def each(self, figure: str) -> Iterator[None]:
        """One figure's own try: an exception is written as that figure's error."""
        try:
            yield
        except Exception as e:
            traceback.print_exc()
            self.add(figure, error=f"{type(e).__name__}: {e}"[:2000])

    def measured(self, figure: str, key: str) -> float | None:
        """A value an earlier step measured (the ceilings), None if it has none."""
        for line in read_figures(self.out):
            if line.get("figure") == figure and key in line:
                return float(line[key])
        return None


def read_figures(out: Path) -> list[dict[str, Any]]:
    path = out / FIGURES
    if not path.is_file():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            lines.append({"step": "?", "figure": "?", "error": f"unreadable line {text[:80]!r}"})
    return lines


def device_of(dry: bool) -> torch.device:
    return torch.device("cpu" if dry else "cuda")


def seconds_per_call(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The mean time of `repeats` calls after one warm-up: CUDA events on a GPU."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return begin.elapsed_time(end) / 1e3 / repeats


def published(device: torch.device) -> Any:
    """The device's published figures (splitserve.hardware), None where unknown or a CPU."""
    if device.type != "cuda":
        return None
    from splitserve.bench.gpu import profile_of

    return profile_of(torch.cuda.get_device_name(device), torch.cuda.mem_get_info(device)[1])


def share(value: float, ceiling: float | None) -> float | None:
    return None if not ceiling else round(value / ceiling, 4)
