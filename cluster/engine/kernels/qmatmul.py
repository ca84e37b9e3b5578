"""y = x @ w.T for 4-bit and 8-bit weight groups on the CPU's byte dot products
(qmatmul.c, built by native.py): the groups packed in its bands of 16 rows, the inputs
rounded per group as it does. It needs AVX-512 VNNI or AVX2; elsewhere `available()` is
False and quantization.Int4Linear multiplies with torch's int4 kernel.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from cluster.engine.kernels import native

GROUP = 32
BAND = 16  # output rows a band interleaves (qmatmul.c)
ISA = {2: "AVX-512 VNNI", 1: "AVX2"}  # qmatmul_isa()'s answers, 0: none


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A built qmatmul.c with its signatures."""
    lib.qmatmul.restype = ctypes.c_int
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.qmatmul.argtypes = [ptr, flag, i64, i64, ptr, i64, flag, ptr, flag]
    lib.qmatmul_isa.restype = ctypes.c_int
    return lib


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """qmatmul.c built for this CPU, where it has an instruction set for it; else None."""
    lib = native.library("qmatmul.c")
    return None if lib is None or not bind(lib).qmatmul_isa() else lib


def available() -> bool:
    return kernel() is not None


def describe() -> str:
    """What multiplies quantized weights on this host, for the start-up line."""
    lib = kernel()
    return "torch's int4 kernel" if lib is None else f"our {ISA[lib.qmatmul_isa()]} kernel"


def pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int) -> torch.Tensor:
    """Groups [rows, cols] (q: uint8 0..15 for 4 bits, int8 for 8) with float32 scale and
    offset [rows, cols / GROUP] as qmatmul.c's bands: [bands, bytes] uint8. Scales and
    offsets become float16 (GGUF stores its own so: exact for them)."""
    rows, cols = q.shape
    groups = cols // GROUP
    halves = torch.stack([scale, offset], 1).to(torch.float16)  # [rows, 2, groups]
    if not bool(halves.isfinite().all()):
        raise OverflowError("a group's scale or offset is beyond float16")
    bands = -(-rows // BAND)
    pad = bands * BAND - rows
    halves = F.pad(halves, (0, 0, 0, 0, 0, pad))
    q = F.pad(q, (0, 0, 0, pad)).view(bands, BAND, groups, GROUP)
    head = [halves.view(bands, BAND, 2, groups).permute(0, 3, 2, 1)]  # [bands, groups, 2, 16]
    if bits == 8:
        qsum = q.sum(-1, dtype=torch.int32)  # [bands, 16, groups]
        head.append(qsum.permute(0, 2, 1).unsqueeze(2))  # [bands, groups, 1, 16]
    else:
        q = q[..., :16] | (q[..., 16:] << 4)  # [bands, 16, groups, 16]
    header = [h.contiguous().view(torch.uint8).reshape(bands, groups, -1) for h in head]
    parts = q.view(torch.uint8).reshape(bands, BAND, groups, -1, 4).permute(0, 2, 3, 1, 4)
    body = parts.reshape(bands, groups, -1)  # [bands, groups, parts * 16 lanes * 4]
    return torch.cat([*header, body], -1).reshape(bands, -1).contiguous()


def matmul(
    x: torch.Tensor, packed: torch.Tensor, rows: int, bits: int, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [n, cols] @ w.T of `pack`'s bands of a matrix of `rows` rows: [n, rows] in x's dtype
    (float32 or bfloat16, converted in the kernel; another is computed as float32), on
    `lib` (a build of qmatmul.c; this CPU's by default)."""
    lib = lib or kernel()
    assert lib is not None
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    x = x.to(dtype).contiguous()
    n, cols = x.shape
    y = torch.empty(n, rows, dtype=dtype)
    bf16 = int(dtype == torch.bfloat16)
    if lib.qmatmul(x.data_ptr(), bf16, n, cols, packed.data_ptr(), rows, bits, y.data_ptr(), bf16):
        raise MemoryError(f"qmatmul: no scratch memory for {n} x {cols} inputs")
    return y
