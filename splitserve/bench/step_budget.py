"""What one engine step costs the host: PyTorch ops dispatched, Triton kernel launches,
CUDA-graph replays, and host syncs (the device must finish before the host goes on).

A sync is a read of device values by the host: `.item()` and friends (PyTorch's
`_local_scalar_dense`), `.tolist()`, `.cpu()`, `.numpy()`, and ops whose output size
depends on values (`nonzero`, boolean-mask indexing). Counted by what the code asks
for, so the count is the same when the step runs on a CPU tensor as on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select")
SYNC_METHODS = ("tolist", "cpu", "numpy")


@dataclass
class Budget:
    ops: int = 0  # PyTorch ops dispatched outside Triton kernels
    launches: int = 0  # Triton kernel launches
    replays: int = 0  # CUDA-graph replays
    syncs: list[str] = field(default_factory=list)  # what synced, in order


class _Ops(TorchDispatchMode):
    def __init__(self, budget: Budget, in_kernel: list[bool]) -> None:
        super().__init__()
        self.budget = budget
        self.in_kernel = in_kernel

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.in_kernel[0]:  # the interpreter's own tensor shuffling is not ours
            self.budget.ops += 1
            name = str(func)
            boolean_index = name.startswith("aten.index.Tensor") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
            )
            if name.startswith(SYNC_OPS) or boolean_index:
                self.budget.syncs.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def counting() -> Iterator[Budget]:
    """Count what runs inside the block (one thread; patches classes while it runs)."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    budget = Budget()
    in_kernel = [False]
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrap(getattr(owner, name)))

    def launch(run: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            budget.launches += 1
            in_kernel[0] = True
            try:
                return run(*args, **kwargs)
            finally:
                in_kernel[0] = False

        return counted

    def sync(name: str) -> Callable[[Any], Any]:
        def wrap(method: Any) -> Any:
            def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if not in_kernel[0]:
                    budget.syncs.append(name)
                return method(self, *args, **kwargs)

            return counted

        return wrap

    def replay(method: Any) -> Any:
        def counted(self: Any) -> Any:
            budget.replays += 1
            return method(self)

        return counted

    patch(jit.JITFunction, "run", launch)
    patch(interpreter.InterpretedFunction, "run", launch)
    for name in SYNC_METHODS:
        patch(torch.Tensor, name, sync(name))
    patch(torch.cuda.CUDAGraph, "replay", replay)
    try:
        with _Ops(budget, in_kernel):
            yield budget
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
