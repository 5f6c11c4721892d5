"""cuBLASLt's algorithm choice for the prefill GEMMs (``LtMatmul``), on the CPU: a fake ``cublasLt``
module whose heuristic offers numbered algorithms, and fake timing events whose elapsed time is what
the algorithm the last call ran is given to cost."""

from __future__ import annotations

import types

import numpy as np
import pytest

cublaslt = pytest.importorskip("ninfer.backends.cuda.cublaslt")

from ninfer.backends.cuda import runtime as rt  # noqa: E402

SUCCESS = rt.cu.CUresult.CUDA_SUCCESS
ITEM = 1024  # bytes of a fake heuristic result; a result's address is its algorithm's


class FakeLt:
    """The calls LtMatmul makes; ``offers`` algorithms per shape; ``ran``: the algorithm index and the
    weights of each matmul."""

    MatmulDescAttribute = types.SimpleNamespace(TRANSA=0, TRANSB=1)
    MatmulPreferenceAttribute = types.SimpleNamespace(MAX_WORKSPACE_BYTES=2)
    matmul_heuristic_result_dtype = np.dtype((np.void, ITEM))

    class cuBLASLtError(Exception):
        pass

    def __init__(self, offers=5, refuses=()):
        self.offers, self.refuses, self.ran, self.asked = offers, set(refuses), [], []
        self._results = []

    def MatmulHeuristicResult(self, n):
        result = types.SimpleNamespace(ptr=(len(self._results) + 1) << 32)
        self._results.append(result)
        return result

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, choices, results_ptr, count_ptr):
        self.asked.append(choices)
        np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int32 * 1).from_address(count_ptr))[0] = min(choices, self.offers)

    def matmul(self, handle, desc, alpha, w, a, x, b, beta, y, c, d, dc, algo, workspace, nbytes, stream):
        index = (algo & 0xFFFFFFFF) // ITEM
        if index in self.refuses:
            raise self.cuBLASLtError("CUBLAS_STATUS_NOT_SUPPORTED")
        self.ran.append((index, w))

    def __getattr__(self, name):  # create / set_attribute / destroy calls: nothing to keep
        return lambda *args: 0


@pytest.fixture
def lt(monkeypatch):
    """An LtMatmul over FakeLt whose events measure ``cost[algorithm]`` ms a call."""
    matmul = cublaslt.LtMatmul.__new__(cublaslt.LtMatmul)
    fake = FakeLt()
    matmul.lt, matmul.workspace, matmul.handle = fake, rt.DevicePtr(1 << 40, 1 << 20, "ws"), 0
    matmul._plans, matmul.choices, matmul._recorded, matmul.generation = {}, 1, None, 0
    matmul._alpha, matmul._beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    matmul.cost = {0: 1.0, 1: 0.9, 2: 0.8, 3: 1.2, 4: 0.85}
    marks = {}

    def record(event, stream):
        marks[event] = len(fake.ran)
        return (SUCCESS,)

    def elapsed(start, stop):
        return SUCCESS, sum(matmul.cost[index] for index, _ in fake.ran[marks[start]:marks[stop]])

    monkeypatch.setattr(rt.cu, "cuEventRecord", record)
    monkeypatch.setattr(rt.cu, "cuEventElapsedTime", elapsed)
    monkeypatch.setattr(rt, "synchronize", lambda stream: None)
    return matmul


def buf(addr, nbytes=1 << 30):
    return rt.DevicePtr(addr << 32, nbytes, f"buf{addr}")


def test_fastest_keeps_the_first_pick_within_noise():
    inf = float("inf")
    assert cublaslt.fastest([1.0, 0.9, 0.95]) == 1
    assert cublaslt.fastest([1.0, 0.99]) == 0  # 1% faster: within KEEP_FIRST_WITHIN
    assert cublaslt.fastest([inf, 2.0]) == 1
    with pytest.raises(RuntimeError):
        cublaslt.fastest([inf, inf])


