"""CPU checks of the committed PTX (no GPU needed; skipped where the toolchain is absent).

The rebuild needs numba-cuda with NVVM 13.0 (the `cuda` extra); the assembly needs `ptxas`.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _have_numba_cuda() -> bool:
    if importlib.util.find_spec("numba") is None or importlib.util.find_spec("numba.cuda") is None:
        return False
    try:
        from numba.cuda.cudadrv import nvvm

        return nvvm.NVVM().get_version() >= (2, 0)
    except Exception:
        return False


def test_manifest_lists_every_ptx_module():
    manifest = json.loads((ROOT / "ptx" / "manifest.json").read_text())
    files = {entry["file"] for entry in manifest["kernels"].values()}
    assert files == {p.name for p in (ROOT / "ptx").glob("*.ptx")}
    for name, entry in manifest["kernels"].items():
        text = (ROOT / "ptx" / entry["file"]).read_text()
        assert f".entry {entry['symbol']}(" in text, name
        declared = re.findall(rf"\.param\s+\.\w+\s+{entry['symbol']}_param_\d+", text)
        assert len(declared) == len(entry["params"]), name
        assert ".version 9.0" in text  # the H200 driver (CUDA 13.0) rejects newer PTX ISAs


@pytest.mark.skipif(not _have_numba_cuda(), reason="needs numba-cuda + nvidia-nvvm 13.0 (cuda extra)")
def test_ptx_is_reproducible_from_numba_kernels(tmp_path):
    import os

    from numba_kernels import build

    assert build.check(build.build_all(jobs=os.cpu_count() or 1), ROOT / "ptx") == []


def test_ptxas_assembles_every_module():
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    import ptx_check

    ptxas = ptx_check.find_ptxas()
    if ptxas is None:
        pytest.skip("ptxas not installed (PATH or nvidia-cuda-nvcc wheel)")
    reports = ptx_check.assemble(ptxas, "sm_90a")
    assert len(reports) == len(json.loads((ROOT / "ptx" / "manifest.json").read_text())["kernels"])
