"""Write a `.ninfer` file tensor by tensor, so peak memory is about one tensor, not one model.

The writer plans every offset from the declared shapes, validates the finished header with the
reader's own checks, writes it, then loads and writes each tensor in turn. It writes into a
temporary file beside the target and renames it at the end, so a failed conversion leaves no half
file under the requested name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import numpy as np

from ninfer.artifact.errors import ArtifactError
from ninfer.artifact.format import (
    ALIGNMENT, DTYPES, FORMAT_NAME, MAGIC, PREAMBLE, VERSION, TensorInfo, align_up,
    expected_nbytes, validate_header,
)

# Called after each tensor with (bytes written so far, total bytes, tensor name).
ProgressFn = Callable[[int, int, str], None]


@attrs.frozen
class TensorSource:
    """A tensor to write: declared name/component/dtype/shape and a lazy ``load()`` of its data.

    ``load()`` must return an array of the declared shape whose NumPy dtype is the artifact
    dtype's view type (bf16 → uint16 bit patterns, see ninfer.artifact.bf16).
    """

    name: str
    component: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    load: Callable[[], np.ndarray] = attrs.field(repr=False)

    @classmethod
    def from_array(cls, name: str, component: str, dtype: str, array: np.ndarray) -> TensorSource:
        return cls(name, component, dtype, array.shape, lambda: array)


def _plan(sources: list[TensorSource]) -> tuple[list[TensorInfo], int]:
    infos, offset = [], 0
    for src in sources:
        if src.dtype not in DTYPES:
            raise ArtifactError(f"tensor {src.name!r}: unsupported dtype {src.dtype!r} "
                                f"(supported: {', '.join(DTYPES)})")
        nbytes = expected_nbytes(src.dtype, src.shape)
        infos.append(TensorInfo(src.name, src.component, src.dtype, src.shape, offset, nbytes))
        offset = align_up(offset + nbytes, ALIGNMENT)
    data_size = infos[-1].offset + infos[-1].nbytes if infos else 0
    return infos, data_size


def build_header(header_fields: dict[str, Any], infos: list[TensorInfo], data_size: int) -> dict[str, Any]:
    """The full header: caller fields, defaults for optional ones, and the planned tensor index."""
    header: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": VERSION,
        "metadata": {"name": None, "source": {}},
        "config": {},
        "chat_template": None,
        "special_tokens": {"bos_token_id": None, "eos_token_ids": [], "pad_token_id": None, "tokens": {}},
        "generation": {"defaults": {}, "presets": {}},
    }
    for key, value in header_fields.items():
        if key in ("format", "version", "tensors", "data_size"):
            raise ArtifactError(f"header field {key!r} is set by the writer, not the caller")
        header[key] = {**header[key], **value} if key == "metadata" else value
    if "components" not in header:
        header["components"] = list(dict.fromkeys(t.component for t in infos))
    header["tensors"] = [t.to_json() for t in infos]
    header["data_size"] = data_size
    return header


def _check_loaded(src: TensorSource, array: np.ndarray) -> np.ndarray:
    want = DTYPES[src.dtype]
    if array.dtype != want:
        raise ArtifactError(f"tensor {src.name!r}: load() gave {array.dtype}, declared {src.dtype} "
                            f"needs {want}")
    if tuple(array.shape) != src.shape:
        raise ArtifactError(f"tensor {src.name!r}: load() gave shape {list(array.shape)}, "
                            f"declared {list(src.shape)}")
    return np.ascontiguousarray(array)


def write_artifact(path: str | os.PathLike[str], header_fields: dict[str, Any],
                   tensors: Iterable[TensorSource], progress: ProgressFn | None = None) -> dict[str, Any]:
    """Write the artifact and return its header. ``header_fields`` holds metadata, config,
    tokenizer, chat_template, special_tokens, generation and optionally components."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ArtifactError(f"{path}: the output directory {parent} does not exist")
    sources = list(tensors)  # cheap: sources are lazy, only their declarations are held
    infos, data_size = _plan(sources)
    header = build_header(header_fields, infos, data_size)
    validate_header(path, header)
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    data_start = align_up(PREAMBLE.size + len(raw))
    tmp = f"{path}.partial-{os.getpid()}"
    try:
        out = open(tmp, "wb")
    except OSError as exc:  # name OUT, not the temporary file the user never asked for
        raise ArtifactError(f"{path}: cannot write: {exc.strerror or exc}") from None
    try:
        with out as f:
            f.write(PREAMBLE.pack(MAGIC, VERSION, 0, len(raw)))
            f.write(raw)
            done, total = 0, sum(info.nbytes for info in infos)  # payload, without alignment gaps
            for src, info in zip(sources, infos):
                array = _check_loaded(src, src.load())
                f.seek(data_start + info.offset)  # the gap reads back as zeros
                if info.nbytes:  # memoryview refuses to cast empty arrays
                    f.write(memoryview(array.reshape(-1)).cast("B"))
                done += info.nbytes
                del array
                if progress is not None:
                    progress(done, total, src.name)
            f.truncate(data_start + data_size)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return header
