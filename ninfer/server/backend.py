"""Which ModelRunner serves: the CUDA backend on ``--device N`` (default 0), or the reference backend
with ``--device cpu``.

A CUDA context is current per thread, and the Engine makes every runner call on its worker
thread; so the CUDA runner is built lazily, on its first use, which is the worker building the
engine core. ``WorkerBuiltRunner`` is that deferral and forwards everything the runner exposes:
the ModelRunner protocol and the optional members the Engine probes for (``config`` for the model
signature, the StateImage methods of recurrent models).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from ninfer.engine import EngineConfig


class WorkerBuiltRunner:
    def __init__(self, build: Callable[[], Any]):
        self._build = build
        self._runner: Any = None

    @property
    def runner(self) -> Any:
        if self._runner is None:
            self._runner = self._build()
        return self._runner

    def __getattr__(self, name: str) -> Any:
        # Only for names this wrapper lacks: the first one builds the runner (on the worker thread).
        return getattr(self.runner, name)

    def close(self) -> None:  # never builds a runner just to close it
        if self._runner is not None:
            self._runner.close()


def cuda_available() -> bool:
    """Whether the cuda extra is installed and a GPU answers (no context is created)."""
    try:
        from cuda.bindings import driver

        err, = driver.cuInit(0)
    except Exception:  # no bindings, or bindings without a driver library (a machine without a GPU)
        return False
    if err != driver.CUresult.CUDA_SUCCESS:
        return False
    err, count = driver.cuDeviceGetCount()
    return err == driver.CUresult.CUDA_SUCCESS and count > 0


def prefill_gemm() -> str:
    """Prefill GEMMs on the tensor cores through cuBLASLt when nvmath-python (the cuda extra) is
    installed: about 3x our fp32 kernel at 8192 tokens (docs/benchmarks.md), with each GEMM of a whole
    chunk running the fastest of the heuristic's algorithms, timed at startup; else the fp32 kernel."""
    import importlib.util

    return "cublaslt-tuned" if importlib.util.find_spec("nvmath") is not None else "fp32"


def prefill_rows(config: EngineConfig) -> int:
    """The runner's prefill sub-chunk: one whole Engine chunk (``--prefill-chunk``, no longer than a
    sequence can be), so a chunk is one pass of launches. Larger passes run the prefill GEMMs at larger
    M and, in a MoE model, stream each expert's weights once per pass instead of once per 512 rows."""
    return min(config.prefill_chunk, config.max_context)


class BackendStartError(Exception):
    """The backend cannot start on this machine (bad device, memory, driver); ``ninfer serve`` ends with
    this one line."""


def host_arena(config: EngineConfig) -> dict[str, int]:
    """The runner's pinned Host backing: exactly the Engine's Host budget (``--host-context-mib``; by
    default 8 GiB plus eight StateImages, whose size the runner knows; 0: no Host backing, no arena)."""
    return {"host_arena_bytes": config.host_context_bytes, "host_arena_state_images": config.host_state_images}


def cuda_runner(model: Any, args: argparse.Namespace, config: EngineConfig) -> WorkerBuiltRunner:
    """``model``: an artifact path, or a ``RandomWeightsModel`` whose weights are made on the GPU.
    With ``--kv-capacity auto`` the runner sizes its KV pool itself (``runner.info.num_pages``). The
    runner pins the Host budget once, at startup (``host_arena``)."""
    num_pages = "auto" if args.kv_capacity == "auto" else config.kv_pages
    shape = dict(page_size=config.page_size, num_pages=num_pages, max_batch=config.max_concurrency,
                 max_context=config.max_context, kv_dtype=args.kv_dtype, cuda_graph=not args.no_cuda_graph,
                 max_prefill_rows=prefill_rows(config), prefill_gemm=prefill_gemm(), **host_arena(config))

    def build():
        from ninfer.backends.cuda import runtime

        try:
            return _build_cuda_runner(model, args, config, shape)
        # A device that does not exist, memory the sizing cannot fit, a driver error: the operator's
        # input or machine is wrong, so startup ends with one line naming the device, not a traceback.
        except (runtime.CudaError, MemoryError, ValueError) as e:
            raise BackendStartError(f"cannot start the CUDA backend on device {args.device}: {e}") from e

    return WorkerBuiltRunner(build)


def _build_cuda_runner(model: Any, args: argparse.Namespace, config: EngineConfig, shape: dict[str, Any]) -> Any:
    if isinstance(model, str):  # a hybrid artifact gets CudaHybridRunner with the checkpoint slots
        from ninfer.backends.cuda.hybrid_runner import open_runner

        return open_runner(model, device=args.device, state_slots=config.state_slots - config.max_concurrency,
                           **shape)
    from ninfer.backends.cuda import runtime
    from ninfer.backends.cuda.random_weights import random_weights_runner

    return random_weights_runner(runtime.Device(args.device), model.dense, model.seed, model.visible_ids, **shape)
