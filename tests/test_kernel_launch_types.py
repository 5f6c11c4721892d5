"""Typed kernel launches on the CPU: ``runtime.Kernel`` packs and checks every argument against the
manifest's parameter types before anything reaches the driver (the GPU side: tests/cuda/test_cuda_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest

rt = pytest.importorskip("ninfer.backends.cuda.runtime")

# A kernel of every parameter kind the manifest uses; no function: pack() never touches the driver.
PARAMS = ("ptr", "i32", "i64", "u64", "f32")


def _kernel() -> "rt.Kernel":
    return rt.Kernel("probe", None, PARAMS)


def _args(**change):
    args = {"ptr": rt.DevicePtr(0x1000, 64, "buf"), "i32": 7, "i64": 8, "u64": 9, "f32": 0.5}
    args.update(change)
    return [args[k] for k in PARAMS]


def test_pack_writes_the_bits_the_kernel_reads():
    kernel = _kernel()
    kernel.pack(_args(i32=-1, i64=-(2**40), u64=2**64 - 1, f32=np.float32(1.5)))
    slots = kernel._slots.view(np.int64)
    assert kernel._slots[0] == 0x1000
    assert int(slots[1]) == -1 and np.int32(slots[1]) == -1  # the low 32 bits are the int32
    assert int(slots[2]) == -(2**40) and int(kernel._slots[3]) == 2**64 - 1
    assert np.uint32(kernel._slots[4]).view(np.float32) == np.float32(1.5)
    kernel.pack(_args(i32=np.int64(3), f32=2))  # NumPy integers for ints, an int for a float
    assert int(slots[1]) == 3 and np.uint32(kernel._slots[4]).view(np.float32) == 2.0


def test_wrong_argument_count():
    with pytest.raises(TypeError, match="probe takes 5 arguments, got 4"):
        _kernel().pack(_args()[:4])
    with pytest.raises(TypeError, match="takes 5 arguments, got 6"):
        _kernel().pack(_args() + [1])


@pytest.mark.parametrize("kind, value, message", [
    ("ptr", 0x1000, "argument 0 must be a DevicePtr, got int"),  # a raw address: no bounds to check
    ("i32", 4.0, r"argument 1 must be an int \(i32\), got float"),
    ("i32", np.float32(4), r"argument 1 must be an int \(i32\), got float32"),
    ("i64", "8", r"argument 2 must be an int \(i64\), got str"),
    ("f32", "0.5", "argument 4 must be a float, got str"),
    ("f32", None, "argument 4 must be a float, got NoneType"),
])
def test_wrong_kind(kind, value, message):
    with pytest.raises(TypeError, match=message):
        _kernel().pack(_args(**{kind: value}))


@pytest.mark.parametrize("kind, value", [
    ("i32", 2**31), ("i32", -(2**31) - 1), ("i32", np.int64(2**32)),  # would wrap silently in the int32 slot
    ("i64", 2**63), ("u64", -1), ("u64", 2**64),
    ("f32", 1e39), ("f32", float("inf")), ("f32", float("nan")), ("f32", 2**200),  # inf/NaN in the kernel
])
def test_out_of_range(kind, value):
    index = PARAMS.index(kind)
    with pytest.raises(TypeError, match=f"argument {index} = .* does not fit {kind}"):
        _kernel().pack(_args(**{kind: value}))


def test_range_edges_are_accepted():
    kernel = _kernel()
    kernel.pack(_args(i32=2**31 - 1, i64=-(2**63), u64=0, f32=float(np.finfo(np.float32).max)))
    kernel.pack(_args(i32=-(2**31), f32=-1e-45))


@pytest.mark.parametrize("kind", ["i32", "i64", "u64", "f32"])
def test_bool_is_not_a_number(kind):
    """``True`` is an int to Python; as a kernel argument it is a flag passed where a size belongs."""
    with pytest.raises(TypeError, match="got bool"):
        _kernel().pack(_args(**{kind: True}))


def test_empty_launch_is_refused_before_the_driver():
    kernel = _kernel()
    with pytest.raises(ValueError, match="probe: empty launch grid"):
        kernel.launch((0,), (32,), _args(), stream=None)
    with pytest.raises(ValueError, match="empty launch"):
        kernel.launch((1,), (32, 0), _args(), stream=None)
