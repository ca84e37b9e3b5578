"""Benchmarks: `splitserve bench KIND` (or `python -m splitserve.bench.offline` and the like).

Each writes its JSON where `--out` says, by default under RESULTS: a path relative to the
directory it runs in, never into the installed package."""

from pathlib import Path

RESULTS = Path("bench-results")
