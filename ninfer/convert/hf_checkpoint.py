"""The files of a Hugging Face checkpoint directory: weights (lazily, across shards) and text assets."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ninfer.artifact.bf16 import from_float32, to_float32
from ninfer.convert.errors import ConversionError
from ninfer.convert.fields import json_kind, show
from ninfer.convert.safetensors import SafetensorInfo, SafetensorsFile

INDEX_NAME = "model.safetensors.index.json"
FLOAT_SOURCES = ("BF16", "F16", "F32")  # weight dtypes the converters read
# Present in some checkpoints but not weights of the model (recomputed buffers).
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: Path, required: bool = True) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ConversionError(f"{path}: missing (a Hugging Face checkpoint needs it)")
        return None
    return _read_object(path)[1]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{path}: not UTF-8 text: {exc}") from None


def _read_object(path: Path) -> tuple[str, dict[str, Any]]:
    """(text, parsed) of a JSON file; every JSON file of a checkpoint holds one object."""
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: must hold a JSON object, holds {json_kind(data)}")
    return text, data


def _check_shard_names(index: Path, weight_map: dict[str, Any]) -> None:
    """Shards are files beside the index: a value that is no plain file name would be looked up
    elsewhere or crash the lookup."""
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise ConversionError(f"{index}: weight_map[{name!r}] must name a shard file in the checkpoint "
                                  f"directory, got {show(shard)}")


class CheckpointWeights:
    """Name → tensor over every shard; shards are mapped on first use, tensors viewed on demand."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}  # tensor name → shard file name
        index = read_json(directory / INDEX_NAME, required=False)
        if index is not None:
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{directory / INDEX_NAME}: no weight_map")
            _check_shard_names(directory / INDEX_NAME, weight_map)
            self._index_files(sorted(set(weight_map.values())), weight_map)
        else:  # a directory that happens to be named *.safetensors is no shard
            shards = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
            if not shards:
                raise ConversionError(f"{directory}: no *.safetensors weights found")
            self._index_files(shards, None)

    def _index_files(self, shards: list[str], weight_map: dict[str, str] | None) -> None:
        for shard in shards:
            for name in self._file(shard).keys():
                if name in self.where:
                    raise ConversionError(f"{self.directory}: tensor {name!r} is in both "
                                          f"{self.where[name]} and {shard}")
                self.where[name] = shard
        if weight_map is not None:
            lost = sorted(n for n, f in weight_map.items() if self.where.get(n) != f)
            if lost:
                raise ConversionError(f"{self.directory / INDEX_NAME}: tensor {lost[0]!r} is not in "
                                      f"{weight_map[lost[0]]} as the index says")

    def _file(self, shard: str) -> SafetensorsFile:
        if shard not in self._files:
            path = self.directory / shard
            if not path.is_file():
                raise ConversionError(f"{path}: missing shard named by {INDEX_NAME}")
            self._files[shard] = SafetensorsFile(path)
        return self._files[shard]

    def names(self) -> list[str]:
        return list(self.where)

    def info(self, name: str) -> SafetensorInfo:
        return self._file(self.where[name]).infos[name]

    def get(self, name: str) -> np.ndarray:
        return self._file(self.where[name]).get(name)

    def checked(self, name: str, needed: str) -> SafetensorInfo:
        """The info of a weight the model needs (``needed`` says what for); present and float."""
        if name not in self.where:
            raise ConversionError(f"{self.directory}: tensor {name!r} missing (needed {needed})")
        info = self.info(name)
        if info.dtype not in FLOAT_SOURCES:
            raise ConversionError(f"{self.directory}: tensor {name!r} has dtype {info.dtype}; "
                                  f"expected one of {', '.join(FLOAT_SOURCES)}")
        return info

    def bf16(self, name: str) -> np.ndarray:
        """bf16 bit patterns of a float weight (narrowed from f16/f32 when needed)."""
        array = self.get(name)
        return array if self.info(name).dtype == "BF16" else from_float32(array)

    def f32(self, name: str) -> np.ndarray:
        """float32 values of a float weight (bf16 widened exactly)."""
        array = self.get(name)
        return to_float32(array) if self.info(name).dtype == "BF16" else np.asarray(array, np.float32)

    def refuse_unknown(self, used: set[str], architecture: str, tied: bool,
                       droppable: Callable[[str], bool] = lambda name: False) -> None:
        """A tensor we do not map would be silently dropped; that hides a model we do not run.
        Let through only buffers, a tied checkpoint's second copy of the shared matrix and what
        ``droppable`` says is exact to drop."""
        for name in self.names():
            if name in used or name.endswith(IGNORABLE_SUFFIXES):
                continue
            if name == "lm_head.weight" and tied:
                continue  # tied checkpoints sometimes store the shared matrix twice
            if droppable(name):
                continue
            raise ConversionError(f"{self.directory}: unexpected tensor {name!r} in the checkpoint "
                                  f"(not part of {architecture} as NInfer describes it)")

    @property
    def shard_names(self) -> list[str]:
        return sorted(set(self.where.values()))


def chat_template(directory: Path) -> str | None:
    """chat_template.jinja wins (newer transformers save it there), then a processor's
    chat_template.json (multimodal checkpoints), then tokenizer_config.json's."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return _read_text(jinja)
    processor = read_json(directory / "chat_template.json", required=False) or {}
    config = read_json(directory / "tokenizer_config.json", required=False) or {}
    template = processor.get("chat_template", config.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template
                 if isinstance(t, dict) and isinstance(t.get("name"), str)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def tokenizer_json(directory: Path) -> str:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ConversionError(f"{path}: missing (NInfer needs the fast-tokenizer JSON; save the "
                              f"tokenizer with transformers to produce it)")
    return _read_object(path)[0]
