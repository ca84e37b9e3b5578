"""Quantized checkpoints as their quantizers publish them, written from a float one: AWQ
(AutoAWQ's GEMM packing), GPTQ (AutoGPTQ's, v1 zeros, with and without act-order) and
FP8 (e4m3 with block scales, or one scale per tensor). The test of the engine's reading
(test_checkpoint_quant.py) and `bench quantized-checkpoints` write them here; the engine
reads them in cluster/engine/model/checkpoint_quant.py, from the formats' definitions,
not from this.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quant_config(fmt: str, group: int) -> dict[str, Any]:
    """The quantization_config a quantizer writes for `fmt` (awq, gptq, fp8-block,
    fp8-tensor) with groups (or blocks) of `group`."""
    configs: dict[str, dict[str, Any]] = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                 "sym": False},
        "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": group,
                           "desc_act": True, "sym": False},
        "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [group, group]},
        "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    }  # fmt: skip
    return configs[fmt]


FORMATS = ("awq", "gptq", "gptq-act-order", "fp8-block", "fp8-tensor")


def _pack(nibbles: torch.Tensor, along_rows: bool) -> torch.Tensor:
    """Eight 4-bit values to an int32 word, the first in the low bits, as the quantizers
    pack them (along the rows: GPTQ's qweight; along the columns: the rest)."""
    n = nibbles.int()
    n = n.unflatten(0, (-1, 8)).transpose(1, 2) if along_rows else n.unflatten(1, (-1, 8))
    word = torch.zeros(n.shape[:-1], dtype=torch.int64)
    for i in range(8):
        word |= n[..., i].long() << (4 * i)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).int()


def _int4(
    w: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of `group` inputs, as AWQ and GPTQ store them: codes [in, out],
    zeros and float16 scales [groups, out], and the matrix they stand for [out, in]."""
    t = w.t().unflatten(0, (-1, group))  # [groups, GROUP, out]
    low, high = t.amin(1), t.amax(1)
    scales = ((high - low) / 15).half()
    s = scales.float()
    zeros = (-low / s).round().clamp(0, 15)
    q = ((t / s.unsqueeze(1)).round() + zeros.unsqueeze(1)).clamp(0, 15)
    exact = ((q - zeros.unsqueeze(1)) * s.unsqueeze(1)).flatten(0, 1).t()
    return q.flatten(0, 1), zeros, scales, exact


def _awq(name: str, w: torch.Tensor, out: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    q, zeros, scales, exact = _int4(w, group)
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # AutoAWQ's order within a word
    cols = (torch.arange(q.shape[1]).view(-1, 8)[:, order]).flatten()
    out[name + "qweight"] = _pack(q[:, cols], False)
    out[name + "qzeros"] = _pack(zeros[:, cols], False)
    out[name + "scales"] = scales
    return exact


def _gptq(
    name: str, w: torch.Tensor, out: dict[str, torch.Tensor], group: int, act_order: bool
) -> torch.Tensor:
    """GPTQ's layout; with act-order each group takes inputs of a random order (g_idx),
    as the quantizer orders them by the activations' size."""
    inputs = w.shape[1]
    order = torch.randperm(inputs, generator=torch.Generator().manual_seed(inputs))
    if not act_order:
        order = torch.arange(inputs)
    q, zeros, scales, exact = _int4(w[:, order], group)  # in the groups' order
    natural, g_idx = torch.empty_like(q), torch.empty(inputs, dtype=torch.int32)
    natural[order], g_idx[order] = q, (torch.arange(inputs) // group).int()
    out[name + "qweight"] = _pack(natural, True)
    out[name + "qzeros"] = _pack(zeros - 1, False)  # v1: each zero stored minus one
    out[name + "scales"] = scales
    out[name + "g_idx"] = g_idx
    return torch.empty_like(exact).index_copy_(1, order, exact)


def _fp8(name: str, w: torch.Tensor, out: dict[str, torch.Tensor], block: int) -> torch.Tensor:
    if block:  # a last block of fewer rows or columns has a scale of its own too
        rows, cols = w.shape
        padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
        padded[:rows, :cols] = w.float().abs()
        scale = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block)).amax((1, 3)) / 448
        full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
        out[name + "weight_scale_inv"] = scale
    else:
        scale = full = w.float().abs().max() / 448
        out[name + "weight_scale"] = scale
        out[name + "input_scale"] = torch.tensor(0.02)  # static activations: not read here
    codes = (w.float() / full).to(torch.float8_e4m3fn)
    out[name + "weight"] = codes
    return codes.float() * full


def write_quantized(
    float_dir: Path, root: Path, fmt: str, group: int, reference: bool = True
) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """`fmt`'s checkpoint of float_dir's model, and (`reference`) a float checkpoint of the
    matrices it stands for (what transformers runs), and those matrices by name."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(float_dir / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for key, w in tensors.items():
        name = key.removesuffix("weight")
        if not name.endswith(tuple(p + "." for p in PROJECTIONS)):
            packed[key] = w
            continue
        if fmt == "awq":
            exact[key] = _awq(name, w.float(), packed, group)
        elif fmt.startswith("gptq"):
            exact[key] = _gptq(name, w.float(), packed, group, fmt == "gptq-act-order")
        else:
            exact[key] = _fp8(name, w, packed, group if fmt == "fp8-block" else 0)
    quantized, dequantized = root / fmt, root / f"{fmt}-dequantized"
    written = [(quantized, packed), (dequantized, {**tensors, **exact})]
    for d, held in written if reference else written[:1]:
        shutil.copytree(float_dir, d)
        save_file(held, str(d / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = quant_config(fmt, group)
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized, exact
