"""Read a GGUF file's metadata and tensor index, and map its tensor bytes without copying.

gguf's own `GGUFReader` builds a numpy view for every part of every metadata value; on a
vocabulary of tens of thousands of tokens and its merges that was most of the model load
(docs/benchmark-log.md, "Start-up"). Here a string array is one Python loop over the mapped bytes.
Layout: the GGUF v2/v3 specification (little-endian; llama.cpp's docs/gguf.md).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count
# Value type -> struct format (uint8, int8, uint16, int16, uint32, int32, float32, bool, -,
# -, uint64, int64, float64).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
# Tensor type id -> (name, values per block, bytes per block) for the types loom computes with
# itself, so that loading such a model never imports the gguf package (its import pulls in
# yaml and more: a slice of every start-up). Other types' sizes are gguf's, and so is the
# decoding of every block-quantized type (loom's kernels read Q4_0, Q4_1 and Q8_0 blocks as
# they are).
_NATIVE_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
                 8: ("Q8_0", 32, 34), 30: ("BF16", 1, 2)}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file loom can read."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # row-major, as numpy and torch index it (GGUF stores it reversed)
    kind: str  # the GGML type's name: "F32", "Q4_1", ...
    data: np.ndarray  # uint8 [*shape[:-1], bytes per row], a view of the file map


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # strings as str, arrays as lists
    tensors: list[GGUFTensor]


def read_gguf(path: Path) -> GGUFFile:
    """The metadata and tensors of a GGUF file. Tensor data stays in the memory map until
    someone reads it."""
    with open(path, "rb") as f:
        # Copy-on-write: tensors can be handed to torch as they are (it wants writable
        # memory), and nothing is copied unless written, which loom never does.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    reader = _Cursor(buf)
    if reader.take(4) != _MAGIC:
        raise GGUFFormatError(f"{path.name} is not a GGUF file (bad magic)")
    version = reader.scalar("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"{path.name}: GGUF version {version} is not supported (2 or 3; "
                              "big-endian files are not supported either)")
    num_tensors, num_fields = reader.scalar("Q"), reader.scalar("Q")
    metadata = {}
    for _ in range(num_fields):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("I"))
    index = []
    for _ in range(num_tensors):
        name = reader.string()
        dims = [reader.scalar("Q") for _ in range(reader.scalar("I"))]
        index.append((name, tuple(reversed(dims)), reader.scalar("I"), reader.scalar("Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-reader.offset // alignment) * alignment
    file_bytes = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, shape, raw_kind, offset in index:
        try:
            kind, block_size, type_size = tensor_type(raw_kind)
        except ValueError:
            raise GGUFFormatError(f"{path.name}: tensor {name!r} has unknown type {raw_kind}") \
                from None
        row_bytes = shape[-1] // block_size * type_size
        num_bytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        start = data_start + offset
        if start + num_bytes > len(file_bytes):
            raise GGUFFormatError(f"{path.name} is truncated: tensor {name!r} ends past the file")
        data = file_bytes[start:start + num_bytes].reshape(*shape[:-1], row_bytes)
        tensors.append(GGUFTensor(name, shape, kind, data))
    return GGUFFile(metadata, tensors)


def tensor_type(type_id: int) -> tuple[str, int, int]:
    """(name, values per block, bytes per block) of a GGML tensor type; ValueError if the type
    is unknown."""
    if type_id in _NATIVE_TYPES:
        return _NATIVE_TYPES[type_id]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType(type_id)
    return (kind.name, *GGML_QUANT_SIZES[kind])


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values as float32 [*shape]: F32 as a view of the file map, F16 and BF16
    converted here, every other type by gguf's decoders."""
    if tensor.kind == "F32":
        values = tensor.data.view(np.float32)
    elif tensor.kind == "F16":
        values = tensor.data.view(np.float16).astype(np.float32)
    elif tensor.kind == "BF16":  # the top half of a float32
        values = (tensor.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        values = gguf_dequantize(tensor.data, GGMLQuantizationType[tensor.kind])
        values = values.astype(np.float32, copy=False)
    return values.reshape(tensor.shape)


class _Cursor:
    """Sequential little-endian reads from the mapped header."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.offset = buf, 0

    def take(self, n: int) -> bytes:
        if self.offset + n > len(self.buf):
            raise GGUFFormatError("GGUF header is truncated")
        out = self.buf[self.offset:self.offset + n]
        self.offset += n
        return out

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))
        return value

    def string(self) -> str:
        return self.take(self.scalar("Q")).decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """`count` strings in one tight loop: a vocabulary and its merges are most of the
        header, and a string() call per item was most of reading it."""
        buf, end, offset, out = self.buf, len(self.buf), self.offset, []
        length, append = _LENGTH.unpack_from, out.append
        for _ in range(count):
            if offset + 8 > end:
                raise GGUFFormatError("GGUF header is truncated")
            start = offset + 8
            offset = start + length(buf, offset)[0]
            append(buf[start:offset].decode("utf-8"))
        if offset > end:
            raise GGUFFormatError("GGUF header is truncated")
        self.offset = offset
        return out

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type == _STRING:
                return self.strings(count)
            if item_type in _SCALARS:
                dtype = np.dtype("<" + _SCALARS[item_type])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item_type) for _ in range(count)]  # arrays of arrays
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        raise GGUFFormatError(f"unknown GGUF metadata value type {value_type}")
