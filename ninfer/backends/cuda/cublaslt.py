"""bf16 GEMMs on the tensor cores through cuBLASLt (``nvmath.bindings.cublasLt``), for prefill.

``y[rows, n] (fp32, or bf16 rounded to nearest even) = x[rows, k] (bf16) @ W[n, k].T (bf16)``,
accumulated in fp32. In cuBLAS's
column-major terms that is ``y^T = op(W^T) @ x^T`` with ``W`` seen as a ``k x n`` matrix and
transposed ("TN"). One descriptor set and the heuristic's first algorithm (or the one ``choose``
picked among its ``choices``, or the fastest ``tune`` timed) are cached per shape, so a call costs the
cuBLASLt launch only. Decode never comes here: its GEMVs keep fp32 activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ninfer.backends.cuda import runtime as rt

CUDA_R_32F = 0  # cudaDataType_t
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68  # cublasComputeType_t
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20
TUNE_CHOICES = 8  # algorithms ``tune`` asks the heuristic for and times
TUNE_ROUNDS = 3  # timed passes over every algorithm, interleaved (clocks drift during a burst)
KEEP_FIRST_WITHIN = 0.02  # the heuristic's pick stays unless another is this much faster
# Fewer rows are not tuned: timed alone, back to back over the layers, the GEMMs of a 1024-row chunk
# ranked an algorithm first that made whole prefills 1% slower (docs/benchmarks.md, thirty-second
# session); from 4096 rows a prefill is GEMMs enough that the tuned ones won.
TUNE_MIN_ROWS = 4096


def fastest(ms: Sequence[float], keep_first_within: float = KEEP_FIRST_WITHIN) -> int:
    """Index of the algorithm to run given each one's time (``inf``: it failed): the fastest, unless
    the heuristic's first is within ``keep_first_within`` of it (run-to-run noise is that large, and
    the first pick is the one every other cuBLASLt user runs)."""
    best = min(range(len(ms)), key=ms.__getitem__)
    if ms[best] == float("inf"):
        raise RuntimeError("cuBLASLt: every algorithm failed")
    return 0 if ms[0] <= ms[best] * (1 + keep_first_within) else best


@dataclass
class _Plan:
    """A shape's descriptors (matmul, the layouts of W, x and y, the preference), the heuristic's
    results, how many were asked for and how many it gave, and the address of the algorithm calls
    run with."""
    desc: Any
    a: Any
    b: Any
    c: Any
    pref: Any
    results: Any
    asked: int
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
        self._recorded: dict | None = None  # what ``recording`` notes, while it does
        # Counts changes of a planned shape's algorithm (``choose``, a plan made again): a CUDA graph
        # that captured these GEMMs replays the algorithms of the generation it was captured in.
        self.generation = 0

    def _set(self, setter, obj, attr, value: int) -> None:
        buf = np.array([value], np.int32 if attr != self.lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES else np.uint64)
        setter(obj, attr, buf.ctypes.data, buf.nbytes)

    def _plan(self, rows: int, n: int, k: int, out_bf16: bool, choices: int | None = None) -> _Plan:
        """The shape's plan, made on first use with the heuristic's first ``choices`` algorithms (made
        again where it has fewer than ``choices`` asks for)."""
        key = (rows, n, k, out_bf16)
        choices = choices or self.choices
        plan = self._plans.get(key)
        if plan is not None and plan.asked >= choices:
            return plan
        if plan is not None:
            self._destroy(self._plans.pop(key))
            self.generation += 1
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
        results = lt.MatmulHeuristicResult(choices)
        count = np.zeros(1, np.int32)
        lt.matmul_algo_get_heuristic(self.handle, desc, a, b, c, c, pref, choices, results.ptr,
                                     count.ctypes.data)
        if count[0] < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for bf16 {rows}x{k} @ {k}x{n} -> "
                               + ("bf16" if out_bf16 else "fp32"))
        # The algorithm is the first field of cublasLtMatmulHeuristicResult_t: a result's address is its algorithm's.
        plan = self._plans[key] = _Plan(desc, a, b, c, pref, results, choices, int(count[0]),
                                          results.ptr)
        return plan

    def algorithms(self, rows: int, n: int, k: int, out_bf16: bool = False) -> int:
        """How many algorithms the heuristic offered for this shape (at most ``choices``)."""
        return self._plan(rows, n, k, out_bf16).count

    def choose(self, rows: int, n: int, k: int, out_bf16: bool, index: int) -> None:
        """Run this shape with the heuristic's ``index``-th algorithm from now on."""
        plan = self._plan(rows, n, k, out_bf16)
        if not 0 <= index < plan.count:
            raise ValueError(f"cuBLASLt: algorithm {index} of {plan.count}")
        algo = plan.results.ptr + index * self.lt.matmul_heuristic_result_dtype.itemsize
        if algo != plan.algo:
            plan.algo = algo
            self.generation += 1

    @contextlib.contextmanager
    def recording(self):
        """Note every ``matmul`` in the block (it still runs): the shape, its buffers and flags, and
        each weight matrix it was called with, for ``tune_recorded``. Shapes first planned here ask
        the heuristic for ``TUNE_CHOICES`` algorithms."""
        self._recorded = {}
        try:
            yield
        except BaseException:
            self._recorded = None
            raise

    def tune_recorded(self, stream, events) -> dict[str, dict]:
        """``tune`` every shape noted by ``recording`` over the weights it was called with. Returns,
        by shape (``ROWSxKxN``), each algorithm's milliseconds a call and the one chosen."""
        report, recorded, self._recorded = {}, self._recorded or {}, None
        for (rows, n, k, out_bf16), (y, x, accumulate, weights) in recorded.items():
            ms = self.tune(y, x, weights, rows, n, k, stream, events, accumulate=accumulate, out_bf16=out_bf16)
            report[f"{rows}x{k}x{n}"] = {"ms": [round(t, 4) for t in ms], "chose": self._chosen(rows, n, k, out_bf16)}
        return report

    def tune(self, y: rt.DevicePtr, x_bf16: rt.DevicePtr, weights: Sequence[rt.DevicePtr], rows: int, n: int,
             k: int, stream, events, accumulate: bool = False, out_bf16: bool = False,
             rounds: int = TUNE_ROUNDS, choices: int = TUNE_CHOICES) -> list[float]:
        """Time the algorithms of this shape's plan (the heuristic's first ``choices`` where the plan
        is made here, or had fewer) and run the ``fastest`` from now on. Each timing is one call per matrix of
        ``weights`` (a model's layers: more bytes than L2 holds, as a prefill pass reads them), the
        algorithms taken in turn ``rounds`` times after one untimed turn; ``events``: two timing
        events. Returns each algorithm's median milliseconds a call (``inf`` where it failed)."""
        plan = self._plan(rows, n, k, out_bf16, choices)
        start, stop = events
        samples: list[list[float]] = [[] for _ in range(plan.count)]
        for turn in range(rounds + 1):
            for index in range(plan.count):
                if samples[index] and samples[index][-1] == float("inf"):
                    continue
                self.choose(rows, n, k, out_bf16, index)
                try:
                    rt.check(rt.cu.cuEventRecord(start, stream), "cuEventRecord")
                    for w in weights:
                        self.matmul(y, x_bf16, w, rows, n, k, stream, accumulate=accumulate, out_bf16=out_bf16)
                    rt.check(rt.cu.cuEventRecord(stop, stream), "cuEventRecord")
                    rt.synchronize(stream)
                except self.lt.cuBLASLtError:  # an algorithm may refuse this shape at run time: not a candidate
                    samples[index].append(float("inf"))
                    continue
                if turn:
                    ms = rt.check(rt.cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime")
                    samples[index].append(ms / len(weights))
        ms = [float(np.median(times)) if times else float("inf") for times in samples]
        self.choose(rows, n, k, out_bf16, fastest(ms))
        return ms

    def _chosen(self, rows: int, n: int, k: int, out_bf16: bool) -> int:
        plan = self._plans[(rows, n, k, out_bf16)]
        return (plan.algo - plan.results.ptr) // self.lt.matmul_heuristic_result_dtype.itemsize

    def chosen(self) -> dict[tuple[int, int, int, bool], int]:
        """The algorithm each planned shape runs, by ``(rows, n, k, out_bf16)``: for ``choose_all``."""
        return {key: self._chosen(*key) for key in self._plans}

    def choose_all(self, chosen: dict[tuple[int, int, int, bool], int]) -> None:
        for key, index in chosen.items():
            self.choose(*key, index)

    def matmul(self, y: rt.DevicePtr, x_bf16: rt.DevicePtr, w: rt.DevicePtr, rows: int, n: int, k: int,
               stream, accumulate: bool = False, out_bf16: bool = False) -> None:
        """``y = x @ W.T``, or with ``accumulate`` ``y += x @ W.T`` (beta 1, y read by the epilogue:
        a residual add without a pass of its own, the sum as ``y + (x @ W.T)`` in fp32). With
        ``out_bf16`` y is written as bf16, half the bytes for a product that is only read once more."""
        if y.nbytes < rows * n * (2 if out_bf16 else 4) or x_bf16.nbytes < rows * k * 2 or w.nbytes < n * k * 2:
            raise ValueError(f"cuBLASLt {rows}x{k} @ {k}x{n}: a buffer is too small")
        if accumulate and out_bf16:
            raise ValueError("cuBLASLt: the residual stream it adds into stays fp32")
        plan = self._plan(rows, n, k, out_bf16, TUNE_CHOICES if self._recorded is not None else None)
        if self._recorded is not None:
            noted = self._recorded.setdefault((rows, n, k, out_bf16), (y, x_bf16, accumulate, []))
            if all(w.addr != seen.addr for seen in noted[3]):
                noted[3].append(w)
        beta = self._alpha if accumulate else self._beta  # alpha is 1
        self.lt.matmul(self.handle, plan.desc, self._alpha.ctypes.data, w.addr, plan.a, x_bf16.addr, plan.b,
                       beta.ctypes.data, y.addr, plan.c, y.addr, plan.c, plan.algo, self.workspace.addr,
                       self.workspace.nbytes, int(stream))

    def _destroy(self, plan: _Plan) -> None:
        lt = self.lt
        lt.matmul_preference_destroy(plan.pref)
        for layout in (plan.a, plan.b, plan.c):
            lt.matrix_layout_destroy(layout)
        lt.matmul_desc_destroy(plan.desc)

    def close(self) -> None:
        for plan in self._plans.values():
            self._destroy(plan)
        self._plans = {}
        self.lt.destroy(self.handle)