def test_recording_notes_each_shape_with_its_distinct_weights(lt):
    x, y = buf(1), buf(2)
    layers = [buf(10 + i) for i in range(3)]
    with lt.recording():
        for _ in range(2):  # two passes over the same layers: each weight matrix noted once
            for w in layers:
                lt.matmul(y, x, w, 64, 128, 256, 0, out_bf16=True)
                lt.matmul(y, x, w, 64, 256, 128, 0, accumulate=True)
    assert lt.choices == 1 and lt.lt.asked == [cublaslt.TUNE_CHOICES] * 2
    report = lt.tune_recorded(0, ("start", "stop"))
    assert set(report) == {"64x256x128", "64x128x256"}
    for timed in report.values():
        assert timed["chose"] == 2 and timed["ms"] == pytest.approx([1.0, 0.9, 0.8, 1.2, 0.85])
    lt.lt.ran.clear()
    lt.matmul(y, x, layers[0], 64, 128, 256, 0, out_bf16=True)  # no longer noted; runs the chosen algorithm
    assert lt.lt.ran == [(2, layers[0].addr)] and lt._recorded is None


def test_tune_times_every_weight_and_skips_refusing_algorithms(lt):
    x, y, layers = buf(1), buf(2), [buf(10 + i) for i in range(4)]
    lt.lt.refuses = {2}
    ms = lt.tune(y, x, layers, 64, 128, 256, 0, ("start", "stop"), rounds=2)
    assert ms[2] == float("inf") and ms[4] == pytest.approx(0.85)  # 4 calls of 0.85 ms over 4 weights
    assert lt.chosen() == {(64, 128, 256, False): 4}
    timed = [w for index, w in lt.lt.ran if index == 4]
    assert timed == [w.addr for w in layers] * 3  # one untimed turn, two timed


def test_a_plan_made_with_one_choice_is_made_again_for_tuning(lt):
    x, y, w = buf(1), buf(2), buf(3)
    lt.matmul(y, x, w, 64, 128, 256, 0)
    assert lt.algorithms(64, 128, 256) == 1
    lt.cost[0] = 0.5  # the heuristic's pick is the fastest: it stays
    lt.tune(y, x, [w], 64, 128, 256, 0, ("start", "stop"))
    assert lt.lt.asked == [1, cublaslt.TUNE_CHOICES] and lt.algorithms(64, 128, 256) == 5
    assert lt.chosen() == {(64, 128, 256, False): 0}
    lt.choose_all({(64, 128, 256, False): 3})
    assert lt.chosen() == {(64, 128, 256, False): 3}
    lt.cost[0] = 1.0
    lt.tune(y, x, [w], 32, 128, 256, 0, ("start", "stop"), choices=3)  # a new shape, planned here
    assert lt.lt.asked[-1] == 3 and lt.chosen()[(32, 128, 256, False)] == 2  # 0.8 ms, the fastest of three


def test_the_generation_counts_changes_of_a_planned_shapes_algorithm(lt):
    """A CUDA graph of these GEMMs is captured again once the generation moves: a new shape leaves the
    planned ones as they were, a choice of another algorithm or a plan made again does not."""
    x, y, w = buf(1), buf(2), buf(3)
    lt.matmul(y, x, w, 64, 128, 256, 0)
    lt.matmul(y, x, w, 22, 128, 256, 0)  # a shape of its own (a prompt's last sub-chunk)
    assert lt.generation == 0
    lt.algorithms(64, 128, 256)  # the plan as it is
    assert lt.generation == 0
    lt.tune(y, x, [w], 64, 128, 256, 0, ("start", "stop"))  # planned again with more algorithms
    assert lt.generation > 0
    settled = lt.generation
    lt.choose(64, 128, 256, False, lt.chosen()[(64, 128, 256, False)])  # the same algorithm
    assert lt.generation == settled
    lt.choose(64, 128, 256, False, 3)
    assert lt.generation == settled + 1
