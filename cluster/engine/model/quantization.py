"""Weight quantization: how each matrix of the model is stored and multiplied.

`engine.quantization` picks one mode per model at load:

- `none`: float weights in the engine dtype, stored [in, out] (`x @ w`).
- `int8`: weight-only, groups of 32 inputs, asymmetric: w = q * scale + offset, q in
  -128..127 spanning the group's min..max, quantized at load from any float checkpoint.
- `int4`: the same with q in 0..15 (GGUF's Q4_1); the embedding and lm_head stay int8.
- `gguf`: the GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks as stored; its float tensors stay
  float. The served model is the file's, not a float copy of it.
- `awq`, `gptq`: a checkpoint directory's own 4-bit groups as stored (checkpoint_quant.py);
  the vocabulary matrices 8-bit as in int4.
- `fp8`: a checkpoint directory's FP8 weights: on the CPU dequantized at load and stored
  as int8; on a GPU with FP8 tensor cores kept as e4m3 codes with a scale per output row
  (`Fp8Rows`) and multiplied by an FP8 GEMM (`Fp8Linear`).

Where the CPU has AVX-512 VNNI or AVX2, our integer kernel multiplies every quantized
matrix (cluster/engine/kernels/qmatmul.c, `BlockLinear`): each input row is rounded per group of
32 to int8 steps (as llama.cpp does) plus int8 remainders, and the groups' dot products are
the CPU's byte dot products; measured 1.3-4x faster than torch's int4 kernel on the bundled
model's shapes at 1, 16 and 256 rows (docs/benchmarks.md). Elsewhere (or with no C compiler)
PyTorch's `_weight_int4pack_mm_for_cpu` (chosen by measurement over `_weight_int8pack_mm`, fbgemm
dynamic int8 and bfloat16 on the model's shapes; docs/engine.md) multiplies them
(`Int4Linear`); there each group of 32 weights reads w = (q4 - 8) * s + z.
A 4-bit group is one such matrix. An 8-bit group is exactly two: q = 16 * hi + lo with
hi = q >> 4 in -8..7 and lo = q & 15, so w = 16 s hi + s lo: the same bytes as int8, and
no float copy of the weights anywhere. The kernel takes bfloat16 activations and
bfloat16 scales: activations are cast around it (float32 engines), and a block's float16
scale is rounded to bfloat16 (a relative 2^-9, far under the quantization step itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cluster.engine.kernels import qmatmul

GROUP = 32  # weights per scale, along the input dimension
# How each mode stores a float matrix (fp8: a checkpoint's FP8 weights, dequantized); the
# modes absent keep it float (none; gguf, awq and gptq keep their own quantized matrices).
FLOAT_STORED_AS = {"int8": "int8", "int4": "int4", "fp8": "int8"}
KERNEL_DTYPE = torch.bfloat16  # what the int4 kernel computes in
E4M3_MAX = 448.0  # the largest float8_e4m3fn


class QuantizationError(ValueError):
    """A model or tensor cannot be served in the requested quantization mode."""


@dataclass(frozen=True)
class GroupQuant:
    """A quantized matrix [rows = outputs, cols = inputs]: w = q * scale + offset per group.

    `bits` 4: q is uint8 in 0..15; 8: q is int8 in -128..127. scale and offset are float32
    [rows, cols // GROUP]. Rows can be concatenated (qkv) and permuted (RoPE layouts).
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    # The inputs in the order its groups run (GPTQ's act-order): it multiplies x[:, perm].
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized to float32 (an embedding lookup)."""
        q = self.q[ids].float().unflatten(-1, (-1, GROUP))
        w = q * self.scale[ids].unsqueeze(-1) + self.offset[ids].unsqueeze(-1)
        return w.flatten(-2)

    def dequantize(self) -> torch.Tensor:
        """The matrix [out, in] in its inputs' own order."""
        w = self.rows(torch.arange(self.q.shape[0]))
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm, w)

    def as_8bit(self) -> GroupQuant:
        """The same weights as 8-bit groups, exactly: q4 * s + o = (q4 - 8) * s + (o + 8 s)."""
        if self.bits == 8:
            return self
        q = (self.q.to(torch.int16) - 8).to(torch.int8)
        return GroupQuant(q, self.scale, self.offset + 8 * self.scale, 8, self.perm)

    @staticmethod
    def cat(parts: list[GroupQuant]) -> GroupQuant:
        """Matrices stacked by rows; mixed widths are all widened to 8 bits (exactly). Their
        inputs must run in one order (no act-order: `stackable`)."""
        assert stackable(parts), "matrices of differently ordered inputs do not stack"
        if len({p.bits for p in parts}) > 1:
            parts = [p.as_8bit() for p in parts]
        return GroupQuant(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]),
            parts[0].bits,
        )


def stackable(parts: Sequence[torch.Tensor | GroupQuant | Fp8Rows]) -> bool:
    """Whether matrices can be stacked by rows into one: none reorders its inputs."""
    return all(not isinstance(p, GroupQuant) or p.perm is None for p in parts)


