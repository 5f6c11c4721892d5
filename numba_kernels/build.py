"""Compile the Numba kernels to PTX modules in ``ptx/`` plus ``ptx/manifest.json``.

    python -m numba_kernels.build          # (re)write ptx/*.ptx and ptx/manifest.json
    python -m numba_kernels.build --check  # rebuild in memory, fail if anything differs
    python -m numba_kernels.build --only moe_route decode_attention_g4_d128_bf16  # just these kernels

Needs the ``cuda`` extra (numba-cuda, nvidia-nvvm 13.0.*, nvidia-cuda-nvrtc 13.0.*) but no GPU.
NVVM must be 13.0: the driver on our H200 host (CUDA 13.0) rejects the PTX ISA 9.5 of newer NVVMs.
Each kernel becomes one module whose entry is renamed ``ninfer_<kernel>`` so the PTX is stable
across machines (Numba's mangled names embed a hash); the manifest gives the file, symbol and
parameter types the runtime needs for typed launches, plus each kernel's launch facts (``meta``,
e.g. the output columns per GEMV block) so the launcher never restates them.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CC = (9, 0)
PTX_DIR = Path(__file__).resolve().parent.parent / "ptx"
MODULES = ("elementwise", "rope", "attention", "decode_attention", "gemm", "sampling", "mma", "random_fill", "deltanet", "gated_attention", "prefill_attention", "moe", "wgmma", "prefill_attention_wgmma")
REQUIRED_PTX_VERSION = "9.0"


def _compile_without_gpu() -> None:
    """Let device functions compile on a machine with no GPU.

    numba-cuda 0.30 asks the current device for its compute capability when it compiles a
    ``@cuda.jit(device=True)`` helper (``compile_ptx`` itself takes ``cc``); we answer with ours.
    """
    import types as pytypes

    from numba.cuda import dispatcher

    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=CC)


def _inline_without_copies() -> None:
    """Spare Numba's inliner its copies of a callee it has just built: a third of the build's time.

    ``InlineWorker.inline_function`` runs the callee's untyped passes afresh at every call site, and
    ``inline_ir`` then deep-copies that new IR twice: once to mutate, once as an "original" that
    both of its callers discard. For kernels of many nested ``inline="always"`` helpers the copies
    are most of the compile (decode attention: 15 s -> 4.5 s). While ``inline_function`` runs, the
    module's ``copy.deepcopy`` hands the blocks back as they are; ``inline_ir`` called by itself
    (typed inlining, over IR that others hold) still copies. The PTX is the same text: ``--check``
    compares every byte. A numba-cuda without these names compiles as it would have.
    """
    import copy
    import threading

    try:
        from numba.cuda.core import inline_closurecall as inliner
    except ImportError:
        return
    worker = getattr(inliner, "InlineWorker", None)
    if worker is None or getattr(inliner, "copy", None) is not copy or not hasattr(worker, "inline_function"):
        return  # a numba-cuda whose inliner is not the one this was written for (or already patched)
    fresh = threading.local()

    class CopyUnlessFresh:
        @staticmethod
        def deepcopy(value, memo=None):
            return value if getattr(fresh, "depth", 0) else copy.deepcopy(value, memo)

    inline_function = worker.inline_function

    def inline_fresh_function(self, *args, **kwargs):
        fresh.depth = getattr(fresh, "depth", 0) + 1
        try:
            return inline_function(self, *args, **kwargs)
        finally:
            fresh.depth -= 1

    inliner.copy = CopyUnlessFresh
    worker.inline_function = inline_fresh_function


def kernel_table():
    """{kernel name: (python function, numba argument types)} over every kernel module."""
    import importlib

    _compile_without_gpu()
    _inline_without_copies()

    table = {}
    for module in MODULES:
        table.update(importlib.import_module(f"numba_kernels.{module}").KERNELS)
    return table


def compile_one(name: str, func, argtypes) -> tuple[str, list[str]]:
    from numba import cuda, types

    from numba_kernels.common import TYPE_NAMES

    ptx, _ = cuda.compile_ptx(func, types.void(*argtypes), cc=CC, fastmath=False, lineinfo=False)
    entries = re.findall(r"\.entry\s+(\S+)\(", ptx)
    if len(entries) != 1:
        raise RuntimeError(f"{name}: expected one .entry in the PTX, found {len(entries)}")
    version = re.search(r"^\.version\s+(\S+)", ptx, re.M).group(1)
    if version != REQUIRED_PTX_VERSION:
        raise RuntimeError(f"{name}: PTX ISA {version} (NVVM too new?); the H200 driver needs "
                           f"{REQUIRED_PTX_VERSION}: install nvidia-nvvm==13.0.*")
    symbol = f"ninfer_{name}"
    ptx = ptx.replace(entries[0], symbol)
    envs = list(dict.fromkeys(re.findall(r"_ZN08NumbaEnv[\w$]*", ptx)))
    for i, env in enumerate(envs):  # one per jitted function (helpers too); unused but declared
        ptx = ptx.replace(env, f"{symbol}_env{i}")
    # Numba numbers shared arrays from a process-wide counter, so the names would depend on what
    # the process compiled before; number them per module so the text is reproducible.
    arrays = list(dict.fromkeys(re.findall(r"_cudapy_smem_\d+", ptx)))
    for i, array in enumerate(arrays):
        ptx = re.sub(rf"\b{array}\b", f"{symbol}_smem{i}", ptx)
    params = [TYPE_NAMES[t] for t in argtypes]
    declared = len(re.findall(rf"\.param\s+\.\w+\s+{symbol}_param_\d+", ptx))
    if declared != len(params):
        raise RuntimeError(f"{name}: PTX declares {declared} params, signature has {len(params)}")
    return ptx, params


def limit_registers(ptx: str, count: int) -> str:
    """The entry with a ``.maxnreg`` directive: ptxas then keeps it to ``count`` registers a thread
    (more blocks resident on an SM, at the price of spills if the code needs more)."""
    head, brace, body = ptx.partition("\n{")
    if not brace or ".entry" not in head:
        raise RuntimeError("no entry body to put .maxnreg before")
    return f"{head}\n.maxnreg {count}\n{{{body}"


def compile_in_processes(names: list[str], jobs: int) -> dict[str, tuple[str, list[str]]]:
    """``compile_one`` of every kernel in ``names``, spread over ``jobs`` fresh interpreters.

    Fresh ones (``python -m numba_kernels.build --compile-to``), not forks: Numba and NVVM state
    forked from a process that has compiled already hung under pytest. Kernels are dealt out in turn
    so the slow ones (decode attention, about 25 s each) spread evenly."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i in range(jobs):
            share = names[i::jobs]
            if share:
                out = Path(tmp) / f"{i}.json"
                command = [sys.executable, "-m", "numba_kernels.build", "--compile-to", str(out), "--only", *share]
                runs.append((share, out, subprocess.Popen(command, cwd=PTX_DIR.parent)))
        compiled = {}
        for share, out, run in runs:
            if run.wait() != 0:
                raise RuntimeError(f"compiling {', '.join(share)} failed (exit {run.returncode})")
            compiled.update({name: (ptx, params) for name, (ptx, params) in json.loads(out.read_text()).items()})
    return compiled


