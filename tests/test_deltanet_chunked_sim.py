"""The chunked delta-rule kernels (deltanet_chunk_prep / deltanet_chunk_scan) on the CPU, in Numba's
CUDA simulator, against reference/deltanet.py's chunked and recurrent forms.

The simulator must be on before numba.cuda is first imported, so each case runs tests/deltanet_sim.py
in a subprocess with ``NUMBA_ENABLE_CUDASIM=1``; this process never imports numba.cuda. Shapes are
tiny (the simulator runs every thread as a Python thread): 70 rows are a full chunk and a partial one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

from fake_cuda import FakeDevice, FakeKernels  # noqa: E402
from ninfer.backends.cuda import hybrid_forward as hf  # noqa: E402
from ninfer.backends.cuda.hybrid_weights import device_layout  # noqa: E402
from ninfer.convert.random_model import HYBRID_PRESETS  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "deltanet_sim.py"


@pytest.mark.parametrize("d, n_k, n_v, rows, seqs", [
    (16, 1, 2, 70, 1),  # two chunks, the second partial, one column split
    (32, 1, 2, 9, 2),  # two sequences of one partial chunk, two column splits
])
def test_chunked_kernels_match_reference(d, n_k, n_v, rows, seqs):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--d", str(d), "--n-k", str(n_k), "--n-v", str(n_v),
                          "--rows", str(rows), "--seqs", str(seqs)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["finite"]
    assert result["prep_q"] < 1e-5
    for key in ("o_chunked", "state_chunked", "o_recurrent", "state_recurrent"):
        assert result[key] < 1e-4, (key, result)


def test_prefill_launches_the_chunked_kernels_when_asked():
    """The wiring, over a fake device: ``chunked_rule`` swaps the scan for chunk_prep + chunk_scan,
    whose launches type-check against the manifest and whose scratch the buffers carve."""
    config, rows = HYBRID_PRESETS["tiny-qwen3.5"], 130
    device = FakeDevice()
    weights = {name: device.alloc(int(np.prod(shape)) * (2 if kind == "bf16" else 4), name)
               for name, (shape, kind) in device_layout(config).items()}
    for chunked in (False, True):
        buffers = hf.HybridBuffers(device, config, page_size=16, num_pages=16, max_batch=4, max_context=256,
                                   max_rows=rows, kv_dtype="f32", state_slots=1, chunked_rule=chunked)
        assert hasattr(buffers, "chunks") == chunked
        fwd = hf.HybridForward(FakeKernels(), config, weights, buffers, page_size=16, kv_dtype="f32")
        fwd.chunked_rule = chunked
        fwd.layers(rows, None)
        launched = [(kernel.name, grid) for kernel, grid, _ in fwd.k.log]
        names = {name for name, _ in launched}
        assert names <= set(fwd.kernel_names())
        prep, scan = fwd.chunked_rule_names
        assert (prep in names, scan in names, fwd.prefill_rule_names[1] in names) == (chunked, chunked, not chunked)
        if chunked:
            nv = config.linear_num_v_heads
            assert (prep, (nv, 3, 1)) in launched  # 130 rows: three chunks
            needed = 3 * nv * hf.deltanet_chunk_floats(config) * 4
            assert buffers.chunks.nbytes >= needed
