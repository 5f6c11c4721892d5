"""The reference backend's weights: upcast once to float32 and laid out for BLAS.

Source tensors use the canonical names and the ``[out, in]`` orientation of ``ninfer.models.dense``.
Each projection is stored transposed and contiguous (``[in, out]``) so that ``x @ w`` streams the
weight row by row, which is what OpenBLAS's small-batch GEMM reads fastest. The tied LM head keeps
the embedding table and multiplies by its transpose view: no second copy of the largest tensor.
"""

from __future__ import annotations

from typing import Callable, Mapping

import attrs
import numpy as np

from ninfer.artifact import bf16
from ninfer.models.dense import DenseConfig, tensor_names


def to_float32(array: np.ndarray) -> np.ndarray:
    """float32 copy of a weight: uint16 arrays are bf16 bit patterns (the artifact's convention)."""
    if array.dtype == np.uint16:
        return bf16.to_float32(array)
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        return array.astype(np.float32)  # always a copy: never a view into a file map
    raise ValueError(f"weight dtype {array.dtype} is not a floating-point or bf16 tensor")


@attrs.define(slots=True)
class LayerWeights:
    attn_norm: np.ndarray  # [h]
    qkv: np.ndarray  # [h, qkv_size]
    qkv_bias: np.ndarray | None  # [qkv_size]
    q_norm: np.ndarray | None  # [head_dim]
    k_norm: np.ndarray | None  # [head_dim]
    o: np.ndarray  # [q_size, h]
    mlp_norm: np.ndarray  # [h]
    gate_up: np.ndarray  # [h, 2 * intermediate]
    down: np.ndarray  # [intermediate, h]


@attrs.define(slots=True)
class ModelWeights:
    embed: np.ndarray  # [vocab, h]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [h]
    lm_head: np.ndarray  # [h, vocab]; a transposed view of ``embed`` when tied


class CheckedReader:
    """Reads canonical tensors through ``get(name)``, checks each shape against the model
    description and returns contiguous float32 copies (``transposed``: ``[in, out]``)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], get: Callable[[str], np.ndarray]):
        self.shapes = shapes
        self._get = get

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def vector(self, name: str) -> np.ndarray:
        array, shape = self._get(name), tuple(self.shapes[name])
        if tuple(array.shape) != shape:
            raise ValueError(f"weights: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
        return np.ascontiguousarray(to_float32(array))

    def transposed(self, name: str) -> np.ndarray:
        return np.ascontiguousarray(self.vector(name).T)


def mapping_getter(tensors: Mapping[str, np.ndarray]) -> Callable[[str], np.ndarray]:
    """``get(name)`` over in-memory canonical tensors, naming the one that is missing."""

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"weights: canonical tensor {name!r} is missing")
        return tensors[name]

    return get


def load_weights(config: DenseConfig, get: Callable[[str], np.ndarray]) -> ModelWeights:
    """Read every canonical tensor through ``get(name)``, check its shape, upcast and lay it out."""
    read = CheckedReader(tensor_names(config), get)

    def optional(name: str) -> np.ndarray | None:
        return read.vector(name) if name in read else None

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layers.append(
            LayerWeights(
                attn_norm=read.vector(p + "attn_norm"),
                qkv=read.transposed(p + "qkv"),
                qkv_bias=optional(p + "qkv_bias"),
                q_norm=optional(p + "q_norm"),
                k_norm=optional(p + "k_norm"),
                o=read.transposed(p + "o"),
                mlp_norm=read.vector(p + "mlp_norm"),
                gate_up=read.transposed(p + "gate_up"),
                down=read.transposed(p + "down"),
            )
        )
    embed = read.vector("embed")
    lm_head = embed.T if config.tie_word_embeddings else read.transposed("lm_head")
    return ModelWeights(embed=embed, layers=layers, final_norm=read.vector("final_norm"), lm_head=lm_head)
