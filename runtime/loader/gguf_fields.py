"""GGUF metadata arrays read in bulk. gguf's reader builds a numpy view per element of every
array field (the default model's ~49,000 vocabulary strings, ~48,000 merges and ~49,000 token
types: ~150,000 views, ~0.6 s of CPU per open, the largest part of opening the checkpoint);
here an array of strings is decoded in one pass over the mapping and an array of numbers is
one view. Scalars and single strings keep gguf's own fields (few, and the reader itself reads
`general.alignment`'s parts). The format follows gguf-py's GGUFReader and llama.cpp's
docs/gguf.md: key (u64 length + UTF-8), value type (u32), value; an array is its element type
(u32), its length (u64), then its elements."""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np

_STRING, _ARRAY = 8, 9
# GGUFValueType -> numpy type code (gguf-py's GGUFReader.gguf_scalar_to_np)
_NUMBERS = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8",
            11: "i8", 12: "f8"}


class ArrayField:
    """An array field decoded when read: `contents()` gives what gguf's ReaderField.contents()
    gives for it (a list of str, int, float or bool). `parts` is empty: no per-element views."""

    __slots__ = ("name", "offset", "parts", "types", "value")

    def __init__(self, offset: int, name: str, types: list[Any], value: list[Any]) -> None:
        self.offset, self.name, self.types, self.value = offset, name, types, value
        self.parts: list[Any] = []

    def contents(self) -> list[Any]:
        return self.value


def build_fields(reader: Any, offs: int, count: int) -> int:
    """Read `count` key-value fields of `reader` (a gguf.GGUFReader, its `data` mapped) from
    byte `offs` into `reader.fields`; the offset just past them. Arrays of strings or numbers
    become ArrayFields; every other field is gguf's. KeyError on a repeated key, ValueError
    (or struct.error) on a malformed field, as gguf's reader."""
    from gguf.constants import GGUFValueType
    from gguf.gguf_reader import ReaderField

    data = reader.data.view(np.ndarray)
    view = memoryview(data)
    swapped = reader.byte_order == "S"
    order = (">" if sys.byteorder == "little" else "<") if swapped else "="
    u32, u64 = struct.Struct(order + "I").unpack_from, struct.Struct(order + "Q").unpack_from
    end_of_data = len(data)

    def text(at: int) -> tuple[str, int]:
        (n,) = u64(view, at)
        at += 8
        if at + n > end_of_data:
            raise ValueError(f"a string at byte {at} runs past the end of the file")
        return str(view[at:at + n], "utf-8"), at + n

    for _ in range(int(count)):
        start = offs
        name, offs = text(offs)
        (kind,) = u32(view, offs)
        offs += 4
        item = u32(view, offs)[0] if kind == _ARRAY else None
        if item == _STRING or item in _NUMBERS:
            (length,) = u64(view, offs + 4)
            offs += 12
            if item == _STRING:
                value: list[Any] = [""] * length
                for i in range(length):
                    value[i], offs = text(offs)
            else:
                dtype = np.dtype(_NUMBERS[item]).newbyteorder(order)
                value = np.frombuffer(data, dtype, length, offs).tolist()
                offs += dtype.itemsize * length
            field: Any = ArrayField(start, name, [GGUFValueType.ARRAY, GGUFValueType(item)],
                                    value)
        else:
            size, parts, indices, types = reader._get_field_parts(offs, kind)
            key_parts = [np.array([len(name.encode())], np.uint64),
                         np.frombuffer(name.encode(), np.uint8), np.array([kind], np.uint32)]
            field = ReaderField(start, name, key_parts + parts,
                                [i + len(key_parts) for i in indices], types)
            offs += size
        if name in reader.fields:
            raise KeyError(f"Duplicate {name} already in list at offset {start}")
        reader.fields[name] = field
    return offs
