"""What one dependent kernel boundary costs inside a CUDA graph, three ways.

    python3 tools/bench_kernel_edge.py [--kernels 100] [--blocks 16,132,528,16/1152/256/512] [--reps 200]

A chain of ``--kernels`` launches is captured into one graph and replayed; each launch's blocks read
what the launch before wrote (thread 0 of block b: ``dst[b] = src[0] + 1``), so every boundary is a
real dependency, and the chain's last array must read ``kernels`` afterwards. ``--blocks`` gives the
launches' block counts: a comma list is timed one count at a time, a ``/`` list cycles along one
chain (``16/1152/256/512``: the 35B-A3B's router, routing gate/up, down and in_proj grids). Per launch:

- ``plain``: ordinary launches; a kernel starts when the one before has finished.
- ``pdl``: programmatic dependent launch, as the decode graphs use it (``Kernel._launch_overlapped``):
  each kernel triggers its dependents first, then waits in ``griddepcontrol.wait`` for the grid before
  it to finish and flush.
- ``flag``: programmatic launch without the grid wait: thread 0 of each block polls a counter that
  every block of the kernel before adds 1 to (release) after its writes, until it reads that kernel's
  block count (acquire), then the block passes a barrier. ``--sleep NS`` backs the polling off.

This is what a persistent-style chain would save over the grid wait at each of a decode step's
dependent launches: on an H100 the flags lost at every grid size but the smallest (docs/benchmarks.md,
thirty-seventh session). The kernels are hand-written PTX, loaded like any module.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer.commands.runner_timing import replay_ms  # noqa: E402

PTX_TEMPLATE = r"""
.version 8.0
.target sm_90
.address_size 64

.visible .entry edge_wait(.param .u64 p_src, .param .u64 p_dst)
{
    .reg .pred %p;
    .reg .b32 %r<4>;
    .reg .b64 %rd<6>;
    griddepcontrol.launch_dependents;
    griddepcontrol.wait;
    mov.u32 %r0, %tid.x;
    setp.ne.u32 %p, %r0, 0;
    @%p bra DONE;
{work}DONE:
    ret;
}

.visible .entry edge_flag(.param .u64 p_src, .param .u64 p_dst, .param .u64 p_wait, .param .u64 p_signal,
                          .param .u32 p_need, .param .u32 p_sleep)
{
    .reg .pred %p;
    .reg .b32 %r<8>;
    .reg .b64 %rd<8>;
    griddepcontrol.launch_dependents;
    mov.u32 %r0, %tid.x;
    setp.ne.u32 %p, %r0, 0;
    @%p bra SYNC;
    ld.param.u64 %rd5, [p_wait];
    cvta.to.global.u64 %rd5, %rd5;
    ld.param.u32 %r4, [p_need];
    ld.param.u32 %r5, [p_sleep];
POLL:
    ld.acquire.gpu.global.u32 %r3, [%rd5];
    setp.ge.u32 %p, %r3, %r4;
    @%p bra SYNC;
    nanosleep.u32 %r5;
    bra POLL;
SYNC:
    bar.sync 0;
    setp.ne.u32 %p, %r0, 0;
    @%p bra DONE;
{work}    ld.param.u64 %rd6, [p_signal];
    cvta.to.global.u64 %rd6, %rd6;
    red.release.gpu.global.add.u32 [%rd6], 1;
DONE:
    ret;
}

.visible .entry edge_reset(.param .u64 p_counters, .param .u32 p_n, .param .u32 p_first,
                           .param .u64 p_data, .param .u32 p_words)
{
    .reg .pred %p;
    .reg .b32 %r<6>;
    .reg .b64 %rd<6>;
    mov.u32 %r0, %tid.x;
    ld.param.u32 %r1, [p_n];
    setp.ge.u32 %p, %r0, %r1;
    @%p bra DATA;
    ld.param.u64 %rd0, [p_counters];
    cvta.to.global.u64 %rd0, %rd0;
    mul.wide.u32 %rd1, %r0, 4;
    add.u64 %rd2, %rd0, %rd1;
    setp.eq.u32 %p, %r0, 0;
    ld.param.u32 %r2, [p_first];
    selp.u32 %r3, %r2, 0, %p;
    st.global.u32 [%rd2], %r3;
DATA:
    ld.param.u32 %r4, [p_words];
    setp.ge.u32 %p, %r0, %r4;
    @%p bra DONE;
    ld.param.u64 %rd3, [p_data];
    cvta.to.global.u64 %rd3, %rd3;
    mul.wide.u32 %rd4, %r0, 4;
    add.u64 %rd5, %rd3, %rd4;
    st.global.u32 [%rd5], 0;
DONE:
    ret;
}
"""
# Thread 0 of block b: dst[b] = src[0] + 1 (both kernels' work).
WORK = """    mov.u32 %r1, %ctaid.x;
    ld.param.u64 %rd0, [p_src];
    ld.param.u64 %rd1, [p_dst];
    cvta.to.global.u64 %rd3, %rd0;
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd2, %r1, 4;
    add.u64 %rd4, %rd1, %rd2;
    ld.global.u32 %r2, [%rd3];
    add.u32 %r2, %r2, 1;
    st.global.u32 [%rd4], %r2;
