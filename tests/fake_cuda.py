"""A CUDA backend with no GPU, for CPU tests of what a forward pass launches: a device that hands out
addresses (no memory) and kernels from ptx/manifest.json that type-check their arguments and record
each launch instead of running it."""

from __future__ import annotations

import json

import numpy as np

from ninfer.backends.cuda import runtime as rt
from ninfer.backends.cuda.forward import L2_PREFETCH_MAX


class FakeDevice:
    sm_count = 132  # the H200's

    def __init__(self):
        self.next = 1 << 32

    def alloc(self, nbytes, label):
        ptr = rt.DevicePtr(self.next, nbytes, label)
        self.next += -(-max(1, nbytes) // 4096) * 4096
        return ptr

    def pinned(self, nbytes):
        return np.zeros(nbytes, np.uint8)


class Recorded(rt.Kernel):
    def __init__(self, kernels, name, entry):
        super().__init__(name, None, entry["params"], entry.get("meta"), kernels.overlap)
        self.kernels = kernels

    def launch(self, grid, block, args, stream, shared=0):
        self.pack(args)  # the argument count and types of the manifest
        self.kernels.log.append((self, tuple(grid), tuple(args)))
        self.kernels.overlaps.append(bool(self.overlap.on and self.meta.get("grid_wait")))


class FakeKernels:
    overlapped = rt.Kernels.overlapped

    def __init__(self):
        self.entries = json.loads((rt.PTX_DIR / "manifest.json").read_text())["kernels"]
        self.log = []
        self.overlaps = []  # per launch in ``log``: would it have overlapped its predecessor
        self._kernels = {}
        self.overlap = rt.Overlap()
        self.device = FakeDevice()

    def __getitem__(self, name):
        if name not in self._kernels:
            self._kernels[name] = Recorded(self, name, self.entries[name])
        return self._kernels[name]


def check_decode_gemm(kernel, grid, y, x, w, norm, rows, n, k, ldy, eps, *extra):
    """A fused decode GEMM's launch (its arguments as ``Forward.decode_gemm`` passes them) stays inside
    its buffers, covers its n outputs, and has K % 8 == 0; a ``keep`` kernel's normalised rows (its
    last argument) fit theirs and are not its input; a chained norm's input and partial sums (a
    producer's ``xn, part``, a consumer's ``part, parts``) fit theirs; a ``next`` kernel's prefetch
    stays inside the next GEMM's weights; a "conv" epilogue's (a DeltaNet in_proj's) conv output, slots
    and conv weights fit its channels, the first of its n outputs; a ``head_norm`` GEMV's partial sums
    fit its rows' heads."""
    meta, f32 = kernel.meta, 4
    chain = meta.get("chain")
    if meta["epilogue"] == "conv":
        mixed, states, slot_stride, lanes, lanes_out, channels, conv_w = extra
        assert 0 < channels <= n and mixed.nbytes >= rows * channels * f32 and conv_w.nbytes >= channels * 4 * f32
        assert lanes.nbytes >= rows * 4 and lanes_out.nbytes >= rows * 4 and slot_stride >= 3 * channels
        assert states.addr not in (mixed.addr, y.addr), kernel.name
        extra = ()
    if meta.get("head_norm"):  # the split rule's partial sums of squares, a split count, a head dim dividing k
        partials, splits, head_dim = extra
        assert head_dim % 8 == 0 and k % head_dim == 0 and splits > 0, kernel.name
        assert partials.nbytes >= rows * (k // head_dim) * splits * f32 and partials.addr != x.addr, kernel.name
        extra = ()
    assert len(extra) == (2 if chain else 0) + 2 * meta.get("next", 0) + meta.get("keep", 0), kernel.name
    if meta.get("next"):  # the next GEMM's weights and how many of their first bytes L2 is asked for
        then, ahead = extra[-2:]
        assert 0 < ahead <= then.nbytes and ahead % 16 == 0 and then.addr != w.addr, kernel.name
        assert -(-ahead // grid[0]) <= L2_PREFETCH_MAX, kernel.name  # a block's one request
    if meta.get("keep"):
        assert extra[0].nbytes >= rows * k * f32 and extra[0].addr != x.addr, kernel.name
    if chain == "out":
        xn, part = extra
        assert xn.nbytes >= rows * ldy * f32 and xn.addr not in (x.addr, y.addr), kernel.name
        assert part.nbytes >= grid[0] * 8 * f32 and norm.nbytes >= n * f32, kernel.name
    if chain == "in":
        part, parts = extra
        assert part.nbytes >= parts * 8 * f32 and parts * 16 >= k, kernel.name
    weight_rows = 2 * n if meta["epilogue"] == "swiglu" else n
    assert k % 8 == 0 and rows <= meta["max_rows"] and grid[0] * meta["cols"] >= n, kernel.name
    assert y.nbytes >= rows * ldy * f32 and ldy >= n and x.nbytes >= rows * k * f32, kernel.name
    assert w.nbytes >= weight_rows * k * 2, kernel.name
    assert not meta["normed"] or norm.nbytes >= k * f32, kernel.name
