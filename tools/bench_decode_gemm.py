"""Decode GEMM kernels alone on the Qwen3-8B matrices: GB/s of weights streamed per kernel and row count.

    python3 tools/bench_decode_gemm.py [--reps 20] [--rows 1,2,4,8] [--only SUBSTRING]

For every matrix of a decode step (qkv, o, gate_up, down, LM head) and every row count it times the
fp32 CUDA-core GEMV plain (``gemv_m{M}_c4``) and with the matrix's fusion (``gemv_<fusion>_m{M}``),
and each tensor-core shape of ``mma_gemv`` with the fusion (numba_kernels/gemm.py) or its chained-norm
form (``normin`` for a normed matrix, ``normout`` for a residual one): every such kernel
of the manifest, so a variant whose build is copied into ``ptx/`` for the run is timed too,
inside one CUDA Graph of ``--reps`` launches. Launches cycle through enough copies of the weights to
exceed the 50 MB L2, so every launch streams its matrix from HBM as in a real step. Prints one line
per (matrix, rows) with the best kernel first; forward.py's choice table comes from these figures.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.backends.cuda import runtime as rt  # noqa: E402

MATRICES = {  # name: (output columns, k, epilogue, normed) as a Qwen3-8B decode step uses them
    "qkv": (6144, 4096, "store", True),
    "o": (4096, 4096, "residual", False),
    "gate_up": (12288, 4096, "swiglu", True),
    "down": (4096, 12288, "residual", False),
    "lm_head": (151936, 4096, "store", True),
}
L2_BYTES = 256 << 20  # rotate through at least this many weight bytes
CHAIN_PARTS = 256  # partial sums a chained-norm GEMM reads: the o / down GEMMs' blocks (4096 columns / 16)


def time_graph(device, stream, launches, reps: int) -> float:
    """Seconds per launch of ``launches`` (a list of thunks) replayed in one graph."""
    graph = rt.Graph.capture(stream, lambda: [launches[i % len(launches)]() for i in range(reps)])
    start, stop = device.event(timing=True), device.event(timing=True)
    graph.launch(stream)
    rt.check(rt.cu.cuEventRecord(start, stream), "cuEventRecord")
    graph.launch(stream)
    rt.check(rt.cu.cuEventRecord(stop, stream), "cuEventRecord")
    rt.synchronize(stream)
    graph.destroy()
    return rt.check(rt.cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / 1e3 / reps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--only", default="", help="time only kernels whose name contains this")
    args = parser.parse_args(argv)
    device = rt.Device(0)
    stream = device.stream()
    kernels = rt.Kernels(device)
    x = device.alloc(8 * 12288 * 2 * 4, "x")
    y = device.alloc(8 * 151936 * 4, "y")
    norm = device.alloc(12288 * 4, "norm")
    xn = device.alloc(8 * 151936 * 4, "xn")
    part = device.alloc(8 * (151936 // 16 + 1) * 4, "part")
    for buf in (x, y, norm, xn, part):
        rt.memset32(buf, 0x3F800000, buf.nbytes // 4, stream)  # 1.0f
    for name, (cols, k, epilogue, normed) in MATRICES.items():
        rows_w = 2 * cols if epilogue == "swiglu" else cols
        nbytes = rows_w * k * 2
        copies = max(1, -(-L2_BYTES // nbytes))
        weights = [device.alloc(nbytes, f"w{i}") for i in range(copies)]
        for wt in weights:
            # bf16 1.0 pairs; the fragment-order builds (meta "frag") read these bytes in their order
            rt.memset32(wt, 0x3F803F80, nbytes // 4, stream)
        for rows in (int(r) for r in args.rows.split(",")):
            results = {}
            gemv = kernels[f"gemv_m{rows}_c4"]
            n_plain = rows_w  # the fp32 GEMV has no fusions: it writes every weight row's output
            candidates = {gemv.name: [lambda wt=wt: gemv.launch((-(-n_plain // 4),), (128,),
                                                                  (y, x, wt, rows, n_plain, k, n_plain), stream)
                                      for wt in weights]}
            fusion = f"{'normed_' if normed else ''}{epilogue}"
            # The chained norm's kernels (numba_kernels/gemm.py ``chain``) stand in for the normed ones
            # (their input pre-scaled, the 1 / rms from a producer's CHAIN_PARTS partial sums) and
            # for the plain residual ones (writing the next norm's input and partials as well).
            chained = rf"mma_gemv_normin_{epilogue}_t\w+" if normed else rf"mma_gemv_{epilogue}_normout_t\w+"
            for kname in kernels.entries:  # every build of the fused kernels in the manifest (variants too)
                if re.fullmatch(rf"mma_gemv_{fusion}_t\w+|gemv_{fusion}_m{rows}(_\w+)?|{chained}", kname):
                    kern = kernels[kname]
                    grid = (-(-cols // kern.meta["cols"]),)
                    extra = {"in": (part, CHAIN_PARTS), "out": (xn, part)}.get(kern.meta.get("chain"), ())
                    if kern.meta.get("next"):  # a NEXT build asks L2 for nothing here: the kernel alone
                        extra += (x, 0)
                    candidates[kname] = [lambda wt=wt, kern=kern, grid=grid, extra=extra: kern.launch(
                        grid, (kern.meta["threads"],), (y, x, wt, norm, rows, cols, k, cols, 1e-6, *extra), stream)
                        for wt in weights]
            for kname, launches in candidates.items():
                if args.only in kname:
                    results[kname] = nbytes / time_graph(device, stream, launches, args.reps) / 1e9
            ranked = sorted(results.items(), key=lambda kv: -kv[1])
            print(f"{name} [{rows_w} x {k}] rows={rows}: " + ", ".join(f"{n} {v:.0f}" for n, v in ranked), flush=True)
        for wt in weights:
            device.free(wt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
