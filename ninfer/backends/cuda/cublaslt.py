"""bf16 GEMMs on the tensor cores through cuBLASLt (``nvmath.bindings.cublasLt``), for prefill.

``y[rows, n] (fp32, or bf16 rounded to nearest even) = x[rows, k] (bf16) @ W[n, k].T (bf16)``,
accumulated in fp32. In cuBLAS's
column-major terms that is ``y^T = op(W^T) @ x^T`` with ``W`` seen as a ``k x n`` matrix and
transposed ("TN"). One descriptor set and the heuristic's first algorithm (or the one ``choose``
picked among its ``choices``) are cached per shape, so a call costs the cuBLASLt launch only. Decode
never comes here: its GEMVs keep fp32 activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ninfer.backends.cuda import runtime as rt

CUDA_R_32F = 0  # cudaDataType_t
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68  # cublasComputeType_t
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20


@dataclass
class _Plan:
    """A shape's descriptors (matmul, the layouts of W, x and y, the preference), the heuristic's
    results and how many it gave, and the address of the algorithm calls run with."""
    desc: Any
    a: Any
    b: Any
    c: Any
    pref: Any
    results: Any
    count: int
    algo: int


class LtMatmul:
    def __init__(self, workspace: rt.DevicePtr):
        from nvmath.bindings import cublasLt  # the cuda extra; loaded only when prefill asks for it

        self.lt = cublasLt
        self.workspace = workspace
        self.handle = cublasLt.create()
        self._plans: dict[tuple[int, int, int, bool], _Plan] = {}
        self.choices = 1  # algorithms asked of the heuristic per shape (tools/bench_cublaslt_algos.py asks more)
        self._alpha = np.ones(1, np.float32)
        self._beta = np.zeros(1, np.float32)

    def _set(self, setter, obj, attr, value: int) -> None:
        buf = np.array([value], np.int32 if attr != self.lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES else np.uint64)
        setter(obj, attr, buf.ctypes.data, buf.nbytes)

    def _plan(self, rows: int, n: int, k: int, out_bf16: bool) -> _Plan:
        key = (rows, n, k, out_bf16)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        lt = self.lt
        desc = lt.matmul_desc_create(CUBLAS_COMPUTE_32F, CUDA_R_32F)
        self._set(lt.matmul_desc_set_attribute, desc, lt.MatmulDescAttribute.TRANSA, CUBLAS_OP_T)
        self._set(lt.matmul_desc_set_attribute, desc, lt.MatmulDescAttribute.TRANSB, CUBLAS_OP_N)
        a = lt.matrix_layout_create(CUDA_R_16BF, k, n, k)  # W: k x n column-major
        b = lt.matrix_layout_create(CUDA_R_16BF, k, rows, k)  # x: k x rows column-major
        c = lt.matrix_layout_create(CUDA_R_16BF if out_bf16 else CUDA_R_32F, n, rows, n)  # y^T: n x rows
        pref = lt.matmul_preference_create()
        self._set(lt.matmul_preference_set_attribute, pref, lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
                  self.workspace.nbytes)
        results = lt.MatmulHeuristicResult(self.choices)
        count = np.zeros(1, np.int32)
        lt.matmul_algo_get_heuristic(self.handle, desc, a, b, c, c, pref, self.choices, results.ptr,
                                     count.ctypes.data)
        if count[0] < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for bf16 {rows}x{k} @ {k}x{n} -> "
                               + ("bf16" if out_bf16 else "fp32"))
        # The algorithm is the first field of cublasLtMatmulHeuristicResult_t: a result's address is its algorithm's.
        plan = self._plans[key] = _Plan(desc, a, b, c, pref, results, int(count[0]), results.ptr)
        return plan

    def algorithms(self, rows: int, n: int, k: int, out_bf16: bool = False) -> int:
        """How many algorithms the heuristic offered for this shape (at most ``choices``)."""
        return self._plan(rows, n, k, out_bf16).count

    def choose(self, rows: int, n: int, k: int, out_bf16: bool, index: int) -> None:
        """Run this shape with the heuristic's ``index``-th algorithm from now on."""
        plan = self._plan(rows, n, k, out_bf16)
        if not 0 <= index < plan.count:
            raise ValueError(f"cuBLASLt: algorithm {index} of {plan.count}")
        plan.algo = plan.results.ptr + index * self.lt.matmul_heuristic_result_dtype.itemsize

    def matmul(self, y: rt.DevicePtr, x_bf16: rt.DevicePtr, w: rt.DevicePtr, rows: int, n: int, k: int,
               stream, accumulate: bool = False, out_bf16: bool = False) -> None:
        """``y = x @ W.T``, or with ``accumulate`` ``y += x @ W.T`` (beta 1, y read by the epilogue:
        a residual add without a pass of its own, the sum as ``y + (x @ W.T)`` in fp32). With
        ``out_bf16`` y is written as bf16, half the bytes for a product that is only read once more."""
        if y.nbytes < rows * n * (2 if out_bf16 else 4) or x_bf16.nbytes < rows * k * 2 or w.nbytes < n * k * 2:
            raise ValueError(f"cuBLASLt {rows}x{k} @ {k}x{n}: a buffer is too small")
        if accumulate and out_bf16:
            raise ValueError("cuBLASLt: the residual stream it adds into stays fp32")
        plan = self._plan(rows, n, k, out_bf16)
        beta = self._alpha if accumulate else self._beta  # alpha is 1
        self.lt.matmul(self.handle, plan.desc, self._alpha.ctypes.data, w.addr, plan.a, x_bf16.addr, plan.b,
                       beta.ctypes.data, y.addr, plan.c, y.addr, plan.c, plan.algo, self.workspace.addr,
                       self.workspace.nbytes, int(stream))

    def close(self) -> None:
        lt = self.lt
        for plan in self._plans.values():
            lt.matmul_preference_destroy(plan.pref)
            for layout in (plan.a, plan.b, plan.c):
                lt.matrix_layout_destroy(layout)
            lt.matmul_desc_destroy(plan.desc)
        self._plans = {}
        lt.destroy(self.handle)
