"""A checkpoint's own quantization (its config.json's `quantization_config`), read into
the forms our kernels multiply, without re-quantizing where the form allows.

- `fp8` (FP8 Llama/Qwen/DeepSeek checkpoints): e4m3 weights with a scale per tensor (or
  per output row: `weight_scale`) or per 128 x 128 block (`weight_scale_inv`, multiplied
  despite its name). w = code * scale, dequantized at load; on the CPU the engine then
  stores it as its 8-bit groups. Kept (`keep`, a GPU's FP8 GEMM): the codes as stored with
  a scale per output row (`Fp8Rows`), a per-tensor scale repeated on each row; 128 x 128
  blocks' codes re-rounded to e4m3 under each row's scale (an FP8 GEMM takes one scale a
  row or a tensor; the second rounding is within e4m3's own step of the first).
  Activation scales (`input_scale`) are not read: on the CPU the activations stay float,
  as in our int8 mode; the FP8 GEMM scales each row of them itself (dynamic).
- `awq` (AutoAWQ's GEMM layout) and `gptq` (AutoGPTQ's, with and without its v1 zero
  offset): 4-bit codes packed eight to an int32, a float16 scale and a 4-bit zero per group
  of `group_size` inputs, w = (q - z) * s. A group of 128 is four of our groups of 32 with
  the same scale and zero, so the codes load as they are (`GroupQuant`, offset -z * s) into
  our int4 kernel; asked for float weights instead, they are dequantized.

GPTQ's act-order (`desc_act`: `g_idx` puts each input in a group of its own choosing)
loads the same way with the inputs sorted by group: the matrix multiplies x[:, perm]
(quantization.Permuted), q, k and v (gate and up) then each alone, as their orders differ.

A method, bit width or layout not listed is refused at load naming the key: its tensors
would otherwise be read as floats, wrong arithmetic reported as success.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cluster.engine.model.model_files import ModelLoadError
from cluster.engine.model.quantization import GROUP, Fp8Rows, GroupQuant, Stored, fp8_rows

if TYPE_CHECKING:
    from cluster.engine.model.checkpoint import Weights

METHODS = ("fp8", "awq", "gptq")
PACKED = ("awq", "gptq")  # 4-bit codes our int4 kernel reads as stored
KEPT = ("fp8", *PACKED)  # whose codes load as stored when asked (keep)
# AutoAWQ packs the eight outputs of a word in the order 0 2 4 6 1 3 5 7; this undoes it.
_AWQ_UNDO = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
Block = tuple[int, int]  # fp8: (outputs, inputs) under one scale


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # one of METHODS
    group_size: int = 0  # awq / gptq: inputs per scale; -1: one group a row
    block: Block | None = None  # fp8: one scale per block; None: per tensor or row
    zero_offset: int = 0  # gptq v1 stores each zero minus one


def read_quant_config(cfg: dict[str, Any], where: Path) -> CheckpointQuant | None:
    """The checkpoint's quantization as config.json's `cfg` states it (None: float weights);
    ModelLoadError naming the key for one this engine cannot read."""
    q = cfg.get("quantization_config")
    if q is None:
        return None

    def refuse(key: str, value: Any, serves: str) -> ModelLoadError:
        return ModelLoadError(
            f"{where}: quantization_config {key} {value!r} is not supported ({serves}); its "
            f"float checkpoint with quantization int8 or int4, or a GGUF of Q4_0 / Q4_1 / "
            f"Q8_0 blocks, serves"
        )

    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in METHODS:
        raise refuse("quant_method", method, f"read: {', '.join(METHODS)}")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise refuse("fmt", q.get("fmt"), "e4m3")
        block = q.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise refuse("weight_block_size", block, "[outputs, inputs]")
        return CheckpointQuant("fp8", block=None if block is None else (block[0], block[1]))
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise refuse("bits", bits, "4")
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    if group != -1 and (group < GROUP or group % GROUP):
        raise refuse("group_size", group, f"a multiple of {GROUP}, or -1")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse("version", version, "gemm")
        if not q.get("zero_point", True):
            raise refuse("zero_point", False, "true")
        return CheckpointQuant("awq", group)
    form = q.get("checkpoint_format", "gptq")
    if form not in ("gptq", "gptq_v2"):
        raise refuse("checkpoint_format", form, "gptq or gptq_v2")
    return CheckpointQuant("gptq", group, zero_offset=1 if form == "gptq" else 0)


def checkpoint_quant(directory: Path) -> CheckpointQuant | None:
    """The quantization a checkpoint directory's config.json states (None: none, or a file)."""
    config = directory / "config.json"
    if not config.is_file():
        return None
    return read_quant_config(json.loads(config.read_text()), config)


