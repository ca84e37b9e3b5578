"""What every test module shares: Triton's interpreter without a GPU, the device kernels
run on, and memory handed back between modules."""

import ctypes
import gc
import os
import sys
from collections.abc import Iterator

import pytest
import torch

# Set before any test module imports Triton: without a GPU its kernels run under Triton's
# interpreter on CPU tensors. A kernel module imported before this was set would keep
# compiled-mode helpers, which the interpreter cannot call.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where a kernel test's tensors live: the GPU when there is one (compiled Triton refuses
    CPU tensors there), else the CPU (Triton's interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--nightly", action="store_true", help="also run the nightly tier (marked nightly)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--nightly"):
        return
    later = pytest.mark.skip(reason="nightly tier: `scripts/test --nightly` runs it")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(later)


@pytest.fixture(autouse=True, scope="module")
def _return_freed_memory() -> Iterator[None]:
    """After each module, hand the memory its engines and models freed back to the OS:
    glibc keeps freed heap for reuse, and one pytest process runs every module's
    in-process engines (without this it passed 10 GB and Ray's OOM killer took workers)."""
    yield
    gc.collect()
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
