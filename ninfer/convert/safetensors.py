"""A small safetensors reader (mmap, lazy, zero-copy) and writer, with no torch dependency.

Format facts: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte after the
header) plus an optional ``"__metadata__"`` string map, then the raw little-endian data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from ninfer.convert.errors import ConversionError
from ninfer.convert.mapped import map_readonly

# safetensors dtype → NumPy view dtype (BF16 is read as its uint16 bit patterns).
ST_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_NP_TO_ST = {np.dtype(v): k for k, v in ST_DTYPES.items() if k != "BF16"}

_HEADER_LIMIT = 100 << 20  # the format's own guard against absurd header lengths


@attrs.frozen
class SafetensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """One mapped ``.safetensors`` file; ``get(name)`` returns a read-only view without copying."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._map = map_readonly(self.path, 8, "not a safetensors file")
        try:
            self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> None:
        size = len(self._map)
        (hlen,) = struct.unpack_from("<Q", self._map, 0)
        if hlen > min(size - 8, _HEADER_LIMIT):
            raise ConversionError(f"{self.path}: not a safetensors file (header length {hlen} "
                                  f"does not fit in {size} bytes)")
        try:
            header = json.loads(self._map[8:8 + hlen].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConversionError(f"{self.path}: safetensors header is not valid JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ConversionError(f"{self.path}: safetensors header must be a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._data_start = 8 + hlen
        self.infos = {name: self._parse(name, entry, size - self._data_start) for name, entry in header.items()}

    def _parse(self, name: str, entry: Any, data_len: int) -> SafetensorInfo:
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ConversionError(f"{self.path}: tensor {name!r} has a malformed header entry") from None
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (*shape, begin, end)):
            raise ConversionError(f"{self.path}: tensor {name!r}: shape and data_offsets must be "
                                  f"non-negative integers, got {list(shape)} and {entry['data_offsets']}")
        if not isinstance(dtype, str) or dtype not in ST_DTYPES:
            raise ConversionError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * ST_DTYPES[dtype].itemsize or not 0 <= begin <= end <= data_len:
            raise ConversionError(f"{self.path}: tensor {name!r} data_offsets [{begin}, {end}] do not "
                                  f"match {dtype} {list(shape)} inside the {data_len}-byte data section")
        return SafetensorInfo(name, dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self.infos)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view; the map closes when that view is released

    def get(self, name: str) -> np.ndarray:
        info = self.infos[name]
        dtype = ST_DTYPES[info.dtype]
        count = (info.end - info.begin) // dtype.itemsize
        view = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + info.begin)
        return view.reshape(info.shape)


def write_safetensors(path: str | os.PathLike[str],
                      tensors: Mapping[str, np.ndarray | tuple[str, np.ndarray]],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file. A value is an array (dtype inferred) or ``(st_dtype, array)``,
    which is how bf16 is written: ``("BF16", uint16_bits)``."""
    entries: dict[str, Any] = {}
    arrays: list[np.ndarray] = []
    offset = 0
    for name, value in tensors.items():
        st_dtype, array = value if isinstance(value, tuple) else (None, value)
        array = np.ascontiguousarray(array)
        if st_dtype is None:
            st_dtype = _NP_TO_ST.get(array.dtype)
            if st_dtype is None:
                raise ValueError(f"tensor {name!r}: no safetensors dtype for {array.dtype}")
        elif ST_DTYPES.get(st_dtype) != array.dtype:
            raise ValueError(f"tensor {name!r}: {st_dtype} needs {ST_DTYPES.get(st_dtype)} data, got {array.dtype}")
        entries[name] = {"dtype": st_dtype, "shape": list(array.shape),
                         "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    if metadata:
        entries["__metadata__"] = dict(metadata)
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in arrays:
            if array.nbytes:  # memoryview refuses to cast empty arrays
                f.write(memoryview(array.reshape(-1)).cast("B"))
