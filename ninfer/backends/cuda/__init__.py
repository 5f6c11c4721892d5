"""The CUDA backend: ``CudaRunner`` on one NVIDIA GPU (needs the ``cuda`` extra and a driver).

Imported lazily so that CPU-only installs can import ``ninfer.backends.cuda`` for its docs and
fail only when a runner is built.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "CudaRunner":
        from ninfer.backends.cuda.runner import CudaRunner

        return CudaRunner
    raise AttributeError(name)


__all__ = ["CudaRunner"]
