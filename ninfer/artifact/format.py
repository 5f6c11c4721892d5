"""The `.ninfer` v3 file layout: constants, dtypes and the header checks shared by reader and writer.

Layout (docs/artifact.md is the user-facing description)::

    offset 0   magic    8 bytes  b"NINFER\\0\\0"
    offset 8   version  u32 LE   3
    offset 12  flags    u32 LE   0 (reserved)
    offset 16  hlen     u64 LE   byte length of the JSON header
    offset 24  header   hlen bytes of UTF-8 JSON
    data_start = align_up(24 + hlen, 4096)
    tensor t lives at data_start + t.offset, t.offset a multiple of 4096

Offsets are relative to the data section so the header can be written without knowing its own
length in advance. The writer and the reader run the same ``validate_header`` so a file the writer
accepts is a file the reader opens.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import attrs
import numpy as np

from ninfer.artifact.errors import ArtifactError

MAGIC = b"NINFER\x00\x00"
VERSION = 3
PREAMBLE = struct.Struct("<8sIIQ")  # magic, version, flags, header length
ALIGNMENT = 4096
FORMAT_NAME = "ninfer"

# dtype name in the header -> NumPy dtype of the zero-copy view (bf16 travels as uint16 bits).
DTYPES: dict[str, np.dtype] = {
    "bf16": np.dtype("<u2"),
    "f16": np.dtype("<f2"),
    "f32": np.dtype("<f4"),
    "i32": np.dtype("<i4"),
    "i8": np.dtype("i1"),
    "u8": np.dtype("u1"),
}

COMPONENTS = ("text", "vision", "mtp", "dflash", "dflash2", "lm_head_draft")

REQUIRED_KEYS = ("format", "version", "metadata", "config", "tokenizer", "components", "tensors",
                 "data_size")


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


@attrs.frozen
class TensorInfo:
    """One entry of the tensor index; ``offset`` is relative to the start of the data section."""

    name: str
    component: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    quantization: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "component": self.component, "dtype": self.dtype,
                "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes,
                "quantization": self.quantization}


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


def _fail(where: str, problem: str) -> ArtifactError:
    return ArtifactError(f"{where}: {problem}")


def parse_tensor_entry(where: str, index: int, entry: Any) -> TensorInfo:
    """Check one tensor-index entry's fields and types; the message names the entry."""
    if not isinstance(entry, dict):
        raise _fail(where, f"tensors[{index}] is not an object")
    label = f"tensors[{index}]" + (f" ({entry['name']!r})" if isinstance(entry.get("name"), str) else "")
    for key in ("name", "component", "dtype", "shape", "offset", "nbytes"):
        if key not in entry:
            raise _fail(where, f"{label} lacks the field {key!r}")
    name, comp, dtype, shape = entry["name"], entry["component"], entry["dtype"], entry["shape"]
    if not isinstance(name, str) or not name:
        raise _fail(where, f"{label}: name must be a non-empty string")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _fail(where, f"{label}: unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise _fail(where, f"{label}: shape must be a list of non-negative integers, got {shape!r}")
    for key in ("offset", "nbytes"):
        if not isinstance(entry[key], int) or isinstance(entry[key], bool) or entry[key] < 0:
            raise _fail(where, f"{label}: {key} must be a non-negative integer")
    quant = entry.get("quantization")
    if quant is not None:
        # No quantized layout is defined yet; refusing beats reading packed bytes as plain numbers.
        raise _fail(where, f"{label}: quantization {quant!r} is not supported by this build")
    info = TensorInfo(name, comp, dtype, tuple(shape), entry["offset"], entry["nbytes"], quant)
    if info.nbytes != expected_nbytes(dtype, info.shape):
        raise _fail(where, f"{label}: nbytes {info.nbytes} does not match {dtype} {list(shape)} "
                           f"({expected_nbytes(dtype, info.shape)} bytes)")
    if info.offset % ALIGNMENT:
        raise _fail(where, f"{label}: offset {info.offset} is not a multiple of {ALIGNMENT}")
    return info


def validate_header(where: str, header: Any) -> list[TensorInfo]:
    """Check the header's structure, tensor placement and completeness; return the tensor index."""
    if not isinstance(header, dict):
        raise _fail(where, "header JSON invalid: the top level is not an object")
    missing = [k for k in REQUIRED_KEYS if k not in header]
    if missing:
        raise _fail(where, f"header JSON invalid: missing key(s) {', '.join(missing)}")
    if header["format"] != FORMAT_NAME or header["version"] != VERSION:
        raise _fail(where, f"header JSON invalid: format/version {header['format']!r}/{header['version']!r}"
                           f" (expected {FORMAT_NAME!r}/{VERSION})")
    meta = header["metadata"]
    if not isinstance(meta, dict) or not isinstance(meta.get("architecture"), str):
        raise _fail(where, "header JSON invalid: metadata.architecture must be a string")
    if not isinstance(header["config"], dict):
        raise _fail(where, "header JSON invalid: config must be an object")
    if meta.get("name") is not None and not isinstance(meta["name"], str):
        raise _fail(where, f"header JSON invalid: metadata.name must be a string or null, got {meta['name']!r}")
    tok = header["tokenizer"]
    if not isinstance(tok, dict) or not isinstance(tok.get("json"), str):
        raise _fail(where, "header JSON invalid: tokenizer.json must be a string")
    _check_text_side(where, header)
    components = header["components"]
    if not isinstance(components, list) or not components:
        raise _fail(where, "header JSON invalid: components must be a non-empty list")
    for comp in components:
        if comp not in COMPONENTS:
            raise _fail(where, f"unknown component {comp!r} (known: {', '.join(COMPONENTS)})")
    if not isinstance(header["tensors"], list):
        raise _fail(where, "header JSON invalid: tensors must be a list")
    infos = [parse_tensor_entry(where, i, e) for i, e in enumerate(header["tensors"])]
    _check_names_and_components(where, infos, components)
    _check_placement(where, infos, header["data_size"])
    _check_completeness(where, header, infos)
    return infos


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _object(where: str, parent: dict[str, Any], key: str, label: str) -> dict[str, Any]:
    """``parent[key]`` as an object; absent and null read as empty, as the reader's properties do."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(where, f"header JSON invalid: {label} must be an object, got {value!r}")
    return value


def _check_text_side(where: str, header: dict[str, Any]) -> None:
    """The fields the text side reads (tokenizer, chat formatter, sampler presets) have the types
    docs/artifact.md gives them: a wrong one would only crash `inspect`, `generate` or `serve` later."""
    template = header.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise _fail(where, f"header JSON invalid: chat_template must be a string or null, got {template!r}")
    special = _object(where, header, "special_tokens", "special_tokens")
    for key in ("bos_token_id", "pad_token_id"):
        if special.get(key) is not None and not _is_token_id(special[key]):
            raise _fail(where, f"header JSON invalid: special_tokens.{key} must be a token id (an integer >= 0) "
                               f"or null, got {special[key]!r}")
    eos = special.get("eos_token_ids")
    if eos is not None and not (isinstance(eos, list) and all(_is_token_id(i) for i in eos)):
        raise _fail(where, f"header JSON invalid: special_tokens.eos_token_ids must be a list of token ids, "
                           f"got {eos!r}")
    tokens = _object(where, special, "tokens", "special_tokens.tokens")
    for spelling, token in tokens.items():
        if not _is_token_id(token):
            raise _fail(where, f"header JSON invalid: special_tokens.tokens[{spelling!r}] must be a token id, "
                               f"got {token!r}")
    _check_generation(where, _object(where, header, "generation", "generation"))


def _check_generation(where: str, generation: dict[str, Any]) -> None:
    """Sampler values are numbers (``do_sample`` a boolean) or null: the engine computes with them."""
    blocks = {"defaults": _object(where, generation, "defaults", "generation.defaults")}
    presets = _object(where, generation, "presets", "generation.presets")
    for mode in presets:
        blocks[f"presets.{mode}"] = _object(where, presets, mode, f"generation.presets.{mode}")
    for label, block in blocks.items():
        for key, value in block.items():
            flag = key == "do_sample"
            if not (value is None or (isinstance(value, bool) if flag else _is_number(value))):
                wanted = "true, false or null" if flag else "a number or null"
                raise _fail(where, f"header JSON invalid: generation.{label}.{key} must be {wanted}, got {value!r}")


def _check_names_and_components(where: str, infos: list[TensorInfo], components: list[str]) -> None:
    seen: set[str] = set()
    for info in infos:
        if info.name in seen:
            raise _fail(where, f"tensor {info.name!r} appears twice in the tensor index")
        seen.add(info.name)
        if info.component not in components:
            raise _fail(where, f"tensor {info.name!r} belongs to component {info.component!r}, "
                               f"which the header does not declare")


def _check_placement(where: str, infos: list[TensorInfo], data_size: Any) -> None:
    if not isinstance(data_size, int) or isinstance(data_size, bool) or data_size < 0:
        raise _fail(where, "header JSON invalid: data_size must be a non-negative integer")
    previous: TensorInfo | None = None
    for info in sorted(infos, key=lambda t: t.offset):
        if info.offset + info.nbytes > data_size:
            raise _fail(where, f"tensor {info.name!r} at offset {info.offset} with {info.nbytes} bytes "
                               f"is out of range of the {data_size}-byte data section")
        if previous is not None and info.nbytes and previous.offset + previous.nbytes > info.offset:
            raise _fail(where, f"tensors {previous.name!r} and {info.name!r} overlap "
                               f"(offsets {previous.offset} and {info.offset})")
        if info.nbytes:
            previous = info


def _check_completeness(where: str, header: dict[str, Any], infos: list[TensorInfo]) -> None:
    """Every tensor the model description requires for a declared component must be present."""
    from ninfer.artifact.expected import expected_tensors  # models import is kept out of the hot path

    for comp in header["components"]:
        try:
            expected = expected_tensors(header, comp)
        except ValueError as exc:
            raise _fail(where, str(exc)) from None
        if expected is None:
            continue
        present = {t.name: t for t in infos if t.component == comp}
        for name, shape in expected.items():
            if name not in present:
                raise _fail(where, f"tensor {name!r} missing for declared component {comp!r}")
            if present[name].shape != tuple(shape):
                raise _fail(where, f"tensor {name!r} has shape {list(present[name].shape)}, "
                                   f"the {comp!r} config needs {list(shape)}")
        extra = sorted(set(present) - set(expected))
        if extra:
            raise _fail(where, f"component {comp!r} holds tensor(s) its config does not describe: "
                               f"{', '.join(extra[:5])}")
