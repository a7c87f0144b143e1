"""GGUF metadata: the key/value section of a GGUF file, read without touching the tensors.

`gguf.GGUFReader` indexes every tensor and wraps every array element in its own numpy view, which
takes seconds for a 49k-token vocabulary. The tokenizer is built twice per deployment (engine and
gateway), so this module parses only the header and the key/value pairs with `struct` over an
mmap, in tens of milliseconds. The layout (GGUF v2/v3, little-endian):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count | kv_count * (key, type, value)
    key    = u64 length + utf-8 bytes
    value  = scalar | string (u64 length + bytes) | array (u32 item type, u64 count, items)

Numeric arrays come back as lists of Python numbers, string arrays as lists of `str`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"

# GGUF value type -> struct format of one scalar (string = 8, array = 9 are handled apart)
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def unpack(self, fmt: str) -> object:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        assert isinstance(length, int)
        raw = self.buffer[self.offset:self.offset + length]
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def value(self, value_type: int) -> object:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.unpack("<I")
            count = self.unpack("<Q")
            assert isinstance(item_type, int) and isinstance(count, int)
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_type]
                size = struct.calcsize(fmt)
                items = struct.unpack_from(f"<{count}{fmt[1:]}", self.buffer, self.offset)
                self.offset += size * count
                return list(items)
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF value type {value_type}")
        return self.unpack(_SCALAR_FORMATS[value_type])


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_gguf_metadata(path: str | Path) -> dict[str, object]:
    """All key/value pairs of a GGUF file, in file order.

    Raises ValueError if the file is not GGUF (v2 or v3).
    """
    return read_gguf_header(path)[0]


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), in elements
    ggml_type: int  # gguf.GGMLQuantizationType value
    data_offset: int  # absolute byte offset of the tensor's data in the file


def read_gguf_header(path: str | Path) -> tuple[dict[str, object], list[GGUFTensorInfo]]:
    """The key/value pairs and the tensor directory (after them: name, dims, type, offset per
    tensor).

        tensor info = name (string) | u32 n_dims | n_dims * u64 (innermost first) | u32 type
                      | u64 offset
        data starts at the end of the infos rounded up to `general.alignment` (default 32)
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        if buffer[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        cursor = _Cursor(buffer)
        cursor.offset = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        num_tensors = cursor.unpack("<Q")
        num_kv = cursor.unpack("<Q")
        assert isinstance(num_kv, int) and isinstance(num_tensors, int)
        metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key = cursor.string()
            value_type = cursor.unpack("<I")
            assert isinstance(value_type, int)
            metadata[key] = cursor.value(value_type)
        raw_infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            num_dims = cursor.unpack("<I")
            assert isinstance(num_dims, int)
            dims = struct.unpack_from(f"<{num_dims}Q", buffer, cursor.offset)
            cursor.offset += 8 * num_dims
            ggml_type, offset = cursor.unpack("<I"), cursor.unpack("<Q")
            raw_infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = metadata.get("general.alignment", 32)
        assert isinstance(alignment, int)
        data_start = -(-cursor.offset // alignment) * alignment
    infos = [GGUFTensorInfo(name, shape, int(t), data_start + int(off))  # type: ignore[call-overload]
             for name, shape, t, off in raw_infos]
    return metadata, infos
