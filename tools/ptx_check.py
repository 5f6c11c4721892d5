"""Check the committed PTX: rebuild-and-diff (numba_kernels.build --check), ptxas on every module, and
that the loads a kernel issues before its grid wait are still there in the machine code.

    python tools/ptx_check.py [--ptxas PATH] [--nvdisasm PATH] [--arch sm_90a] [--skip-rebuild]

ptxas is looked up as given, then on PATH, then in the nvidia-cuda-nvcc wheel; nvdisasm the same way
(the nvidia-cuda-nvdisasm wheel). Prints each module's register / shared-memory / stack use (spills
show up as a non-zero stack frame) and exits non-zero when a module fails to assemble, the PTX is out
of date, or ptxas moved a kernel's early loads below its grid wait (``early_loads``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PTX_DIR = ROOT / "ptx"


def find_tool(tool: str, explicit: str | None = None) -> str | None:
    """``tool`` (ptxas, nvdisasm) as given, else on PATH, else from an NVIDIA wheel's ``bin``."""
    if explicit:
        return explicit
    found = shutil.which(tool)
    if found:
        return found
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return None
    for base in nvidia.__path__:
        for candidate in Path(base).glob(f"*/bin/{tool}"):
            return str(candidate)
    return None


def module_files(directory: Path) -> list[str]:
    """The PTX module files ``directory``'s manifest lists, sorted."""
    manifest = json.loads((directory / "manifest.json").read_text())
    return sorted({entry["file"] for entry in manifest["kernels"].values()})


def assemble(ptxas: str, arch: str, directory: Path = PTX_DIR, cubins: Path | None = None) -> dict[str, str]:
    """{module file: ptxas resource report}; raises RuntimeError listing the modules that failed. With
    ``cubins`` (a folder) the machine code is kept there, ``<module file>.cubin``, for ``early_loads``."""
    files = module_files(directory)

    def assembled(file: str) -> tuple[str, subprocess.CompletedProcess]:
        out = str(cubins / (file + ".cubin")) if cubins else "/dev/null"
        return file, subprocess.run([ptxas, f"-arch={arch}", "-v", str(directory / file), "-o", out],
                                    capture_output=True, text=True)

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # ptxas: ~0.1-2 s a module
        runs = dict(pool.map(assembled, files))
    failures = [f"{file}: {run.stderr.strip()}" for file, run in runs.items() if run.returncode != 0]
    reports = {file: " ".join(line.split(":", 1)[-1].strip() for line in run.stderr.splitlines()
                              if "Used" in line or "stack frame" in line)
               for file, run in runs.items()}
    if failures:
        raise RuntimeError("ptxas rejected:\n" + "\n".join(failures))
    return reports


# A kernel that loads weights (or stages keys, or asks L2 for bytes) before ``griddepcontrol.wait`` does
# so to overlap the kernel before it. ptxas may sink such loads below the wait (SASS ``ACQBULK``): it
# did so to every fp32 GEMV whose loads came after ``launch_dependents``, a 2% slower batch-1 step
# until the SASS showed it (docs/benchmarks.md, twenty-third session).
PTX_LOAD = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld\.global|cp\.async\.c[ag]\.shared\.global|cp\.async\.bulk\.prefetch"
                      r"|cp\.async\.bulk\.shared)")
SASS_LOAD = re.compile(r"\b(?:LDG|LDGSTS|UBLKPF|UBLKCP)\b")
SASS_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/")
SASS_EXIT = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+EXIT\s*;")  # unpredicated: this path ends here


def ptx_loads_before_wait(ptx: str) -> int:
    """Global loads, async copies and L2 prefetches written above the module's first grid wait."""
    count = 0
    for line in ptx.splitlines():
        if "griddepcontrol.wait" in line:
            return count
        count += bool(PTX_LOAD.match(line))
    return 0  # no wait: nothing is early


def sass_loads_before_wait(sass: str) -> int:
    """The same in ``nvdisasm`` output, above the first ``ACQBULK`` that is not an early exit's
    (a block that returns at once still waits first: ``ACQBULK; EXIT``, where ``ACQBULK; @P0 EXIT``
    is the main path's wait, some of whose blocks then return)."""
    code = [line for line in sass.splitlines() if SASS_INSTRUCTION.match(line)]
    count = 0
    for i, line in enumerate(code):
        if "ACQBULK" in line and not (i + 1 < len(code) and SASS_EXIT.match(code[i + 1])):
            return count
        count += bool(SASS_LOAD.search(line))
    return count


def early_loads(nvdisasm: str, cubins: Path, directory: Path = PTX_DIR) -> dict[str, tuple[int, int]]:
    """{module file: (loads above the grid wait in the PTX, in the SASS)} for every module with early
    loads, read from the machine code ``assemble`` kept in ``cubins``; raises RuntimeError naming the
    modules whose SASS has fewer (ptxas sank them)."""
    files = module_files(directory)
    written = {f: ptx_loads_before_wait((directory / f).read_text()) for f in files}
    early = [f for f in files if written[f]]

    def disassembled(file: str) -> tuple[str, int]:
        sass = subprocess.run([nvdisasm, str(cubins / (file + ".cubin"))], check=True, capture_output=True,
                              text=True).stdout
        return file, sass_loads_before_wait(sass)

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # nvdisasm: ~0.3 s a module
        issued = dict(pool.map(disassembled, early))
    sunk = [f"{f}: {written[f]} in the PTX, {issued[f]} in the SASS" for f in early if issued[f] < written[f]]
    if sunk:
        raise RuntimeError("ptxas moved loads below the grid wait (SASS ACQBULK):\n" + "\n".join(sunk))
    return {f: (written[f], issued[f]) for f in early}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptxas")
    parser.add_argument("--nvdisasm")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--skip-rebuild", action="store_true")
    args = parser.parse_args(argv)
    status = 0
    if not args.skip_rebuild:
        sys.path.insert(0, str(ROOT))
        from numba_kernels import build

        status = build.main(["--check"])
    ptxas = find_tool("ptxas", args.ptxas)
    if ptxas is None:
        print("ptxas not found (PATH or nvidia-cuda-nvcc wheel)", file=sys.stderr)
        return 2
    nvdisasm = find_tool("nvdisasm", args.nvdisasm)
    if nvdisasm is None:
        print("nvdisasm not found (PATH or nvidia-cuda-nvdisasm wheel)", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory() as cubins:
            for module, report in assemble(ptxas, args.arch, cubins=Path(cubins)).items():
                print(f"{module:28s} {report}")
            for module, (written, issued) in early_loads(nvdisasm, Path(cubins)).items():
                print(f"{module:28s} loads above the grid wait: {written} in the PTX, {issued} in the SASS")
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