"""
PTX = PTX_TEMPLATE.replace("{work}", WORK)

THREADS = 128


def run(device, rt, mode: str, kernels: int, grids: list[int], reps: int, sleep: int) -> float:
    """Microseconds a launch of a replayed chain whose launch i has ``grids[i % len(grids)]`` blocks;
    checks the chain's result."""
    module = device.load_module(PTX.encode())
    overlap = rt.Overlap()

    def kernel(name, params):
        function = rt.check(rt.cu.cuModuleGetFunction(module, name.encode()), name)
        return rt.Kernel(name, function, params, {"grid_wait": 1}, overlap)

    wait = kernel("edge_wait", ["ptr", "ptr"])
    flag = kernel("edge_flag", ["ptr", "ptr", "ptr", "ptr", "i32", "i32"])
    reset = kernel("edge_reset", ["ptr", "i32", "i32", "ptr", "i32"])
    if kernels + 1 > 1024:
        raise SystemExit("at most 1023 kernels (the reset kernel is one block)")
    grid = [grids[i % len(grids)] for i in range(kernels)]
    data = [device.alloc(max(grids) * 4, f"edge.data{i}") for i in range(2)]
    counters = device.alloc((kernels + 1) * 4, "edge.counters")
    stream = device.stream()

    def record():  # counter i counts the blocks of launch i - 1 that are done (counter 0: the reset's)
        reset.launch((1,), (1024,), (counters, kernels + 1, grid[-1], data[0], 1), stream)
        overlap.on = mode != "plain"
        try:
            for i in range(kernels):
                src, dst = data[i % 2], data[(i + 1) % 2]
                if mode == "flag":
                    flag.launch((grid[i],), (THREADS,), (src, dst, counters.at(4 * i, 4), counters.at(4 * i + 4, 4),
                                                         grid[i - 1], sleep), stream)
                else:
                    wait.launch((grid[i],), (THREADS,), (src, dst), stream)
        finally:
            overlap.on = False

    graph = rt.Graph.capture(stream, record)
    ms = replay_ms(graph, device, stream, reps, warmup=20)
    out = np.zeros(grid[-1], np.uint32)
    rt.copy_d2h(out, data[kernels % 2], stream)
    rt.synchronize(stream)
    if not (out == kernels).all():
        raise SystemExit(f"{mode}: the chain's result is wrong ({np.unique(out)[:8]} instead of {kernels})")
    graph.destroy()
    for ptr in (*data, counters):
        device.free(ptr)
    return 1000.0 * ms / kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=100, help="launches in the chain")
    parser.add_argument("--blocks", default="16,132,528,16/1152/256/512",
                        help="blocks a launch: comma-separated cases, each a count or a '/' cycle along the chain")
    parser.add_argument("--modes", default="plain,pdl,flag")
    parser.add_argument("--reps", type=int, default=200, help="graph replays timed")
    parser.add_argument("--sleep", type=int, default=0, help="nanoseconds a flag poll backs off (0: spin)")
    args = parser.parse_args()
    from ninfer.backends.cuda import runtime as rt

    device = rt.Device(0)
    print(f"device {device.name}, {device.sm_count} SMs; {args.kernels} launches a graph, {THREADS} threads a block")
    for case in args.blocks.split(","):
        grids = [int(b) for b in case.split("/")]
        figures = {mode: run(device, rt, mode, args.kernels, grids, args.reps, args.sleep)
                   for mode in args.modes.split(",")}
        print(f"{case:>16} blocks: " + "  ".join(f"{m} {us:.2f} us" for m, us in figures.items()))
    device.close()


if __name__ == "__main__":
    main()
