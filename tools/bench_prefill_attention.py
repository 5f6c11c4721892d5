"""The tensor-core prefill attention kernel alone, against torch's flash SDPA on the same card.

    python tools/bench_prefill_attention.py [--tokens 8192] [--chunks 512,2048,8192] [--head-dim 128]

Qwen3-8B's attention shape (32 q heads, 8 KV heads). For each chunk size C the prompt is walked in
chunks of C rows, each over the prefix before it (what the runner's sub-chunks do), and the total
time of the launches is reported with the achieved TFLOP/s (causal: 4 * heads * head_dim * N(N+1)/2
multiply-adds x2) next to torch's ``scaled_dot_product_attention(is_causal=True)`` on bf16 q/k/v of
the whole prompt, measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.artifact.bf16 import from_float32, to_float32  # noqa: E402
from ninfer.backends.cuda import runtime as rt  # noqa: E402
from ninfer.backends.cuda.forward import prefill_attention_grid  # noqa: E402

PAGE = 16


def causal_flops(tokens: int, heads: int, head_dim: int) -> float:
    return 4.0 * heads * head_dim * tokens * (tokens + 1) / 2


def time_ms(device, stream, body, reps: int) -> float:
    start, stop = device.event(timing=True), device.event(timing=True)
    body()  # warm-up
    rt.check(rt.cu.cuEventRecord(start, stream), "cuEventRecord")
    for _ in range(reps):
        body()
    rt.check(rt.cu.cuEventRecord(stop, stream), "cuEventRecord")
    rt.synchronize(stream)
    return rt.check(rt.cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / reps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunks", default="512,2048,8192")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--peer", choices=("torch", "none"), default="torch")
    parser.add_argument("--variants", default="", help="comma-separated kernel name suffixes to time too")
    parser.add_argument("--full-grid", action="store_true",
                        help="time the persistent kernels launched as a block per (head, row tile) too")
    args = parser.parse_args(argv)
    N, H, KV, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    device = rt.Device(0)
    stream = device.stream()
    kernels = rt.Kernels(device)
    rng = np.random.default_rng(0)
    pages = -(-N // PAGE)
    page_elems = 2 * KV * PAGE * D
    pool = device.alloc(pages * page_elems * 2, "pool")
    kv_bits = (rng.standard_normal(pages * page_elems, dtype=np.float32).view(np.uint32) >> 16)
    rt.copy_h2d(pool, kv_bits.astype(np.uint16), stream)  # bf16 truncations of normals
    width = (H + 2 * KV) * D
    q_values = rng.standard_normal(N * width, dtype=np.float32)
    qkv = device.alloc(N * width * 4, "qkv")
    rt.copy_h2d(qkv, q_values, stream)
    # What the ``_bf16`` kernels read (the cuBLASLt prefill's): the same values rounded to nearest even,
    # as the fp32 kernels round q for their MMAs.
    qkv_bf16 = device.alloc(N * width * 2, "qkv_bf16")
    rt.copy_h2d(qkv_bf16, from_float32(q_values), stream)
    out = device.alloc(N * H * D * 4, "out")
    table = device.alloc(pages * 4, "table")
    rt.copy_h2d(table, rng.permutation(pages).astype(np.int32), stream)
    positions = device.alloc(N * 4, "positions")
    rt.copy_h2d(positions, np.arange(N, dtype=np.int32), stream)
    row_table = device.alloc(N * 4, "row_table")
    rt.memset32(row_table, 0, N, stream)
    rt.synchronize(stream)
    scale_log2 = float(D ** -0.5 * np.log2(np.e))
    flops = causal_flops(N, H, D)
    print(f"prefill attention {N} tokens, {H} q heads / {KV} kv heads, head_dim {D}: "
          f"{flops / 1e12:.2f} TFLOP (causal)", flush=True)
    names = [f"prefill_attention_d{D}"] + [f"prefill_attention_d{D}_{v}" for v in args.variants.split(",") if v]
    runs = [(n, False) for n in names]
    if args.full_grid:
        runs += [(n, True) for n in names if kernels[n].meta.get("persistent")]
    firsts = {}
    for (name, full), chunk in ((r, int(c)) for r in runs for c in args.chunks.split(",")):
        kernel = kernels[name]
        meta = {**kernel.meta, "persistent": 0} if full else kernel.meta
        # The bf16 kernels read q in bf16 and write bf16.
        item, q_in = (2, qkv_bf16) if kernel.meta.get("out") == "bf16" else (4, qkv)

        def body(chunk=chunk, kernel=kernel, meta=meta, item=item, q_in=q_in):
            for first in range(0, N, chunk):
                n = min(chunk, N - first)
                kernel.launch(prefill_attention_grid(meta, H, n, device.sm_count), (kernel.meta["threads"],),
                              (q_in.at(first * width * item), pool, page_elems, table, pages,
                               row_table.at(first * 4), positions.at(first * 4), out.at(first * H * D * item), n,
                               H, KV, PAGE.bit_length() - 1, scale_log2), stream)

        ms = time_ms(device, stream, body, args.reps)
        got = np.empty(N * H * D, np.float32 if item == 4 else np.uint16)
        rt.copy_d2h(got, out, stream)
        rt.synchronize(stream)
        if item == 2:
            got = to_float32(got)
        first = firsts.setdefault(chunk, got)  # every kernel's output against the first kernel's
        diff = float(np.abs(got - first).max())
        label = f"{name} (full grid)" if full else name
        print(f"  {label}, chunks of {chunk}: {ms:.2f} ms = {flops / ms / 1e9:.0f} TFLOP/s"
              f" (max |diff| vs {names[0]}: {diff:.2e})", flush=True)
    if args.peer == "torch":
        import torch
        import torch.nn.functional as F

        q = torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV, N, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, KV, N, D, device="cuda", dtype=torch.bfloat16)
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        stop.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(stop) / args.reps
        print(f"  torch SDPA (bf16, causal, whole prompt): {ms:.2f} ms = {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    device.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
