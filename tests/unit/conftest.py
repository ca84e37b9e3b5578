"""What the unit tests of `splitserve serve`'s start-up share. The cluster is imported where a
fixture needs it: the kernel tests collect on a GPU image without Ray, Redis or gRPC
(scripts/gpu-first-run)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What reached the start of Redis, Ray and the workers (a refused start: nothing)."""
    import splitserve.launch

    calls: list[Any] = []

    async def _serve(config: Any) -> None:
        calls.append(config)

    monkeypatch.setattr(splitserve.launch, "_serve", _serve)
    return calls


@pytest.fixture(params=["native", "haswell"], ids=["this-cpu", "avx2"])
def build(request: pytest.FixtureRequest) -> Any:
    """paged_attention.c built for this CPU, and for AVX2 alone (its other vector width)."""
    from cluster.engine.kernels import attention_cpu, native
    from cluster.engine.kernels.cpu_isa import cpu

    if request.param == "haswell" and not {"avx2", "fma", "f16c"} <= cpu()[1]:
        pytest.skip("this CPU cannot run an AVX2 build")
    lib = native.library("paged_attention.c", request.param)
    if lib is None:
        pytest.skip(f"no {request.param} build of paged_attention.c here")
    return attention_cpu.bind(lib)
