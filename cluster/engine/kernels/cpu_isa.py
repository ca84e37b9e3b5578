"""What this host's CPU computes fast: its instruction-set extensions (from /proc/cpuinfo)
and the activation dtype that follows from them.

bfloat16 is fast on a CPU only with native bf16 arithmetic (x86: AVX512_BF16 or AMX-BF16;
Arm: the BF16 extension). Elsewhere torch emulates it, and the bundled model decodes ~6x
slower than in float32 (an AVX2-only EPYC: 2 vs 13 tok/s), so float32 is the fast choice
there. Hosts of one kind differ in ISA from day to day: anything that picks a dtype for
speed (a measurement, a benchmark's default) asks `fast_dtype`, never assumes one.
"""

from __future__ import annotations

import functools
from pathlib import Path

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 (AVX-512, AMX); Arm


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of the first processor in a /proc/cpuinfo text."""
    model, flags = "unknown CPU", frozenset[str]()
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and model == "unknown CPU":
            model = value
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


@functools.cache
def cpu() -> tuple[str, frozenset[str]]:
    """This host's CPU model and flags; an unknown CPU with no flags off Linux."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return "unknown CPU", frozenset()


def native_bf16(flags: frozenset[str]) -> bool:
    return bool(flags & BF16_FLAGS)


def fast_dtype(device: str, flags: frozenset[str] | None = None) -> str:
    """The faster activation dtype on `device` ("cpu" or "cuda"): bfloat16 on a GPU and on a
    CPU with native bf16 arithmetic, float32 on any other CPU."""
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if native_bf16(cpu()[1] if flags is None else flags) else "float32"


def isa(flags: frozenset[str]) -> str:
    """The vector extensions that decide speed here, as docs/benchmarks.md's figures name them:
    the AVX-512 and AMX flags, or the best of AVX2/AVX/SSE when there are none."""
    wide = sorted(f for f in flags if f.startswith(("avx512", "amx")))
    if wide:
        return " ".join(wide)
    narrow = next((f for f in ("avx2", "avx", "sse4_2", "asimd") if f in flags), "no SIMD flag")
    return f"{narrow} (no AVX-512)" if narrow.startswith(("avx", "sse")) else narrow
