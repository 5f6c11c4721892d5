"""``fragment_order``: the weight order a ``FRAG`` decode GEMM build reads (numba_kernels/gemm.py)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_kernels.gemm import fragment_order


def kernel_row(block: int, tile: int, i: int, tiles: int, cols: int, swiglu: bool) -> int | None:
    """The weight row that row ``i`` of a block's tile holds, as the row-major build's ``weight_row``
    finds it (None: past the matrix)."""
    if swiglu:
        j = (block * tiles + tile) * 8 + (i & 7)
        return j + (i >> 3) * cols if j < cols else None
    f = (block * tiles + tile) * 16 + i
    return f if f < cols else None


@pytest.mark.parametrize("tiles,swiglu,rows,k", [(4, True, 2 * 40, 70), (1, False, 37, 64), (2, False, 64, 32)])
def test_a_lane_reads_what_the_row_major_build_would(tiles, swiglu, rows, k):
    """Lane 4g + t of chunk ((block * steps + step) * tiles + tile) * 2 + half finds the 8 weights of row
    g + 8 half of that tile at k = 32 step + 8 t (zeros past the matrix), as ``load_fragments`` reads."""
    w = np.arange(1, rows * k + 1, dtype=np.int64).reshape(rows, k)  # no weight is zero
    cols = rows // 2 if swiglu else rows
    flat = fragment_order(w, tiles, swiglu).reshape(-1)
    blocks, steps = -(-cols // (tiles * (8 if swiglu else 16))), -(-k // 32)
    assert flat.size == blocks * steps * tiles * 2 * 32 * 8
    for block in range(blocks):
        for step in range(steps):
            for tile in range(tiles):
                for half in range(2):
                    chunk = ((block * steps + step) * tiles + tile) * 2 + half
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        got = flat[(chunk * 32 + lane) * 8:][:8]
                        row = kernel_row(block, tile, g + 8 * half, tiles, cols, swiglu)
                        k0 = 32 * step + 8 * t
                        want = np.zeros(8, np.int64)
                        if row is not None:
                            part = w[row, k0:k0 + 8]
                            want[:part.size] = part
                        assert np.array_equal(got, want), (block, step, tile, half, lane)
