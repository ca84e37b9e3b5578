"""A GGUF file read straight from a read-only memory map: its metadata as Python values and
its tensors as numpy views, in the layouts gguf.quants expects. gguf's own GGUFReader
makes numpy objects of every vocabulary string and merge (~100,000 of them here) and
takes seconds; this reads the same header in a fraction of one."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

# Value types of the metadata (GGUF's gguf_type), little-endian as the format stores them.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Tensors stored element by element; every other kind is blocks, read as bytes.
_ELEMENTS = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]  # rows first, as torch has it (GGUF lists the fastest one first)
    data: np.ndarray  # the elements, or a block kind's bytes (a row's blocks per row)


class GGUFFile:
    """`fields`: each metadata key's value (a list for an array); `tensors` in file order.
    A file that is not GGUF (v2 or v3, little-endian), or is cut short, raises ValueError
    (or struct.error) here, not on first use."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._at = 0
        if self._take(4) != b"GGUF":
            raise ValueError("no GGUF magic number")
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reads 2 and 3, little-endian)")
        num_tensors, num_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = [
            (self._string(), [self._scalar(10) for _ in range(self._scalar(4))],
             self._scalar(4), self._scalar(10))
            for _ in range(num_tensors)
        ]  # fmt: skip
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._at // align) * align
        self.tensors = [self._tensor(start + offset, *info) for *info, offset in infos]

    def _tensor(self, at: int, name: str, dims: list[int], kind_id: int) -> GGUFTensor:
        kind = GGMLQuantizationType(kind_id)
        shape = tuple(reversed(dims))
        count = math.prod(dims)
        element = _ELEMENTS.get(kind)
        if element is not None:
            data = np.frombuffer(self._map, element, count, at).reshape(shape)
        else:
            block, size = GGML_QUANT_SIZES[kind]
            data = np.frombuffer(self._map, np.uint8, count * size // block, at)
            data = data.reshape(quant_shape_to_byte_shape(shape, kind))
        return GGUFTensor(name, kind, shape, data)

    def _take(self, n: int) -> bytes:
        if self._at + n > len(self._map):
            raise ValueError(f"the file ends inside its header (at byte {self._at})")
        out = self._map[self._at : self._at + n]
        self._at += n
        return out

    def _scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._take(self._scalar(10)).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            return self._scalar(kind)
        inner, count = self._scalar(4), self._scalar(10)
        if inner in _SCALARS:  # numbers: one read for the whole array
            dtype = np.dtype(_SCALARS[inner])
            return np.frombuffer(self._take(count * dtype.itemsize), dtype).tolist()
        return [self._value(inner) for _ in range(count)]