def build_all(only: list[str] | None = None, manifest_dir: Path = PTX_DIR, jobs: int = 1) -> dict[str, str]:
    """{relative file name: text} for every PTX module and the manifest; with ``only``, those kernels'
    modules and the manifest of ``manifest_dir`` with their entries replaced. ``jobs`` > 1 compiles
    in that many processes."""
    files: dict[str, str] = {}
    manifest = {"format": 1, "target": f"sm_{CC[0]}{CC[1]}", "ptx_version": REQUIRED_PTX_VERSION,
                "kernels": {}}
    table = kernel_table()
    if only:
        unknown = sorted(set(only) - set(table))
        if unknown:
            raise SystemExit(f"no such kernels: {', '.join(unknown)}")
        manifest = json.loads((manifest_dir / "manifest.json").read_text())
        # entries of kernels no longer built go, as a whole build would leave them out
        manifest["kernels"] = {name: entry for name, entry in manifest["kernels"].items() if name in table}
        table = {name: table[name] for name in only}
    names = sorted(table)
    if jobs > 1 and len(names) > 1:
        compiled = compile_in_processes(names, min(jobs, len(names)))
    else:
        compiled = {name: compile_one(name, *table[name][:2]) for name in names}
    for name in names:
        func, argtypes, *meta = table[name]
        ptx, params = compiled[name]
        if meta and meta[0].get("arch") == "sm_90a":  # wgmma: the arch-specific target
            ptx = ptx.replace(f".target sm_{CC[0]}{CC[1]}\n", f".target sm_{CC[0]}{CC[1]}a\n", 1)
        if meta and "max_registers" in meta[0]:
            ptx = limit_registers(ptx, meta[0]["max_registers"])
        files[f"{name}.ptx"] = ptx
        manifest["kernels"][name] = {"file": f"{name}.ptx", "symbol": f"ninfer_{name}",
                                     "params": params, "meta": meta[0] if meta else {}}
    files["manifest.json"] = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    return files


def check(files: dict[str, str], directory: Path) -> list[str]:
    problems = []
    for rel, text in files.items():
        path = directory / rel
        if not path.exists():
            problems.append(f"missing: {path}")
        elif path.read_text() != text:
            diff = difflib.unified_diff(path.read_text().splitlines(), text.splitlines(),
                                        str(path), "rebuilt", lineterm="", n=1)
            problems.append("\n".join(list(diff)[:20]))
    stale = {p.name for p in directory.glob("*.ptx")} - set(files)
    problems += [f"stale (no kernel builds it): {directory / s}" for s in sorted(stale)]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="rebuild and diff against ptx/")
    parser.add_argument("--out", type=Path, default=PTX_DIR)
    parser.add_argument("--only", nargs="+", metavar="KERNEL", help="rebuild just these kernels (quick edits)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    parser.add_argument("--compile-to", type=Path, help=argparse.SUPPRESS)  # compile_in_processes' worker
    args = parser.parse_args(argv)
    if args.check and args.only:
        parser.error("--check rebuilds everything; drop --only")
    if args.compile_to:
        table = kernel_table()
        args.compile_to.write_text(json.dumps({name: compile_one(name, *table[name][:2]) for name in args.only}))
        return 0
    files = build_all(args.only, args.out, args.jobs)
    if args.check:
        problems = check(files, args.out)
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(files) - 1} kernels: " + ("OUT OF DATE" if problems else "up to date"))
        return 1 if problems else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (args.out / rel).write_text(text)
    print(f"wrote {len(files) - 1} PTX modules and manifest.json to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
