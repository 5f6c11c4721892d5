"""The CUDA runtime layer of the CUDA backend, over ``cuda.bindings.driver`` only.

What the runner needs and nothing more: a context on one device with a host-wait policy
(``NINFER_CUDA_SYNC``), streams and events, device allocations sub-allocated from one workspace,
pinned host staging, the PTX modules of ``ptx/`` loaded through their manifest, typed kernel launches
(a wrong argument is a ``TypeError`` before anything reaches the driver) and CUDA Graph capture.
Every driver error is raised as ``CudaError`` carrying the CUDA error name.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cuda.bindings import driver as cu

PTX_DIR = Path(__file__).resolve().parents[3] / "ptx"
SYNC_ENV = "NINFER_CUDA_SYNC"
SYNC_FLAGS = {
    "spin": cu.CUctx_flags.CU_CTX_SCHED_SPIN,  # lowest latency, one core busy while waiting
    "yield": cu.CUctx_flags.CU_CTX_SCHED_YIELD,  # spins but yields the core to other threads
    "blocking": cu.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC,  # sleeps on an interrupt: no CPU, more latency
}
DEFAULT_SYNC = "spin"


class CudaError(RuntimeError):
    """A CUDA driver call failed; ``name`` is the CUDA error name (e.g. ``CUDA_ERROR_OUT_OF_MEMORY``)."""

    def __init__(self, call: str, code: Any):
        self.code = int(code)
        try:  # the enum knows every name without the driver; only the description needs it
            self.name = cu.CUresult(self.code).name
        except ValueError:
            self.name = f"CUresult {self.code}"
        try:
            _, text = cu.cuGetErrorString(code)
            detail = text.decode() if isinstance(text, bytes) else ""
        except Exception:  # no driver library (a CPU machine building the error in a test)
            detail = ""
        super().__init__(f"{call}: {self.name}" + (f" ({detail})" if detail else ""))

    @property
    def sticky(self) -> bool:
        """Errors after which the context is unusable: the engine must report itself unavailable."""
        return self.name in {"CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
                             "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS",
                             "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ECC_UNCORRECTABLE"}


def check(result: Any, call: str) -> Any:
    """Unpack a driver result tuple ``(err, *values)``; raise ``CudaError`` unless success."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(call, err)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def sync_policy(value: str | None = None) -> str:
    value = (value if value is not None else os.environ.get(SYNC_ENV, DEFAULT_SYNC)).strip().lower()
    if value not in SYNC_FLAGS:
        raise ValueError(f"{SYNC_ENV} must be one of {', '.join(SYNC_FLAGS)}, got {value!r}")
    return value


class DevicePtr:
    """An address inside a device allocation, with its size for bounds checks."""

    __slots__ = ("addr", "nbytes", "label")

    def __init__(self, addr: int, nbytes: int, label: str = ""):
        self.addr = int(addr)
        self.nbytes = int(nbytes)
        self.label = label

    def at(self, offset: int, nbytes: int | None = None) -> DevicePtr:
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"{self.label}: [{offset}, {offset + nbytes}) outside {self.nbytes} bytes")
        return DevicePtr(self.addr + offset, nbytes, self.label)

    def __repr__(self) -> str:
        return f"DevicePtr({self.label!r}, 0x{self.addr:x}, {self.nbytes})"


