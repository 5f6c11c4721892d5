"""Random bf16 weights made on the GPU by our own fill kernel (``numba_kernels/random_fill.py``).

A model of any dense shape (the Qwen3-8B benchmark shape included) can then run without a 16 GB
file: ``ninfer serve --random-weights CONFIG --device N`` and ``tools/gpu_bench.py`` use this. The
scales follow ``ninfer.convert.random_model``: embeddings ~N(0, 1), projections ~N(0, 1/fan_in),
norm weights ~1 + N(0, 0.01), biases ~N(0, 0.01); each tensor's values depend only on the seed and
its name.

``visible_ids``: the synthetic tokenizer spells only its first ~1k ids, while the model's
vocabulary may hold 151936. Rows of the output head below ``visible_ids`` are scaled by
``VISIBLE_BOOST``, so their logits (std ~4 instead of ~1) fill the sampler's top-k and sampled
tokens are text a client sees; the weight bytes, and so every timing, are unchanged.
"""

from __future__ import annotations

import time
import zlib

import numpy as np

from ninfer.backends.cuda import runtime as rt
from ninfer.backends.cuda.weights import UploadReport, device_layout
from ninfer.models.dense import DenseConfig

VISIBLE_BOOST = 4.0
_THREADS = 256
_MAX_BLOCKS = 8192
_MASK64 = (1 << 64) - 1


def tensor_seed(seed: int, name: str) -> int:
    """64-bit stream key of one tensor: independent of the order tensors are filled in."""
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32(name.encode())) & _MASK64


def scale_and_shift(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    role = name.rsplit(".", 1)[-1]
    if role.endswith("norm"):
        return 0.1, 1.0
    if role == "qkv_bias":
        return 0.1, 0.0
    if role == "embed":
        return 1.0, 0.0
    return shape[-1] ** -0.5, 0.0


def output_head(config: DenseConfig) -> str:
    return "embed" if config.tie_word_embeddings else "lm_head"


def random_device_weights(device: rt.Device, stream, config: DenseConfig, seed: int = 0,
                          visible_ids: int = 0) -> tuple[dict[str, rt.DevicePtr], UploadReport]:
    """Every tensor of ``weights.device_layout(config)`` in one allocation, filled on ``stream``."""
    layout = device_layout(config)
    sizes = {name: int(np.prod(shape)) * (2 if kind == "bf16" else 4) for name, (shape, kind) in layout.items()}
    arena = rt.Arena(device.alloc(sum(-(-n // 256) * 256 for n in sizes.values()), "weights"))
    kernels = rt.Kernels(device)
    head = output_head(config)
    start = time.perf_counter()
    tensors: dict[str, rt.DevicePtr] = {}
    for name, (shape, kind) in layout.items():
        tensors[name] = dst = arena.take(sizes[name], name)
        count = int(np.prod(shape))
        scale, shift = scale_and_shift(name, shape)
        boost_rows = visible_ids if name == head else 0
        blocks = min(-(-count // _THREADS), _MAX_BLOCKS)
        kernels[f"fill_normal_{kind}"].launch(
            (blocks,), (_THREADS,), (dst, count, tensor_seed(seed, name), scale, shift, shape[-1], boost_rows,
                                     VISIBLE_BOOST), stream)
    rt.synchronize(stream)
    return tensors, UploadReport(arena.used, time.perf_counter() - start)


def random_weights_runner(device: rt.Device, config: DenseConfig, seed: int = 0, visible_ids: int = 0,
                          **options):
    """A ``CudaRunner`` over ``random_device_weights`` (``options``: its shape and settings), the fill
    recorded in its startup facts as an artifact's upload would be."""
    from ninfer.backends.cuda.runner import CudaRunner  # the runner module does not need this one

    weights, report = random_device_weights(device, device.stream(), config, seed, visible_ids=visible_ids)
    runner = CudaRunner.from_device_weights(config, weights, device=device, **options)
    runner.startup["weights_bytes"] = report.nbytes
    runner.startup["weights_random_fill_s"] = round(report.seconds, 3)
    return runner
