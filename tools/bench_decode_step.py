"""Decode-step GPU time of the CUDA backend under variants of the step, on one runner in one process.

    python3 tools/bench_decode_step.py [--reps 20] [--cases 1x512,8x512,8x8192] [--mma t4w4u1s3]
                                       [--only 'splits of,no attention'] [--prefetch-o 0,0.25]
                                       [--gemm-prefetch 'none,o=8+gate_up=8+down=8'] [--staged 'none,o']

Qwen3-8B shape, random bf16 weights made on the GPU by our fill kernel (as tools/gpu_bench.py). For
each (batch x context) case it captures the decode step as a CUDA Graph under each variant and times
back-to-back replays: ``unfused`` (separate RMSNorm / SiLU kernels, the plain fp32 GEMV), ``fused``
(the default: decode GEMMs with the norms, residual adds and SwiGLU folded in, per forward.DECODE_GEMMS),
every matrix on the fused fp32 GEMV or on one tensor-core shape (``--mma``), per-matrix kernel choices
at the case's row count (``--gemms``; variants must be built into ``ptx/``), at tensor-core rows the
norms chained from GEMM to GEMM or not (``Forward.chain_norm`` flipped), every GEMM, then each
matrix's GEMMs in turn, from the row-major weights instead of the fragment-order copies
(``Forward.fragments``), launches that do not overlap their predecessor (``Forward.overlap`` off: no
programmatic dependent launch), where the step's GEMMs do not overlap (tensor-core rows) its
attention launch not overlapping the q/k/v GEMM either, or every launch
overlapping, the KV prefetch flipped (``Forward.kv_prefetch``), shares of the o projection asked of L2
by attention with and without the KV prefetch (``--prefetch-o``), what the batched GEMMs ask L2 for
of the next GEMM's weights (``--gemm-prefetch``), which ring-shaped GEMMs launch to overlap the kernel
before them (``--staged``), decode attention in the prefill path's three launches instead of
``decode_attention``'s one, other attention split lengths than ``forward.decode_split`` picks, a grid
exactly as deep as the step's splits (the runner's graphs come in a few depths,
``Forward.decode_depths``; blocks past a row's keys exit at once), and the step without attention at
all (wrong tokens, right cost of everything else: the difference is attention's share), then the
default step again; with ``--attention NAME`` every variant runs that decode attention kernel, and the
default one is timed too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.backends.cuda import forward as fw  # noqa: E402
from ninfer.backends.cuda import runtime as rt  # noqa: E402
from ninfer.backends.runner import DecodeBatch, SamplingRow  # noqa: E402
from ninfer.backends.cuda.random_weights import random_device_weights  # noqa: E402
from tools.gpu_bench import PAGE, QWEN3_8B, copy_bandwidth, replay_ms, weight_bytes_per_step  # noqa: E402


def step_ms(runner, batch: int, reps: int) -> float:
    """Milliseconds of the step captured at the attention depth the runner would pick for the inputs
    in place (``Forward.decode_depth``), replayed back to back."""
    dev, stream = runner.device, runner.stream
    inp = runner.buffers.inputs
    depth = runner.forward.decode_depth(int(inp.split[0]), int(inp.positions[:batch].max()) + 1)
    graph = rt.Graph.capture(stream, lambda: runner.forward.decode(batch, stream, depth))
    ms = replay_ms(graph, dev, stream, reps)
    graph.destroy()
    return ms


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cases", default="1x512,8x512,8x8192")
    parser.add_argument("--only", default="", help="comma-separated parts of the variant labels to time "
                        "(the default step always runs); empty: every variant")
    parser.add_argument("--mma", default="t4w4u1s3", help="tensor-core shape of the 'mma only' variant")
    parser.add_argument("--gemms", default="", help="comma-separated decode GEMM choices to time, each as "
                        "matrix=kernel joined by '+' (kernel: fp32 or a tensor-core shape such as t4w4u1s3; a "
                        "matrix in Forward.staged keeps its staged shape, see --staged)")
    parser.add_argument("--attention", default="", help="the decode attention kernel of every variant (a "
                        "variant built into ptx/ under another name); the step with the default one is timed too")
    parser.add_argument("--prefetch-o", default="", help="comma-separated shares of each o projection that "
                        "decode_attention asks L2 for (Forward.attention_prefetch), each with and without the "
                        "KV prefetch")
    parser.add_argument("--gemm-prefetch", default="", help="comma-separated Forward.gemm_prefetch settings to "
                        "time, each as matrix=MiB joined by '+' (the next GEMM's weights a decode GEMM asks L2 for), "
                        "or none")
    parser.add_argument("--staged", default="", help="comma-separated sets of decode GEMMs launched to overlap "
                        "the kernel before them (Forward.staged), each as matrix[=ring shape] joined by '+', or none")
    parser.add_argument("--splits", default="32,64,128,256,512,1024,2048",
                        help="other attention split lengths to time (keys, multiples of 32)")
    args = parser.parse_args(argv)
    from ninfer.backends.cuda import CudaRunner

    device = rt.Device(0)
    stream = device.stream()
    copy_bw = copy_bandwidth(device, stream)
    config = QWEN3_8B
    ptrs, _ = random_device_weights(device, stream, config)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    max_batch = max(b for b, _ in cases)
    max_context = max(c for _, c in cases) + 64
    max_pages = -(-max_context // PAGE)
    runner = CudaRunner.from_device_weights(config, ptrs, device=device, page_size=PAGE,
                                            num_pages=max_batch * max_pages, max_batch=max_batch,
                                            max_context=max_context, cuda_graph=False)
    for name in runner.kernels.entries:  # module loads are not allowed during capture
        if name.startswith(("mma_gemv_", "gemv_", "rmsnorm", "add_rmsnorm", "silu_mul", "attention_", "rope_kv",
                            "decode_attention_")):
            runner.kernels[name]
    attention = runner.forward.decode_attention_name
    if args.attention:
        attention, runner.forward.decode_attention_name = runner.forward.decode_attention_name, args.attention
    default_gemms = {matrix: dict(table) for matrix, table in fw.DECODE_GEMMS.items()}
    weights_bytes = weight_bytes_per_step(config)
    print(f"copy {copy_bw / 1e9:.0f} GB/s; weights per step {weights_bytes / 1e9:.2f} GB", flush=True)
    for batch, context in cases:
        tables = np.stack([np.arange(max_pages) + lane * max_pages for lane in range(batch)]).astype(np.int32)
        runner.decode(DecodeBatch(lanes=np.arange(batch, dtype=np.int32), tokens=np.full(batch, 7, np.int32),
                                  positions=np.full(batch, context, np.int32), page_tables=tables,
                                  sampling=[SamplingRow()] * batch))  # leaves the step inputs in place
        roofline_ms = (weights_bytes + batch * context * config.kv_bytes_per_token) / copy_bw * 1e3
        results = {}

        def measure(label: str) -> None:
            if not args.only or label.startswith("fused (") or any(part in label for part in args.only.split(",")):
                results[label] = step_ms(runner, batch, args.reps)
        runner.forward.fused_decode = False
        measure("unfused")
        runner.forward.fused_decode = True
        measure(f"fused (splits of {int(runner.buffers.inputs.split[0])})")
        def measure_gemms(label: str, choices: dict[str, dict[int, str]]) -> None:
            """The step with these decode GEMM choices (matrix -> rows -> kernel), then the defaults again."""
            for matrix, table in choices.items():
                fw.DECODE_GEMMS[matrix].update(table)
            measure(f"fused, {label}")
            for matrix, table in fw.DECODE_GEMMS.items():
                table.update(default_gemms[matrix])
        for label, choice in (("fp32 GEMV only", "fp32"), (f"mma {args.mma} only", args.mma)):
            measure_gemms(label, {matrix: {r: choice for r in table} for matrix, table in fw.DECODE_GEMMS.items()})
        for spec in filter(None, args.gemms.split(",")):  # per-matrix kernels: qkv=fp32+o=t1w16u4s3+...
            measure_gemms(spec, {matrix: {batch: choice} for matrix, choice in (p.split("=") for p in spec.split("+"))})
        staged = runner.forward.staged
        for spec in filter(None, args.staged.split(",")):  # o+down=t1w8u1s3r3: staged GEMMs, some in other shapes
            items = [item.split("=") + [fw.STAGED_SHAPE] for item in spec.split("+") if item != "none"]
            runner.forward.staged = {item[0]: item[1] for item in items}
            measure(f"fused, staged {spec}")
        runner.forward.staged = staged
        if attention != runner.forward.decode_attention_name:
            chosen_attention, runner.forward.decode_attention_name = runner.forward.decode_attention_name, attention
            measure(f"fused, {attention}")
            runner.forward.decode_attention_name = chosen_attention
        if batch == 1:  # Forward.preload_o flipped
            runner.forward.preload_o = not runner.forward.preload_o
            measure(f"fused, preload_o {runner.forward.preload_o}")
            runner.forward.preload_o = not runner.forward.preload_o
        chosen_gemm_prefetch = runner.forward.gemm_prefetch
        for spec in filter(None, args.gemm_prefetch.split(",")):  # qkv=4+o=8+...: MiB each GEMM asks L2 for; none
            runner.forward.gemm_prefetch = {m: {batch: int(float(mib) * fw.MIB)}
                                            for m, mib in (p.split("=") for p in spec.split("+") if p != "none")}
            measure(f"fused, gemm prefetch {spec}")
        runner.forward.gemm_prefetch = chosen_gemm_prefetch
        inp = runner.buffers.inputs
        chosen_share, bits = runner.forward.attention_prefetch, int(inp.split[1])
        for share in filter(None, args.prefetch_o.split(",")):  # with the step's keys asked of L2 or not
            runner.forward.attention_prefetch = float(share)
            for keys in (0, fw.PREFETCH_KEYS):
                inp.split[1] = keys | fw.PREFETCH_O
                inp.upload(runner.stream)
                measure(f"fused, o prefetched {share}{', keys prefetched' if keys else ''}")
        runner.forward.attention_prefetch = chosen_share
        inp.split[1] = bits
        inp.upload(runner.stream)
        if fw.chains_norms(batch):  # Forward.chain_norm flipped (a chained step overlaps every launch)
            chained = runner.forward.chain_norm
            runner.forward.chain_norm = not chained
            measure(f"fused, norms {'not ' if chained else ''}chained")
            runner.forward.chain_norm = chained
        fragments = runner.forward.fragment_matrices
        if any(runner.forward.reads_fragments(matrix, batch) for matrix in fragments):
            runner.forward.fragment_matrices = set()  # every GEMM from the row-major weights
            measure("fused, row-major weights")
            for matrix in sorted(fragments):  # each matrix's copy left out in turn
                runner.forward.fragment_matrices = fragments - {matrix}
                measure(f"fused, {matrix} from its row-major weights")
            runner.forward.fragment_matrices = fragments
        if not runner.forward.overlaps(batch):
            runner.forward.attention_overlap = False
            measure("fused, attention launch not overlapped")
            runner.forward.attention_overlap = True
            runner.forward.overlaps = lambda rows: True
            measure("fused, every launch overlapped")
            del runner.forward.overlaps
        runner.forward.overlap = False
        measure("fused, launches not overlapped")
        runner.forward.overlap = True
        runner.forward.fused_attention = False
        measure("fused, attention in 3 launches")
        runner.forward.fused_attention = True
        inp = runner.buffers.inputs
        chosen = int(inp.split[0])
        depth = runner.forward.n_splits(batch, decode=True)
        for split in (int(v) for v in args.splits.split(",")):  # other split lengths than decode_split's
            if split != chosen and split < context + fw.MIN_SPLIT and split * depth > context:  # no key dropped
                inp.split[0] = split
                inp.upload(runner.stream)
                measure(f"fused, splits of {split}")
        inp.split[0] = chosen
        inp.upload(runner.stream)
        needed = -(-(context + 1) // chosen)  # this step's splits: a grid just deep enough (no empty blocks)
        if needed < depth:
            runner.forward.n_splits = lambda rows, decode=False, needed=needed: needed
            measure(f"fused, grid of {needed} splits")
            del runner.forward.n_splits
        prefetch = int(inp.split[1])
        inp.split[1] = prefetch ^ fw.PREFETCH_KEYS
        inp.upload(runner.stream)
        measure(f"fused, {'no ' if prefetch & fw.PREFETCH_KEYS else ''}KV prefetch")
        inp.split[1] = prefetch
        inp.upload(runner.stream)
        runner.forward.attend = lambda *a, **k: None
        measure("fused, no attention")
        runner.forward.overlap = False
        measure("fused, no attention, not overlapped")
        runner.forward.overlap = True
        del runner.forward.attend  # the class's method again
        # The defaults once more, last: on the H100 their first timing in a case read 10-20 us slower than
        # the same step timed later in the run (docs/benchmarks.md, forty-first session).
        measure(f"fused (splits of {int(inp.split[0])}), again")
        print(f"b={batch} ctx={context} (roofline {roofline_ms:.3f} ms): "
              + ", ".join(f"{k} {v:.3f} ms ({100 * roofline_ms / v:.1f}%)" for k, v in results.items()), flush=True)
    runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
