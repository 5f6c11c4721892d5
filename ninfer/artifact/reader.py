"""Open a `.ninfer` file: map it, check it, and hand out zero-copy NumPy views of its tensors."""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from ninfer.artifact.errors import ArtifactError
from ninfer.artifact.format import (
    DTYPES, MAGIC, PREAMBLE, VERSION, TensorInfo, align_up, validate_header,
)


class Artifact:
    """A mapped artifact. Only the enabled components' tensors can be fetched.

    Tensor views point into the read-only map, so pages are read from disk only when touched and
    nothing is copied; copy (or upload) them before ``close()``.
    """

    def __init__(self, path: str | os.PathLike[str], components: Iterable[str] | None = ("text",)):
        self.path = os.fspath(path)
        self._where = self.path
        self._file = open(self.path, "rb")
        try:
            self._map = self._map_file()
            self.header, infos, self._data_start = self._read_header()
        except BaseException:
            self._file.close()
            raise
        self.components: tuple[str, ...] = tuple(self.header["components"])
        self.enabled = self._resolve_components(components)
        self._infos = {t.name: t for t in infos}

    # ----- opening

    def _map_file(self) -> mmap.mmap:
        size = os.fstat(self._file.fileno()).st_size
        if size < PREAMBLE.size:
            raise ArtifactError(f"{self._where}: truncated: {size} bytes is shorter than the "
                                f"{PREAMBLE.size}-byte preamble")
        return mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def _read_header(self) -> tuple[dict[str, Any], list[TensorInfo], int]:
        magic, version, _flags, hlen = PREAMBLE.unpack_from(self._map, 0)
        if magic != MAGIC:
            raise ArtifactError(f"{self._where}: not a .ninfer artifact: wrong magic {magic!r} "
                                f"(expected {MAGIC!r})")
        if version != VERSION:
            raise ArtifactError(f"{self._where}: unsupported format version {version} "
                                f"(this build reads version {VERSION}; re-convert the model)")
        size = len(self._map)
        if PREAMBLE.size + hlen > size:
            raise ArtifactError(f"{self._where}: truncated: header of {hlen} bytes does not fit in "
                                f"the {size}-byte file")
        raw = self._map[PREAMBLE.size:PREAMBLE.size + hlen]
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{self._where}: header JSON invalid: {exc}") from None
        infos = validate_header(self._where, header)
        data_start = align_up(PREAMBLE.size + hlen)
        needed = data_start + header["data_size"]
        if header["data_size"] and size < needed:
            raise ArtifactError(f"{self._where}: truncated: tensor data needs {needed} bytes, "
                                f"the file has {size}")
        return header, infos, data_start

    def _resolve_components(self, components: Iterable[str] | None) -> tuple[str, ...]:
        if components is None:
            return self.components
        wanted = tuple(components)
        absent = [c for c in wanted if c not in self.components]
        if absent:
            raise ArtifactError(f"{self._where}: component(s) {', '.join(absent)} requested but the "
                                f"artifact holds only {', '.join(self.components)}")
        return wanted

    # ----- header fields

    @property
    def metadata(self) -> dict[str, Any]:
        return self.header["metadata"]

    @property
    def config(self) -> dict[str, Any]:
        return self.header["config"]

    @property
    def tokenizer_json(self) -> str:
        return self.header["tokenizer"]["json"]

    @property
    def chat_template(self) -> str | None:
        return self.header.get("chat_template")

    @property
    def special_tokens(self) -> dict[str, Any]:
        return self.header.get("special_tokens") or {}

    @property
    def generation(self) -> dict[str, Any]:
        return self.header.get("generation") or {"defaults": {}, "presets": {}}

    # ----- tensors

    def tensor_names(self, component: str | None = None) -> list[str]:
        """Names of the enabled tensors (of one component if given), in file order."""
        return [t.name for t in self._infos.values()
                if t.component in self.enabled and (component is None or t.component == component)]

    def all_tensor_infos(self) -> list[TensorInfo]:
        """The whole tensor index, enabled or not (for `ninfer inspect`)."""
        return list(self._infos.values())

    def tensor_info(self, name: str) -> TensorInfo:
        info = self._infos.get(name)
        if info is None:
            raise ArtifactError(f"{self._where}: no tensor named {name!r}")
        return info

    def tensor(self, name: str) -> np.ndarray:
        """Zero-copy read-only view; bf16 comes as uint16 bit patterns (see ninfer.artifact.bf16)."""
        info = self.tensor_info(name)
        if info.component not in self.enabled:
            raise ArtifactError(f"{self._where}: tensor {name!r} belongs to component "
                                f"{info.component!r}, which this process did not enable")
        if self._map is None:
            raise ArtifactError(f"{self._where}: artifact is closed")
        dtype = DTYPES[info.dtype]
        count = info.nbytes // dtype.itemsize
        view = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._data_start + info.offset)
        return view.reshape(info.shape)

    # ----- lifetime

    def close(self) -> None:
        """Drop the map. Views still alive keep it mapped until they are freed (mmap forbids more)."""
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # live NumPy views hold the buffer; the map goes when they do
            self._map = None
        self._file.close()

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_artifact(path: str | os.PathLike[str], components: Iterable[str] | None = ("text",)) -> Artifact:
    """Map ``path`` and check it; ``components=None`` enables every component in the file."""
    return Artifact(path, components)
