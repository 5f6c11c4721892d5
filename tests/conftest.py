"""Shared test configuration: GPU tests run only where a GPU and the cuda extra are present."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _gpu_available() -> bool:
    try:
        from cuda.bindings import driver  # type: ignore[import-not-found]

        err, = driver.cuInit(0)
    except Exception:  # no bindings, or bindings without a driver library (a CPU machine)
        return False
    if err != driver.CUresult.CUDA_SUCCESS:
        return False
    err, count = driver.cuDeviceGetCount()
    return err == driver.CUresult.CUDA_SUCCESS and count > 0


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with the cuda extra (pytest -m cuda on the GPU host)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
