"""A GGUF file read as predd uses it: its metadata as plain Python values and its tensors
as numpy views of one read-only memory map.

gguf's own `GGUFReader` makes numpy views of every part of every field: for SmolLM2's
49,152 tokens and 48,900 merges that is ~660,000 objects and 1.8-2.5 s of each predd's
start (docs/architecture.md, "Start-up"). Here a string is one slice and one decode,
and a numeric array one `frombuffer`. The tensors are what `GGUFReader` gives (`data`
in numpy order: float arrays for F32, F16, F64 and the integer types, the blocks' bytes
for a quantised type), so `gguf.quants.dequantize` takes them as they are.

Layout (the GGUF specification, versions 2 and 3): the magic `GGUF`, the version, the
tensor and key-value counts, the key-values (a key string, a value type, a value; an
array: its element type, count, elements), the tensors' infos (name, dimensions in
GGUF's order, type, offset), then the tensors' data from the next multiple of
`general.alignment` (32 by default). Files written in the other byte order are read
too; version 1 (32-bit counts) is refused.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4                           # GGML's tensors have at most 4 dimensions
DEFAULT_ALIGNMENT = 32
STRING, ARRAY, BOOL = 8, 9, 7          # GGUF value types without a fixed numeric layout
NUMERIC = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 10: "u8",
           11: "i8", 12: "f8"}
TENSOR_ITEMS = {GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F32: "f4",
                GGMLQuantizationType.F64: "f8", GGMLQuantizationType.I8: "i1",
                GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
                GGMLQuantizationType.I64: "i8"}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]      # GGUF's order: the innermost (a row's width) first
    n_elements: int
    n_bytes: int
    data: np.ndarray            # numpy order; a quantised type's blocks as bytes


class GGUFFile:
    """`metadata` (key -> str, int, float, bool, or a list of them) and `tensors` (in
    the file's order) of the GGUF file at `path`; ValueError, naming the file, for one
    that is no GGUF file or is cut short or inconsistent (a length or offset past its
    end, a key twice, more than MAX_DIMS dimensions, a quantised row that is not whole
    blocks)."""

    def __init__(self, path: str) -> None:
        try:
            self._parse(path)
        except (struct.error, OverflowError, IndexError) as exc:
            raise ValueError(f"{path}: malformed GGUF file ({exc})") from None

    def _parse(self, path: str) -> None:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:
                raise ValueError(f"{path}: not a GGUF file (shorter than its header)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != MAGIC:
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        order = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:             # written in the other byte order
            order = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version not in VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported "
                             f"(only {', '.join(map(str, VERSIONS))})")
        self._order, self._buf, self._path = order, buf, path
        self.version = version
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"{path}: metadata key {key!r} appears twice")
            (kind,) = self._unpack("I")
            self.metadata[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("I")
            if n_dims > MAX_DIMS:
                raise ValueError(f"{path}: tensor {name!r} has {n_dims} dimensions, more "
                                 f"than {MAX_DIMS}")
            dims = self._unpack("Q" * n_dims)
            kind, offset = self._unpack("IQ")
            try:
                kind = GGMLQuantizationType(kind)
            except ValueError:
                raise ValueError(f"{path}: tensor {name!r} has type {kind}, not one GGML "
                                 "knows") from None
            infos.append((name, dims, kind, offset))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise ValueError(f"{path}: general.alignment {align!r} is not a power of two")
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{path}: a tensor name appears twice")

    def _unpack(self, fmt: str) -> tuple:
        fmt = self._order + fmt
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        at = self._pos
        self._need(n)
        self._pos += n
        return self._buf[at:at + n].decode("utf-8")

    def _need(self, n: int) -> None:
        """ValueError unless `n` more bytes follow the reading position."""
        if n > len(self._buf) - self._pos:
            raise ValueError(f"{self._path}: {n} bytes at offset {self._pos}, past the "
                             f"file's end ({len(self._buf)} bytes)")

    def _value(self, kind: int) -> Any:
        if kind == STRING:
            return self._string()
        if kind == BOOL:
            return bool(self._unpack("B")[0])
        if kind in NUMERIC:
            return self._array(kind, 1)[0]
        if kind == ARRAY:
            item, count = self._unpack("IQ")
            if item == STRING:
                return [self._string() for _ in range(count)]
            if item == BOOL:
                return [bool(b) for b in self._array(0, count)]
            if item in NUMERIC:
                return self._array(item, count)
            if item == ARRAY:
                return [self._value(ARRAY) for _ in range(count)]
        raise ValueError(f"GGUF value type {kind} is not one of the specification's")

    def _array(self, kind: int, count: int) -> list:
        dtype = np.dtype(self._order + NUMERIC[kind])
        self._need(dtype.itemsize * count)
        values = np.frombuffer(self._buf, dtype, count, self._pos)
        self._pos += dtype.itemsize * count
        return values.tolist()

    def _tensor(self, start: int, name: str, dims: tuple[int, ...],
                kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
        block, size = GGML_QUANT_SIZES[kind]
        if kind not in TENSOR_ITEMS and (not dims or dims[0] % block):
            raise ValueError(f"{self._path}: tensor {name!r} of {kind.name}: rows of "
                             f"{dims[0] if dims else 0} values, not whole blocks of {block}")
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        n_bytes = n_elements * size // block
        shape = tuple(reversed(dims))
        if kind in TENSOR_ITEMS:
            dtype, count = np.dtype(self._order + TENSOR_ITEMS[kind]), n_elements
        else:                                  # blocks: the last axis in bytes
            dtype, count = np.dtype(np.uint8), n_bytes
            shape = (*shape[:-1], shape[-1] // block * size)
        if start + offset + dtype.itemsize * count > len(self._buf):
            raise ValueError(f"{self._path}: tensor {name!r} runs past the file's end")
        data = np.frombuffer(self._buf, dtype, count, start + offset).reshape(shape)
        return GGUFTensor(name, kind, tuple(dims), n_elements, n_bytes, data)
