"""Helpers for the GPU tests: device arrays from NumPy and back, through the runtime only."""

from __future__ import annotations

import numpy as np

from ninfer.backends.cuda import runtime as rt


class Gpu:
    def __init__(self):
        self.device = rt.Device(0)
        self.stream = self.device.stream()
        self.kernels = rt.Kernels(self.device)

    def put(self, array: np.ndarray, label: str = "test") -> rt.DevicePtr:
        array = np.ascontiguousarray(array)
        ptr = self.device.alloc(array.nbytes, label)
        rt.check(rt.cu.cuMemcpyHtoD(ptr.addr, array.ctypes.data, array.nbytes), "cuMemcpyHtoD")
        return ptr

    def empty(self, nbytes: int, poison: int = 0x7FC00001) -> rt.DevicePtr:
        """Filled with a NaN pattern so unwritten outputs show up."""
        ptr = self.device.alloc(nbytes, "out")
        rt.memset32(ptr, poison, -(-nbytes // 4), self.stream)
        return ptr

    def get(self, ptr: rt.DevicePtr, dtype, shape) -> np.ndarray:
        out = np.empty(shape, dtype)
        rt.synchronize(self.stream)
        rt.check(rt.cu.cuMemcpyDtoH(out.ctypes.data, ptr.addr, out.nbytes), "cuMemcpyDtoH")
        return out

    def launch(self, name, grid, block, args):
        self.kernels[name].launch(grid, block, args, self.stream)
        rt.synchronize(self.stream)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (an element was not written?)"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
