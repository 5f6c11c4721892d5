"""Our own GGUF reader: header (v2/v3), metadata key/values, tensor infos, and dequantization.

A GGUF file is little-endian::

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count × (key: string, value_type u32, value)
    tensor_count × (name: string, n_dims u32, dims u64 × n_dims, ggml_type u32, offset u64)
    padding to general.alignment (default 32)
    tensor data; each tensor at data_start + offset

Strings are a u64 byte length plus UTF-8 bytes; arrays are an element type u32, a u64 count, then
the elements. Dims list ne0 first (the fastest-varying index), so the NumPy shape is the reverse.
Tensor data is read through one read-only ``mmap``; dequantization is vectorized NumPy over blocks.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ninfer.artifact import bf16
from ninfer.convert.errors import ConversionError
from ninfer.convert.fields import Fields
from ninfer.convert.mapped import map_readonly

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> (name, struct format for scalars, NumPy dtype for arrays).
_SCALARS: dict[int, tuple[str, str, str]] = {
    0: ("UINT8", "<B", "<u1"), 1: ("INT8", "<b", "<i1"), 2: ("UINT16", "<H", "<u2"),
    3: ("INT16", "<h", "<i2"), 4: ("UINT32", "<I", "<u4"), 5: ("INT32", "<i", "<i4"),
    6: ("FLOAT32", "<f", "<f4"), 7: ("BOOL", "<?", "<u1"), 10: ("UINT64", "<Q", "<u8"),
    11: ("INT64", "<q", "<i8"), 12: ("FLOAT64", "<d", "<f8"),
}
_STRING, _ARRAY = 8, 9

# ggml tensor types: id -> (name, elements per block, bytes per block). The sizes of types we cannot
# dequantize are still listed so their tensors can be located and bounds-checked; they fail only when
# someone asks for their values.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}


class GGUFError(ConversionError, ValueError):
    """A GGUF file we cannot read or a tensor we cannot dequantize; the message names the problem."""


@attrs.frozen
class GGUFTensor:
    """One tensor info. ``shape`` is NumPy order (GGUF dims reversed); ``offset`` is absolute."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int | None  # None for a type id this reader does not know

    @property
    def type_name(self) -> str:
        known = GGML_TYPES.get(self.ggml_type)
        return known[0] if known else f"unknown ggml type {self.ggml_type}"

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class _Cursor:
    """Sequential little-endian reads over the mapped file, with a clear error at the end of data."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated while reading {what} at byte {self.pos} "
                            f"(needs {n} bytes, file has {len(self.buf)})")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        raw = self.take(n, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({exc})") from None


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    if vtype in _SCALARS:
        value = cur.scalar(_SCALARS[vtype][1], f"value of {key!r}")
        return bool(value) if vtype == 7 else value
    if vtype == _STRING:
        return cur.string(f"value of {key!r}")
    if vtype == _ARRAY:
        etype = cur.scalar("<I", f"array type of {key!r}")
        count = cur.scalar("<Q", f"array length of {key!r}")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][2])
            arr = np.frombuffer(cur.take(count * dtype.itemsize, f"array {key!r}"), dtype=dtype)
            return arr.astype(bool).tolist() if etype == 7 else arr.tolist()
        if etype in (_STRING, _ARRAY):
            return [_read_value(cur, etype, key) for _ in range(count)]
        raise GGUFError(f"{cur.path}: metadata {key!r} is an array of unknown value type {etype}")
    raise GGUFError(f"{cur.path}: metadata {key!r} has unknown value type {vtype}")


class GGUFFile:
    """A mapped GGUF file: ``version``, ``metadata`` (key → Python value), ``tensors`` (name → info)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._map = map_readonly(self.path, 24, "too short to be a GGUF file", GGUFError)
        try:
            self._parse(memoryview(self._map))
        except BaseException:
            self.close()
            raise

    def _parse(self, buf: memoryview) -> None:
        cur = _Cursor(buf, self.path)
        magic = bytes(cur.take(4, "magic"))
        if magic != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
        self.version = cur.scalar("<I", "version")
        if self.version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                raise GGUFError(f"{self.path}: big-endian GGUF (version {swapped}) is not supported")
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version} "
                            f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors = cur.scalar("<Q", "tensor count")
        n_kv = cur.scalar("<Q", "metadata count")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            self.metadata[key] = _read_value(cur, cur.scalar("<I", f"type of {key!r}"), key)
        raw_infos = [self._read_tensor_info(cur) for _ in range(n_tensors)]
        self.alignment = Fields(self.metadata, self.path, error=GGUFError).integer(
            "general.alignment", DEFAULT_ALIGNMENT, minimum=0)
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {self.alignment} is not a power of two")
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, gtype, rel in raw_infos:
            if name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {name!r} is listed twice")
            self.tensors[name] = self._locate(name, shape, gtype, rel, len(buf))

    def _read_tensor_info(self, cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string("tensor name")
        n_dims = cur.scalar("<I", f"dims of {name!r}")
        if n_dims > 8:
            raise GGUFError(f"{self.path}: tensor {name!r} claims {n_dims} dimensions")
        dims = [cur.scalar("<Q", f"dims of {name!r}") for _ in range(n_dims)]
        gtype = cur.scalar("<I", f"type of {name!r}")
        rel = cur.scalar("<Q", f"offset of {name!r}")
        return name, tuple(reversed(dims)), gtype, rel

    def _locate(self, name: str, shape: tuple[int, ...], gtype: int, rel: int, file_size: int) -> GGUFTensor:
        if rel % self.alignment:
            raise GGUFError(f"{self.path}: tensor {name!r} offset {rel} is not aligned to {self.alignment}")
        nbytes = None
        if gtype in GGML_TYPES:
            tname, block, block_bytes = GGML_TYPES[gtype]
            row = shape[-1] if shape else 1
            if row % block:
                raise GGUFError(f"{self.path}: tensor {name!r} ({tname}) has rows of {row} elements, "
                                f"not a multiple of its block size {block}")
            nbytes = math.prod(shape) // block * block_bytes
            end = self.data_offset + rel + nbytes
            if end > file_size:
                raise GGUFError(f"{self.path}: tensor {name!r} ends at byte {end}, past the end of the "
                                f"{file_size}-byte file (truncated?)")
        return GGUFTensor(name, shape, gtype, self.data_offset + rel, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a zero-copy uint8 view of the mapped file."""
        info = self.tensor(name)
        if info.nbytes is None:
            raise unsupported(info)
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in NumPy shape (a fresh array, never a view of the file)."""
        info = self.tensor(name)
        kernel = DEQUANTIZERS.get(info.type_name)
        if kernel is None:
            raise unsupported(info)
        return kernel(self.raw(name)).reshape(info.shape)

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a caller still holds a view; the map closes when that view is released
            self._map = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unsupported(info: GGUFTensor) -> GGUFError:
    return GGUFError(f"tensor {info.name!r} has type {info.type_name}, which NInfer cannot dequantize "
                     f"(supported: {', '.join(DEQUANTIZERS)})")


# --- dequantization: one vectorized function per block format --------------------------------------

def _blocks(raw: np.ndarray, fields: list[tuple]) -> np.ndarray:
    return raw.view(np.dtype(fields))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 packed bytes per block → 32 values: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _scale(blocks: np.ndarray, field: str) -> np.ndarray:
    return blocks[field].astype(np.float32)[:, None]


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f4").copy()


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    return bf16.to_float32(raw.view("<u2"))


# np.multiply(..., dtype=float32) widens the small integers inside the multiply; converting the
# strided field views with astype first costs several times more on large tensors.
def _q8_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, [("d", "<f2"), ("qs", "i1", (32,))])
    return np.multiply(b["qs"], _scale(b, "d"), dtype=np.float32).reshape(-1)


def _q4_0(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, [("d", "<f2"), ("qs", "u1", (16,))])
    centered = _nibbles(b["qs"]).view(np.int8) - np.int8(8)  # 0..15 → -8..7
    return np.multiply(centered, _scale(b, "d"), dtype=np.float32).reshape(-1)


def _q4_1(raw: np.ndarray) -> np.ndarray:
    b = _blocks(raw, [("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])
    out = np.multiply(_nibbles(b["qs"]), _scale(b, "d"), dtype=np.float32)
    out += _scale(b, "m")
    return out.reshape(-1)


DEQUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "F32": _f32, "F16": _f16, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1,
}
