"""Hardware profiles for `splitserve plan`: memory, its bandwidth, dense matmul compute.

Named GPUs carry their published figures (SXM parts; dense bf16, not sparse, FLOP/s).
`this` is measured on this machine within a time budget (`measure`), in the dtype that is
fast on its CPU, and cached per CPU model and flags (hosts of one kind change CPU).
`python -m splitserve.hardware` prints the one line that says which host a figure or a
test run came from.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.engine.kernels.cpu_isa import cpu, fast_dtype, isa

Clock = Callable[[], float]


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float  # device memory, 10^9 bytes
    bandwidth_gb_s: float  # memory read bandwidth, 10^9 bytes/s
    tflops: float  # dense matmul peak in compute_dtype, 10^12 FLOP/s
    compute_dtype: str = "bfloat16"

    @property
    def ridge_flop_per_byte(self) -> float:
        """Arithmetic intensity past which a step is compute-bound, not memory-bound."""
        return self.tflops * 1e12 / (self.bandwidth_gb_s * 1e9)


GPUS = {
    "A100-40GB": Hardware("A100-40GB", 40, 1555, 312),
    "A100": Hardware("A100", 80, 2039, 312),
    "H100": Hardware("H100", 80, 3350, 989),
    "H100 PCIe": Hardware("H100 PCIe", 80, 2000, 756),
    "H100 NVL": Hardware("H100 NVL", 94, 3900, 835),
    "H200": Hardware("H200", 141, 4800, 989),
    "L40S": Hardware("L40S", 48, 864, 362),
    "B200": Hardware("B200", 180, 8000, 2250),
}


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "splitserve" / "hardware.json"


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def measure(
    budget_s: float,
    cache: Path | None = None,
    refresh: bool = False,
    clock: Clock = time.perf_counter,
    say: Callable[[str], None] = _say,
) -> Hardware:
    """This machine: read bandwidth (torch.sum over 512 MiB, best of up to 3) and matmul
    throughput in the CPU's fast dtype (square matrices growing from 256 to 2048 while the
    next size fits the budget), with torch's threads. A quarter of `budget_s` goes to the
    bandwidth, the rest to the matmul; a part that stops short says so through `say`.
    Cached in `cache` for this CPU (model and flags)."""
    path = cache or cache_path()
    host = _host_key()
    if path.is_file() and not refresh:
        try:
            stored = json.loads(path.read_text())
            if stored.get("cpu") == host:
                return Hardware(**stored["hardware"])
        except (ValueError, TypeError, KeyError, AttributeError):
            pass  # an older or foreign cache: measure again
    dtype = fast_dtype("cpu")
    bandwidth, reads = read_gb_s(budget_s / 4, clock)
    tflops, size = matmul_tflops(dtype, budget_s * 3 / 4, clock)
    if reads < 3:
        say(f"bandwidth: {reads} of 3 reads within its {budget_s / 4:g} s share; the best kept")
    if size < 2048:
        say(
            f"matmul: stopped at {size}x{size} ({dtype}) to stay within "
            f"{budget_s * 3 / 4:g} s; the figure may be low"
        )
    found = Hardware(
        "this machine",
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        bandwidth,
        tflops,
        dtype,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": host, "hardware": asdict(found)}))
    return found


def read_gb_s(budget_s: float, clock: Clock = time.perf_counter) -> tuple[float, int]:
    """Read bandwidth in GB/s: the best of up to 3 sums over 512 MiB (no two pages alike),
    fewer when the next would pass `budget_s`; and how many ran."""
    import torch

    start = clock()
    buf = torch.arange(2**27, dtype=torch.float32)
    buf.sum()  # touched once: page faults are not bandwidth
    best, reads = float("inf"), 0
    while reads < 3:
        took = _timed(buf.sum, clock)
        best, reads = min(best, took), reads + 1
        if clock() - start + took > budget_s:
            break
    return buf.nbytes / best / 1e9, reads


def matmul_tflops(
    dtype: str, budget_s: float, clock: Clock = time.perf_counter
) -> tuple[float, int]:
    """The best dense matmul throughput in TFLOP/s over square sizes 256, 512, ..., 2048 (two
    runs each, the first warming up), and the largest size run: growth stops when the next
    size's two runs (8x the last one's each) would pass `budget_s`."""
    import torch

    start, best, n = clock(), 0.0, 256
    while True:
        a = torch.randn(n, n, dtype=getattr(torch, dtype))
        square = lambda a=a: a @ a
        took = min(_timed(square, clock) for _ in range(2))
        best = max(best, 2 * n**3 / max(took, 1e-9) / 1e12)
        if n == 2048 or clock() - start + 16 * took > budget_s:
            return best, n
        n *= 2


def _timed(fn: Callable[[], object], clock: Clock) -> float:
    start = clock()
    fn()
    return clock() - start


def _host_key() -> str:
    model, flags = cpu()
    return f"{model} | {isa(flags)} | {os.cpu_count()} cores"


def host_line() -> str:
    """Which host this is: CPU model, vector ISA, cores, memory and read bandwidth (a
    half-second measurement)."""
    model, flags = cpu()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    bandwidth, _ = read_gb_s(0.5)
    return (
        f"host: {model}; ISA {isa(flags)}; {os.cpu_count()} cores; {memory:.0f} GiB; "
        f"read {bandwidth:.0f} GB/s; fast dtype {fast_dtype('cpu', flags)}"
    )


if __name__ == "__main__":
    print(host_line())
