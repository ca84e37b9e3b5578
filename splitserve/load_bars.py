"""The weights' loading of the workers `serve` is starting, as bars on one terminal line.

Each worker's engine reports the checkpoint tensors it has read (cluster/role_worker.py);
the pool that awaits the worker passes them here. On a terminal the line is redrawn in
place and cleared before the pool logs the worker ready; anywhere else nothing is drawn
(the log lines say when each worker starts and is ready).
"""

from __future__ import annotations

import sys
from typing import TextIO

WIDTH = 20  # characters of one bar


def render(loading: dict[str, tuple[int, int]], columns: int) -> str:
    """One line: each worker's name, bar and share of its tensors read, cut to `columns`."""
    parts = []
    for name, (done, total) in loading.items():
        share = done / total if total else 0.0
        filled = round(share * WIDTH)
        parts.append(f"{name} [{'=' * filled}{' ' * (WIDTH - filled)}] {share:4.0%}")
    return ("loading weights: " + "  ".join(parts))[:columns]


class LoadBars:
    def __init__(self, stream: TextIO, columns: int = 120) -> None:
        self.stream = stream
        self.on = stream.isatty()
        self.columns = columns
        self.loading: dict[str, tuple[int, int]] = {}

    def update(self, name: str, done: int, total: int) -> None:
        if self.on and self.loading.get(name) != (done, total):
            self.loading[name] = (done, total)
            self.stream.write("\r\033[K" + render(self.loading, self.columns))
            self.stream.flush()

    def finish(self, name: str) -> None:
        """`name` is loaded: its bar goes, and the line is cleared for a log line."""
        if self.loading.pop(name, None) is not None:
            self.stream.write("\r\033[K")
            self.stream.flush()


BARS = LoadBars(sys.stderr)  # the terminal `serve` runs in: one line for every pool
