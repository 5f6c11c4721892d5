"""CPU checks of the committed PTX (no GPU needed).

The rebuild needs numba-cuda with NVVM 13.0 and the assembly needs ``ptxas``: both come with the
``ptx`` extra that ``make test`` installs. Elsewhere the two tests skip, except under CI
(``NINFER_CI`` set by ``.ci/run``), where a missing tool fails them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
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


def _missing(tool: str) -> None:
    """Skip for want of ``tool``; in CI, fail instead: the checks are required there."""
    if os.environ.get("NINFER_CI"):
        pytest.fail(f"CI must check the PTX, but {tool} is not installed (the ptx extra)")
    pytest.skip(f"{tool} not installed (the ptx extra)")


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


def test_ptx_is_reproducible_from_numba_kernels():
    if not _have_numba_cuda():
        _missing("numba-cuda with NVVM 13.0")
    from numba_kernels import build

    assert build.main(["--check"]) == 0  # the command docs/development.md gives


def _ptx_check():
    sys.path.insert(0, str(ROOT / "tools"))
    import ptx_check

    return ptx_check


def _tool(name: str) -> str:
    path = _ptx_check().find_tool(name)
    if path is None:
        _missing(name)
    return path


@pytest.fixture(scope="module")
def assembled(tmp_path_factory):
    """(ptxas's report a module, the folder of its machine code), every module assembled once."""
    cubins = tmp_path_factory.mktemp("cubins")
    return _ptx_check().assemble(_tool("ptxas"), "sm_90a", cubins=cubins), cubins


def test_ptxas_assembles_every_module(assembled):
    reports, _ = assembled
    assert len(reports) == len(json.loads((ROOT / "ptx" / "manifest.json").read_text())["kernels"])


def test_loads_before_the_grid_wait_stay_there(assembled):
    """Every kernel that loads before ``griddepcontrol.wait`` still does in ptxas's machine code."""
    early = _ptx_check().early_loads(_tool("nvdisasm"), assembled[1])  # raises if any sank
    assert "gemv_residual_m1.ptx" in early and "decode_attention_g4_d128_bf16.ptx" in early


# nvdisasm's form of a few instructions: a block that exits at once waits too, and must not count.
SASS = """
        /*0070*/                   LDG.E.STRONG.GPU R2, desc[UR10][R2.64] ;
        /*0090*/              @!P0 BRA `(.L_x_0) ;
        /*00a0*/                   ACQBULK ;
        /*00b0*/                   EXIT ;
.L_x_0:
        /*05e0*/              @!P5 LDG.E.128 R8, desc[UR10][R20.64] ;
        /*0600*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR10][R4.64] ;
        /*0820*/                   PREEXIT ;
        /*0830*/                   ACQBULK ;
        /*0840*/               @P0 EXIT ;
        /*0d20*/              @!P4 LDG.E.128 R8, desc[UR10][R28.64] ;
"""
PTX = """
	ld.global.nc.L1::no_allocate.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];
	@%p1 cp.async.cg.shared.global [%r5], [%rd2], 16;
	cp.async.commit_group;
	griddepcontrol.launch_dependents;
	griddepcontrol.wait;
	ld.global.f32 %f1, [%rd3];
"""


def test_early_load_counting():
    check = _ptx_check()
    assert check.ptx_loads_before_wait(PTX) == 2  # the commit is not a load
    assert check.ptx_loads_before_wait(PTX.replace("griddepcontrol.wait", "")) == 0  # no wait: none early
    assert check.sass_loads_before_wait(SASS) == 3  # past the early exit's wait, up to the main path's
    assert check.sass_loads_before_wait(SASS.replace("/*0830*/                   ACQBULK ;", "")) == 4


def test_the_edge_benchmarks_ptx_assembles(tmp_path):
    """tools/bench_kernel_edge.py loads hand-written PTX on the GPU: ptxas must take it here first."""
    import subprocess

    sys.path.insert(0, str(ROOT / "tools"))
    import bench_kernel_edge

    source = tmp_path / "edge.ptx"
    source.write_text(bench_kernel_edge.PTX)
    done = subprocess.run([_tool("ptxas"), "-arch=sm_90a", str(source), "-o", str(tmp_path / "edge.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
