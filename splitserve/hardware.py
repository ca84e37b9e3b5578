"""Hardware profiles for `splitserve plan`: memory, its bandwidth, dense bf16 compute.

Named GPUs carry their published figures (SXM parts; dense, not sparse, FLOP/s). `this`
is measured on this machine in a few seconds (`measure`) and cached.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gb: float  # device memory, 10^9 bytes
    bandwidth_gb_s: float  # memory read bandwidth, 10^9 bytes/s
    bf16_tflops: float  # dense bf16 matmul peak, 10^12 FLOP/s

    @property
    def ridge_flop_per_byte(self) -> float:
        """Arithmetic intensity past which a step is compute-bound, not memory-bound."""
        return self.bf16_tflops * 1e12 / (self.bandwidth_gb_s * 1e9)


GPUS = {
    "A100-40GB": Hardware("A100-40GB", 40, 1555, 312),
    "A100": Hardware("A100", 80, 2039, 312),
    "H100": Hardware("H100", 80, 3350, 989),
    "H200": Hardware("H200", 141, 4800, 989),
    "L40S": Hardware("L40S", 48, 864, 362),
    "B200": Hardware("B200", 192, 8000, 2250),
}


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "splitserve" / "hardware.json"


def measure(cache: Path | None = None, refresh: bool = False) -> Hardware:
    """This machine: read bandwidth (torch.sum over 1 GiB, best of 3) and bf16 matmul
    throughput (2048^3, best of 5), with torch's threads; cached in `cache`."""
    path = cache or cache_path()
    if path.is_file() and not refresh:
        return Hardware(**json.loads(path.read_text()))
    import torch

    buf = torch.arange(2**28, dtype=torch.float32)  # 1 GiB, no two pages alike
    buf.sum()
    read_s = min(_timed(buf.sum) for _ in range(3))
    del buf
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    a @ a
    mm_s = min(_timed(lambda: a @ a) for _ in range(5))
    found = Hardware(
        "this machine",
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        2**30 / read_s / 1e9,
        2 * 2048**3 / mm_s / 1e12,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(found)))
    return found


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