class Prequantized:
    """A quantized checkpoint's matrices under their float names (`...proj.weight`), kept
    (`keep`) as their codes are (awq / gptq: `GroupQuant`s, fp8: `Fp8Rows`), else
    dequantized to floats. A module the checkpoint left float (its lm_head, say) comes as
    it is."""

    def __init__(self, weights: Weights, quant: CheckpointQuant, keep: bool) -> None:
        self.weights, self.quant, self.keep = weights, quant, keep

    def __contains__(self, name: object) -> bool:
        if name in self.weights:
            return True
        return isinstance(name, str) and _packed(name) + "qweight" in self.weights

    def pop(self, name: str) -> Stored:
        base = _packed(name)
        if self.quant.method == "fp8":
            w = self._tensor(name)
            for key in ("weight_scale_inv", "weight_scale"):
                if base + key in self.weights:
                    scale = self._tensor(base + key)
                    if self.keep:
                        return fp8_kept(w, scale, self.quant.block)
                    return fp8_weight(w, scale, self.quant.block)
            return w  # left float
        if base + "qweight" not in self.weights:
            return self.weights.pop(name)
        qweight, qzeros, scales = (self._tensor(base + k) for k in ("qweight", "qzeros", "scales"))
        unpack = unpack_awq if self.quant.method == "awq" else unpack_gptq
        q, zeros = unpack(qweight, qzeros)
        perm = None
        if self.quant.method == "gptq" and base + "g_idx" in self.weights:
            g_idx = self._tensor(base + "g_idx").long()
            runs = torch.arange(len(g_idx)) // self._group(len(g_idx))  # groups as runs
            if not torch.equal(g_idx, runs):
                perm = torch.argsort(g_idx, stable=True)  # act-order: each group's inputs
                q = q[perm]
                if not torch.equal(g_idx[perm], runs):
                    raise ModelLoadError(f"{base}g_idx: groups of unequal sizes")
        g = group_quant(q, zeros + self.quant.zero_offset, scales.float(), perm)
        return g if self.keep else g.dequantize()

    def _tensor(self, name: str) -> torch.Tensor:
        t = self.weights.pop(name)
        assert isinstance(t, torch.Tensor), f"{name}: a directory's tensors are tensors"
        return t

    def _group(self, inputs: int) -> int:
        return inputs if self.quant.group_size == -1 else self.quant.group_size


def _packed(name: str) -> str:
    """`x.weight` -> `x.`: the prefix of a matrix's quantized tensors."""
    return name.removesuffix("weight")


def fp8_weight(
    codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """An FP8 matrix [out, in] as float32: each code times its block's, row's or tensor's
    scale."""
    rows, cols = codes.shape
    s = scale.float()
    if block is not None:
        s = s.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    elif s.numel() == rows and rows > 1:
        s = s.reshape(rows, 1)
    else:
        s = s.reshape(())
    return codes.float() * s


def fp8_kept(codes: torch.Tensor, scale: torch.Tensor, block: Block | None) -> Fp8Rows:
    """An FP8 matrix as an FP8 GEMM takes it: a scale a row (a tensor's repeated), codes as
    stored; block-scaled ones re-rounded under each row's scale."""
    rows = codes.shape[0]
    if block is not None:
        return fp8_rows(fp8_weight(codes, scale, block))
    s = scale.float().reshape(-1).expand(rows) if scale.numel() == 1 else scale.float()
    return Fp8Rows(codes.to(torch.float8_e4m3fn), s.reshape(rows).contiguous())


def _nibbles(words: torch.Tensor, along_rows: bool) -> torch.Tensor:
    """int32 words [r, c] as their eight 4-bit fields, low first: [r * 8, c] (packed along
    the rows) or [r, c * 8]."""
    n = (words.int().unsqueeze(-1) >> _SHIFTS) & 15
    return n.permute(0, 2, 1).flatten(0, 1) if along_rows else n.flatten(1)


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's codes [in, out] and zeros [groups, out] from words packed along the outputs."""
    undo = (torch.arange(qweight.shape[1] * 8).view(-1, 8)[:, list(_AWQ_UNDO)]).flatten()
    return _nibbles(qweight, False)[:, undo], _nibbles(qzeros, False)[:, undo]


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's codes [in, out] (words packed along the inputs) and zeros [groups, out]."""
    return _nibbles(qweight, True), _nibbles(qzeros, False)


def group_quant(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, perm: torch.Tensor | None
) -> GroupQuant:
    """Codes [in, out] with a zero and scale [groups, out] per run of inputs (of the inputs
    in `perm`'s order, act-order's), as our 4-bit groups of 32 [out, in] (each of ours
    inside one of theirs): w = q * s - z * s."""
    inputs, groups = q.shape[0], scales.shape[0]
    if inputs % groups or (inputs // groups) % GROUP:
        raise ModelLoadError(f"{inputs} inputs in {groups} groups: not runs of {GROUP}")
    repeat = inputs // groups // GROUP
    scale = scales.t().repeat_interleave(repeat, 1).contiguous()
    offset = (-zeros.float() * scales).t().repeat_interleave(repeat, 1).contiguous()
    return GroupQuant(q.t().to(torch.uint8).contiguous(), scale, offset, 4, perm)
