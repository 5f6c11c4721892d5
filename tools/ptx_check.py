"""Check the committed PTX: rebuild-and-diff (numba_kernels.build --check) and ptxas on every module.

    python tools/ptx_check.py [--ptxas PATH] [--arch sm_90a] [--skip-rebuild]

ptxas is looked up as given, then on PATH, then in the nvidia-cuda-nvcc wheel. Prints each module's
register / shared-memory / stack use (spills show up as a non-zero stack frame) and exits non-zero
when a module fails to assemble or the PTX is out of date.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PTX_DIR = ROOT / "ptx"


def find_ptxas(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit
    found = shutil.which("ptxas")
    if found:
        return found
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return None
    for base in nvidia.__path__:
        for candidate in Path(base).glob("*/bin/ptxas"):
            return str(candidate)
    return None


def assemble(ptxas: str, arch: str, directory: Path = PTX_DIR) -> dict[str, str]:
    """{module file: ptxas resource report}; raises RuntimeError listing the modules that failed."""
    manifest = json.loads((directory / "manifest.json").read_text())
    reports, failures = {}, []
    for name, entry in sorted(manifest["kernels"].items()):
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", str(directory / entry["file"]),
                               "-o", "/dev/null"], capture_output=True, text=True)
        if proc.returncode != 0:
            failures.append(f"{entry['file']}: {proc.stderr.strip()}")
        reports[entry["file"]] = " ".join(line.split(":", 1)[-1].strip()
                                          for line in proc.stderr.splitlines()
                                          if "Used" in line or "stack frame" in line)
    if failures:
        raise RuntimeError("ptxas rejected:\n" + "\n".join(failures))
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptxas")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--skip-rebuild", action="store_true")
    args = parser.parse_args(argv)
    status = 0
    if not args.skip_rebuild:
        sys.path.insert(0, str(ROOT))
        from numba_kernels import build

        status = build.main(["--check"])
    ptxas = find_ptxas(args.ptxas)
    if ptxas is None:
        print("ptxas not found (PATH or nvidia-cuda-nvcc wheel)", file=sys.stderr)
        return 2
    try:
        for module, report in assemble(ptxas, args.arch).items():
            print(f"{module:28s} {report}")
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