class Arena:
    """Bump sub-allocation of one device allocation (the workspace, or the weights)."""

    def __init__(self, base: DevicePtr, align: int = 256):
        self.base = base
        self.align = align
        self.used = 0
        self.regions: dict[str, int] = {}

    def take(self, nbytes: int, label: str) -> DevicePtr:
        offset = -(-self.used // self.align) * self.align
        if offset + nbytes > self.base.nbytes:
            raise MemoryError(f"{self.base.label}: {label} needs {nbytes} bytes, "
                              f"{self.base.nbytes - offset} left of {self.base.nbytes}")
        self.used = offset + nbytes
        self.regions[label] = nbytes
        return DevicePtr(self.base.addr + offset, nbytes, label)


_current = threading.local()  # .device: the Device whose context this thread made current last


class Device:
    """The primary context of one GPU, made current on the calling thread."""

    def __init__(self, ordinal: int = 0, sync: str | None = None):
        self.sync = sync_policy(sync)
        check(cu.cuInit(0), "cuInit")
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise ValueError(f"device {ordinal} does not exist ({count} CUDA devices)")
        self.ordinal = ordinal
        self.handle = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        check(cu.cuDevicePrimaryCtxSetFlags(self.handle, int(SYNC_FLAGS[self.sync])),
              "cuDevicePrimaryCtxSetFlags")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self.make_current()
        name = check(cu.cuDeviceGetName(256, self.handle), "cuDeviceGetName")
        self.name = name.split(b"\0")[0].decode()
        self.total_memory = check(cu.cuDeviceTotalMem(self.handle), "cuDeviceTotalMem")
        attr = cu.CUdevice_attribute
        self.sm_count = self._attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.capability = (self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                           self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self._allocations: list[int] = []
        self._pinned: list[int] = []
        self._modules: list[Any] = []

    def _attribute(self, which) -> int:
        return check(cu.cuDeviceGetAttribute(which, self.handle), "cuDeviceGetAttribute")

    def make_current(self) -> None:
        """Make the context current on the calling thread. A context stays current on a thread until
        another is set, and in this process only ``make_current`` sets one (torch, in the tools, shares
        this primary context), so a thread whose last call was this device's skips the driver call."""
        if getattr(_current, "device", None) is not self:
            check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            _current.device = self

    def free_memory(self) -> int:
        free, _ = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    def alloc(self, nbytes: int, label: str) -> DevicePtr:
        addr = check(cu.cuMemAlloc(max(1, nbytes)), f"cuMemAlloc({label}, {nbytes} bytes)")
        self._allocations.append(int(addr))
        return DevicePtr(int(addr), nbytes, label)

    def free(self, ptr: DevicePtr) -> None:
        """Return a whole allocation made by ``alloc`` (not a sub-range of one)."""
        if ptr.addr not in self._allocations:
            raise ValueError(f"{ptr.label}: 0x{ptr.addr:x} is not an allocation of this device")
        check(cu.cuMemFree(ptr.addr), f"cuMemFree({ptr.label})")
        self._allocations.remove(ptr.addr)

    def pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host memory as a uint8 array (staging for uploads and step inputs)."""
        addr = check(cu.cuMemHostAlloc(max(1, nbytes), 0), "cuMemHostAlloc")
        self._pinned.append(int(addr))
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(addr)))

    def stream(self):
        return check(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")

    def event(self, timing: bool = False):
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return check(cu.cuEventCreate(int(flags)), "cuEventCreate")

    def load_module(self, ptx: bytes):
        module = check(cu.cuModuleLoadData(ptx + b"\0"), "cuModuleLoadData")
        self._modules.append(module)
        return module

    def close(self) -> None:
        self.make_current()
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        for addr in self._allocations:
            check(cu.cuMemFree(addr), "cuMemFree")
        for addr in self._pinned:
            check(cu.cuMemFreeHost(addr), "cuMemFreeHost")
        for module in self._modules:
            check(cu.cuModuleUnload(module), "cuModuleUnload")
        self._allocations, self._pinned, self._modules = [], [], []
        check(cu.cuDevicePrimaryCtxRelease(self.handle), "cuDevicePrimaryCtxRelease")
        if getattr(_current, "device", None) is self:
            _current.device = None


# -- memory operations on a stream ----------------------------------------------------------------

def copy_h2d(dst: DevicePtr, src: np.ndarray, stream) -> None:
    """Asynchronous when ``src`` is pinned; the caller keeps ``src`` alive until the stream passes."""
    if src.nbytes > dst.nbytes:
        raise ValueError(f"{dst.label}: {src.nbytes} bytes do not fit in {dst.nbytes}")
    check(cu.cuMemcpyHtoDAsync(dst.addr, src.ctypes.data, src.nbytes, stream), f"cuMemcpyHtoDAsync({dst.label})")


def copy_d2h(dst: np.ndarray, src: DevicePtr, stream) -> None:
    if dst.nbytes > src.nbytes:
        raise ValueError(f"{src.label}: asked {dst.nbytes} bytes of {src.nbytes}")
    check(cu.cuMemcpyDtoHAsync(dst.ctypes.data, src.addr, dst.nbytes, stream), f"cuMemcpyDtoHAsync({src.label})")


def copy_d2d(dst: DevicePtr, src: DevicePtr, nbytes: int, stream) -> None:
    if nbytes > dst.nbytes or nbytes > src.nbytes:
        raise ValueError(f"copy of {nbytes} bytes from {src.label} to {dst.label} is out of bounds")
    check(cu.cuMemcpyDtoDAsync(dst.addr, src.addr, nbytes, stream), "cuMemcpyDtoDAsync")


def memset32(dst: DevicePtr, value: int, count: int, stream) -> None:
    if 4 * count > dst.nbytes:
        raise ValueError(f"{dst.label}: memset of {count} words is out of bounds")
    check(cu.cuMemsetD32Async(dst.addr, value & 0xFFFFFFFF, count, stream), "cuMemsetD32Async")


def synchronize(stream) -> None:
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")


def wait_event(event) -> None:
    """Block until the work recorded before ``event`` has finished (as ``NINFER_CUDA_SYNC`` says)."""
    check(cu.cuEventSynchronize(event), "cuEventSynchronize")


# -- kernels --------------------------------------------------------------------------------------

_PACK = {
    "i32": lambda v: np.int64(np.int32(v)).view(np.uint64),
    "i64": lambda v: np.int64(v).view(np.uint64),
    "u64": lambda v: np.uint64(v),
    "f32": lambda v: np.uint64(np.float32(v).view(np.uint32)),
}
_RANGES = {"i32": (-(1 << 31), 1 << 31), "i64": (-(1 << 63), 1 << 63), "u64": (0, 1 << 64)}
_F32_MAX = float(np.finfo(np.float32).max)


class Overlap:
    """Whether launches may overlap their predecessor (programmatic dependent launch): set by
    ``Kernels.overlapped`` and honoured by the kernels whose manifest meta says ``grid_wait``."""

    def __init__(self):
        self.on = False


class Kernel:
    """One PTX entry with its manifest parameter types; ``launch`` checks every argument."""

    def __init__(self, name: str, function, params: Sequence[str], meta: dict | None = None,
                 overlap: Overlap | None = None):
        self.name = name
        self.meta = dict(meta or {})  # launch facts from the manifest (e.g. GEMV columns per block)
        self.function = function
        self.params = tuple(params)
        self.overlap = overlap or Overlap()
        # Argument slots and the pointer array the driver reads; reused by every launch (the
        # driver copies the values at launch, and at capture for graph nodes).
        self._slots = np.zeros(len(self.params), dtype=np.uint64)
        base = self._slots.ctypes.data
        self._pointers = np.array([base + 8 * i for i in range(len(self.params))], dtype=np.uint64)

    def pack(self, args: Sequence[Any]) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        for i, (kind, value) in enumerate(zip(self.params, args)):
            if kind == "ptr":
                if not isinstance(value, DevicePtr):
                    raise TypeError(f"{self.name} argument {i} must be a DevicePtr, got {type(value).__name__}")
                self._slots[i] = value.addr
            elif kind == "f32":
                if not isinstance(value, (float, int, np.floating, np.integer)) or isinstance(value, bool):
                    raise TypeError(f"{self.name} argument {i} must be a float, got {type(value).__name__}")
                # NaN, inf and magnitudes float32 rounds to inf are never a kernel's scale or epsilon:
                # a bug upstream, caught here rather than as NaN logits.
                if not abs(value) <= _F32_MAX:
                    raise TypeError(f"{self.name} argument {i} = {value} does not fit f32")
                self._slots[i] = _PACK[kind](value)
            else:
                if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                    raise TypeError(f"{self.name} argument {i} must be an int ({kind}), got {type(value).__name__}")
                low, high = _RANGES[kind]
                if not low <= int(value) < high:
                    raise TypeError(f"{self.name} argument {i} = {value} does not fit {kind}")
                self._slots[i] = _PACK[kind](int(value))

    def launch(self, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], stream,
               shared: int | None = None) -> None:
        """``shared``: dynamic shared memory bytes; by default the manifest's ``meta["shared"]`` (0 if none)."""
        shared = self.meta.get("shared", 0) if shared is None else shared
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        if min(grid) < 1 or min(block) < 1:
            raise ValueError(f"{self.name}: empty launch grid {grid} block {block}")
        self.pack(args)
        if self.overlap.on and self.meta.get("grid_wait"):
            self._launch_overlapped(grid, block, shared, stream)
            return
        check(cu.cuLaunchKernel(self.function, *grid, *block, shared, stream,
                                self._pointers.ctypes.data, 0), f"cuLaunchKernel({self.name})")

    def _launch_overlapped(self, grid, block, shared: int, stream) -> None:
        """A launch that may begin while the stream's previous kernel runs: this kernel's blocks wait
        for it in ``griddepcontrol.wait`` (numba_kernels/common.py).
        Under stream capture the driver records a programmatic edge between the two graph nodes."""
        attribute = cu.CUlaunchAttribute()
        attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = shared
        config.hStream = stream
        config.attrs = [attribute]
        config.numAttrs = 1
        check(cu.cuLaunchKernelEx(config, self.function, self._pointers.ctypes.data, 0),
              f"cuLaunchKernelEx({self.name})")


class Kernels:
    """The kernels of ``ptx/manifest.json``, each module loaded on first use."""

    def __init__(self, device: Device, directory: Path = PTX_DIR):
        self.device = device
        self.directory = Path(directory)
        manifest = json.loads((self.directory / "manifest.json").read_text())
        self.entries: dict[str, dict] = manifest["kernels"]
        self._loaded: dict[str, Kernel] = {}
        self.overlap = Overlap()

    @contextlib.contextmanager
    def overlapped(self):
        """Launches made inside may overlap their predecessor (see ``Kernel._launch_overlapped``). The
        first launch inside must follow a kernel, not a copy: begin the region after one."""
        self.overlap.on = True
        try:
            yield
        finally:
            self.overlap.on = False

    def __getitem__(self, name: str) -> Kernel:
        kernel = self._loaded.get(name)
        if kernel is None:
            entry = self.entries.get(name)
            if entry is None:
                raise KeyError(f"no kernel {name!r} in {self.directory / 'manifest.json'}")
            module = self.device.load_module((self.directory / entry["file"]).read_bytes())
            function = check(cu.cuModuleGetFunction(module, entry["symbol"].encode()),
                             f"cuModuleGetFunction({entry['symbol']})")
            shared = entry.get("meta", {}).get("shared", 0)
            if shared:  # opt in to this much dynamic shared memory (static + dynamic past 48 KiB needs it)
                attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                check(cu.cuFuncSetAttribute(function, attribute, shared), f"cuFuncSetAttribute({name})")
            kernel = self._loaded[name] = Kernel(name, function, entry["params"], entry.get("meta"), self.overlap)
        return kernel


# -- graphs ---------------------------------------------------------------------------------------

class Graph:
    """A captured stream region, instantiated once and replayed."""

    def __init__(self, graph, exec_graph, nodes: int):
        self.graph = graph
        self.exec = exec_graph
        self.nodes = nodes

    @classmethod
    def capture(cls, stream, record) -> Graph:
        """Capture everything ``record()`` enqueues on ``stream`` (nothing runs during capture)."""
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(cu.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        try:
            record()
        finally:
            graph = check(cu.cuStreamEndCapture(stream), "cuStreamEndCapture")
        _, nodes = check(cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        exec_graph = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return cls(graph, exec_graph, int(nodes))

    def launch(self, stream) -> None:
        check(cu.cuGraphLaunch(self.exec, stream), "cuGraphLaunch")

    def destroy(self) -> None:
        check(cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
        check(cu.cuGraphDestroy(self.graph), "cuGraphDestroy")