def quantize(w: torch.Tensor, mode: str) -> GroupQuant:
    """Quantize a float matrix [out, in] group-wise (`int8` or `int4`), round to nearest."""
    rows, cols = w.shape
    if cols % GROUP:
        raise QuantizationError(f"{cols} inputs is not a multiple of the group size {GROUP}")
    g = w.float().view(rows, cols // GROUP, GROUP)
    if mode not in ("int8", "int4"):
        raise QuantizationError(f"no float quantization mode {mode!r} (int8 or int4)")
    levels = 255 if mode == "int8" else 15
    low, high = g.amin(-1), g.amax(-1)
    scale = (high - low) / levels
    steps = ((g - low.unsqueeze(-1)) / scale.clamp(min=1e-12).unsqueeze(-1)).round()
    steps = steps.clamp(0, levels).view(rows, cols)
    if mode == "int4":
        return GroupQuant(steps.to(torch.uint8), scale, low, 4)
    return GroupQuant((steps - 128).to(torch.int8), scale, low + 128 * scale, 8)


# --- GGUF blocks ---------------------------------------------------------------------------

# bytes per block of 32 weights; every block begins with a float16 scale d
GGUF_BLOCKS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def from_gguf_blocks(kind: str, raw: np.ndarray, rows: int, cols: int) -> GroupQuant:
    """A GGUF Q4_0 / Q4_1 / Q8_0 tensor's raw blocks [rows, bytes] as a GroupQuant, exactly:
    Q4_0 w = d (q - 8); Q4_1 w = d q + m; Q8_0 w = d q. 4-bit blocks hold weights 0..15 in
    the low nibbles of their 16 bytes and 16..31 in the high nibbles."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, GGUF_BLOCKS[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return _group_quant(q, d, np.zeros_like(d), 8)
    start = 2 if kind == "Q4_0" else 4
    nibbles = blocks[..., start:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    if kind == "Q4_0":
        return _group_quant(q, d, -8 * d, 4)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return _group_quant(q, d, m, 4)


def _group_quant(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int) -> GroupQuant:
    return GroupQuant(
        torch.from_numpy(np.ascontiguousarray(q)),
        torch.from_numpy(np.ascontiguousarray(scale)),
        torch.from_numpy(np.ascontiguousarray(offset)),
        bits,
    )


@dataclass(frozen=True)
class Fp8Rows:
    """An FP8 matrix [out, in] as an FP8 GEMM reads it: e4m3 codes and one float32 scale
    per output row, w = codes * scale (a checkpoint's scale per tensor or row as it is;
    its 128 x 128 blocks' re-rounded to rows at load: checkpoint_quant.fp8_rows)."""

    codes: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    @staticmethod
    def cat(parts: Sequence[Fp8Rows]) -> Fp8Rows:
        """Matrices stacked by rows (q, k and v as one): their rows and scales in order."""
        return Fp8Rows(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))


def fp8_rows(w: torch.Tensor) -> Fp8Rows:
    """A float matrix [out, in] rounded to e4m3 under a scale per row (its largest at 448)."""
    scale = w.float().abs().amax(1).clamp(min=1e-12) / E4M3_MAX
    return Fp8Rows((w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale)


# --- the matrices a forward pass multiplies by -----------------------------------------------


class DenseLinear:
    """y = x @ w (+ bias), `w` [in, out]: stored transposed, which measured ~40% faster
    than F.linear for batch-1 decode on CPU; except bfloat16 on the CPU, stored [out, in]
    as the checkpoint has it (`w` a view), where a one-row product is torch.mv over those
    rows: 1.4-1.7x x @ w's speed at batch 1 (docs/benchmarks.md, bench experts)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.by_rows = w.dtype == torch.bfloat16 and w.device.type == "cpu"
        self.w = w.contiguous().t() if self.by_rows else w.t().contiguous()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.by_rows and x.shape[0] == 1:
            w = self.w.t()
            y = torch.mv(w, x[0]) if self.bias is None else torch.addmv(self.bias, w, x[0])
            return y.unsqueeze(0)
        return x @ self.w if self.bias is None else torch.addmm(self.bias, x, self.w)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.w] + ([] if self.bias is None else [self.bias])


class Int4Linear:
    """y = x @ w.T (+ bias) from 4-bit groups in the CPU kernel's packed layout; an 8-bit
    matrix is two 4-bit ones (module docstring). Holds no float copy of the weight."""

    def __init__(self, w: GroupQuant, bias: torch.Tensor | None) -> None:
        if w.bits == 4:
            parts = [(w.q.int(), w.scale, w.offset + 8 * w.scale)]
        else:
            q = w.q.int()
            hi, lo = (q >> 4) + 8, q & 15
            parts = [
                (hi, 16 * w.scale, torch.zeros_like(w.scale)),
                (lo, w.scale, w.offset + 8 * w.scale),
            ]
        self.parts = [
            (
                torch._convert_weight_to_int4pack_for_cpu(q4.contiguous(), 1),
                torch.stack([s, z], -1).transpose(0, 1).contiguous().to(KERNEL_DTYPE),
            )
            for q4, s, z in parts
        ]
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xk = x.to(KERNEL_DTYPE)
        packed, scales = self.parts[0]
        y = torch._weight_int4pack_mm_for_cpu(xk, packed, GROUP, scales)
        for packed, scales in self.parts[1:]:
            y += torch._weight_int4pack_mm_for_cpu(xk, packed, GROUP, scales)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def tensors(self) -> list[torch.Tensor]:
        held = [t for part in self.parts for t in part]
        return held + ([] if self.bias is None else [self.bias])


class BlockLinear:
    """y = x @ w.T (+ bias) on our integer kernel (qmatmul.c): the groups in its bands of 16
    rows, float16 scales and offsets; no float copy of the weight."""

    def __init__(self, w: GroupQuant, bias: torch.Tensor | None) -> None:
        self.packed = qmatmul.pack(w.q, w.scale, w.offset, w.bits)
        self.rows, self.bits = w.shape[0], w.bits
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = qmatmul.matmul(x, self.packed, self.rows, self.bits).to(x.dtype)  # bf16: a no-op
        return y if self.bias is None else y + self.bias

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.packed] + ([] if self.bias is None else [self.bias])


class Permuted:
    """y = inner(x[:, perm]): groups over inputs in another order (GPTQ's act-order)."""

    def __init__(self, perm: torch.Tensor, inner: BlockLinear | Int4Linear) -> None:
        self.perm, self.inner = perm, inner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.perm, *self.inner.tensors]


class Stacked:
    """Matrices that do not stack into one (act-order's, each its own input order), their
    outputs side by side as one stacked matrix's (+ bias)."""

    def __init__(self, parts: list[Linear], bias: torch.Tensor | None) -> None:
        self.parts, self.bias = parts, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias

    @property
    def tensors(self) -> list[torch.Tensor]:
        held = [t for p in self.parts for t in p.tensors]
        return held + ([] if self.bias is None else [self.bias])


class Fp8Linear:
    """y = x @ w.T (+ bias) on an FP8 GEMM (torch._scaled_mm: FP8 tensor cores on CUDA of
    compute capability 8.9 on, oneDNN on the CPU): each row of x rounded to e4m3 under its
    own scale, its largest value at 448 (dynamic per-token scales, as vLLM's FP8 W8A8), w
    as stored; the sums in float32, out in the activations' dtype."""

    def __init__(self, w: Fp8Rows, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.codes = w.codes
        self.scale = w.scale.float().view(1, -1)
        self.bias = bias
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        x_scale = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        codes = (rows / x_scale).to(torch.float8_e4m3fn)
        # CUDA's row-wise scaled GEMM writes bfloat16 only: a float32 engine's is widened
        out = torch.bfloat16 if self.codes.is_cuda else self.dtype
        y = torch._scaled_mm(
            codes, self.codes.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=out
        )
        y = y.to(self.dtype) if self.bias is None else y.to(self.dtype) + self.bias
        return y.reshape(*x.shape[:-1], -1)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale] + ([] if self.bias is None else [self.bias])


Linear = DenseLinear | Int4Linear | BlockLinear | Permuted | Stacked | Fp8Linear
Stored = torch.Tensor | GroupQuant | Fp8Rows  # a matrix as a checkpoint's weights give it


def linear(w: Stored, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
    """The matrix `w` [out, in] multiplied as it is stored: float (cast to `dtype`), FP8 rows
    on an FP8 GEMM, or groups, on our kernel where this CPU runs it, else on torch's (its
    inputs reordered first where its groups run in another order)."""
    if isinstance(w, Fp8Rows):
        return Fp8Linear(w, bias, dtype)
    if isinstance(w, GroupQuant):
        kernel: BlockLinear | Int4Linear | None = None
        if w.q.device.type == "cpu" and qmatmul.available():
            # a scale float16 cannot hold: torch's kernel keeps float32's
            with contextlib.suppress(OverflowError):
                kernel = BlockLinear(w, bias)
        kernel = kernel or Int4Linear(w, bias)
        return kernel if w.perm is None else Permuted(w.perm, kernel)
    return DenseLinear(w.to(dtype), bias)


class Embedding:
    """Token rows, looked up a few per step: float, or dequantized row by row from groups."""

    def __init__(self, table: torch.Tensor | GroupQuant, dtype: torch.dtype) -> None:
        self.table = table
        self.dtype = dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, GroupQuant):
            return self.table.rows(ids).to(self.dtype)
        return self.table[ids]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.table.shape[0], self.table.shape[1])

    @property
    def tensors(self) -> list[torch.Tensor]:
        t = self.table
        return [t.q, t.scale, t.offset] if isinstance(t, GroupQuant) else [t]
