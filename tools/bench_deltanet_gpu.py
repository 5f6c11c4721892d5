"""Times the Gated DeltaNet kernels alone at Qwen3.6-27B shapes (48 value / 16 key heads of 128).

    python tools/bench_deltanet_gpu.py

Decode: the fused delta-rule step and the conv at 1, 4 and 8 rows, and what 48 layers of them cost
a step (launches replayed from a CUDA Graph). Prefill: prep (norms, gates), the sequential scan and the gated norm over 512 and 4096
tokens, next to the fused per-token kernel over the same tokens, and the chunked form that would replace
the scan (``HybridForward.chunked_rule``): chunk_prep (every chunk's W, U, P at once) and chunk_scan
(the walk over 64-token chunks). Inputs are constant (timing only).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.backends.cuda import runtime as rt  # noqa: E402

dev = rt.Device(0); s = dev.stream(); K = rt.Kernels(dev)
nk, nv, D = 16, 48, 128
key_dim, value_dim = nk * D, nv * D
conv_dim = 2 * key_dim + value_dim; in_size = conv_dim + value_dim + 2 * nv
T = 4096
CHUNK_FLOATS = 64 + 64 * D * 2 + 64 * 64  # deltanet_chunk_prep's scratch per (head, chunk): cum | W | U | P
def buf(n):
    p = dev.alloc(n * 4, "b"); rt.memset32(p, 0x3c000000, n, s); return p  # 0.0078
mixed, proj = buf(T * conv_dim), buf(T * in_size)
states = buf(9 * nv * D * D); out = buf(T * value_dim); qk = buf(T * 2 * key_dim); gates = buf(T * 2 * nv); o = buf(T * value_dim)
chunks = buf(-(-T // 64) * nv * CHUNK_FLOATS)
small = buf(4096); lanes = dev.alloc(64, "l"); rt.memset32(lanes, 0, 16, s)
st_conv, conv_w = buf(9 * 3 * conv_dim), buf(conv_dim * 4)
e0, e1 = dev.event(True), dev.event(True)
def timed(fn, reps=20):
    """Device microseconds per call: ``reps`` launches captured in one CUDA Graph, so host launch
    cost (tens of microseconds from Python) does not hide short kernels."""
    fn(); rt.synchronize(s)
    graph = rt.Graph.capture(s, lambda: [fn() for _ in range(reps)])
    graph.launch(s); rt.synchronize(s)
    rt.check(rt.cu.cuEventRecord(e0, s), "r")
    graph.launch(s)
    rt.check(rt.cu.cuEventRecord(e1, s), "r"); rt.synchronize(s)
    graph.destroy()
    return rt.check(rt.cu.cuEventElapsedTime(e0, e1), "t") / reps * 1e3
rule = K["deltanet_rule_k128_v128"]; conv = K["deltanet_conv"]
prep, scan, gn = K["deltanet_prep_k128"], K["deltanet_scan_k128_v128"], K["deltanet_gated_norm_v128"]
cprep, cscan = K["deltanet_chunk_prep_k128_v128"], K["deltanet_chunk_scan_k128_v128"]
for rows in (1, 4, 8):
    t_rule = timed(lambda: rule.launch((nv, rows), (256,), (mixed, proj, out, states, nv*D*D, lanes, lanes, 1, nk, nv, in_size, small, small, small, 1e-6), s))
    t_conv = timed(lambda: conv.launch((-(-conv_dim // 128), rows), (128,), (mixed, proj, in_size, st_conv, 3*conv_dim, lanes, lanes, 1, conv_dim, conv_w), s))
    print(f"decode rows={rows}: rule {t_rule:.1f} us, conv {t_conv:.1f} us (x48 layers = {48*(t_rule+t_conv)/1e3:.2f} ms)")
for rows in (512, 4096):
    tp = timed(lambda: prep.launch((rows, nk + 1), (128,), (qk, gates, mixed, proj, nk, nv, in_size, small, small), s), 5)
    ts = timed(lambda: scan.launch((nv, 2, 1), (scan.meta["threads"],), (qk, gates, mixed, o, states, nv*D*D, lanes, rows, nk, nv), s), 3)
    tn = timed(lambda: gn.launch((rows, nv), (128,), (out, o, proj, in_size, nk, nv, small, 1e-6), s), 5)
    tf = timed(lambda: rule.launch((nv, 1), (256,), (mixed, proj, out, states, nv*D*D, lanes, lanes, rows, nk, nv, in_size, small, small, small, 1e-6), s), 3)
    tcp = timed(lambda: cprep.launch((nv, -(-rows // 64), 1), (cprep.meta["threads"],), (chunks, qk, gates, mixed, proj, in_size, small, small, rows, nk, nv), s), 3)
    tcs = timed(lambda: cscan.launch((nv, cscan.meta["splits"], 1), (cscan.meta["threads"],), (chunks, qk, o, states, nv*D*D, lanes, rows, nk, nv), s), 3)
    print(f"prefill {rows}: prep {tp:.0f} us, scan {ts:.0f} us ({ts/rows*1e3:.0f} ns/token), norm {tn:.0f} us; fused per-token rule {tf:.0f} us")
    print(f"prefill {rows}, chunked: chunk_prep {tcp:.0f} us + chunk_scan {tcs:.0f} us = {tcp + tcs:.0f} us "
          f"({(tcp + tcs)/rows*1e3:.0f} ns/token; the scan takes {ts/(tcp + tcs):.2f}x as long)")
