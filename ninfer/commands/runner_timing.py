"""Timing a ModelRunner: the measurements of `ninfer bench backend`, shared with ``tools/gpu_bench.py``.

Decode steps as the engine drives them (one at a time, and pipelined), on the CUDA runner also its
decode graph replayed alone (device time); the bytes a decode step must move (weights + KV) and the
copy bandwidth they are set against (device to device, or one-thread host ``memcpy``); decode driven
by the engine core (the engine's host time a step); prefill and time to first token. Nothing here
imports torch, and the CUDA runtime is imported only by the functions that time a GPU.
"""

from __future__ import annotations

import gc
import time

import numpy as np

from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow

PAGE = 16
ENGINE_STEPS = 128  # tokens each request of bench_engine generates (tools/gpu_bench.py)
DECODE_SLACK = 5  # positions a bench_decode case runs past context + steps (warm-up and pipelined steps)


def replay_ms(graph, device, stream, reps: int, warmup: int = 1) -> float:
    """Milliseconds a replay of ``graph``, replayed ``reps`` times back to back (after ``warmup``
    replays), timed by events on ``stream``."""
    from ninfer.backends.cuda import runtime as rt

    start, stop = device.event(timing=True), device.event(timing=True)
    for _ in range(warmup):
        graph.launch(stream)
    rt.check(rt.cu.cuEventRecord(start, stream), "cuEventRecord")
    for _ in range(reps):
        graph.launch(stream)
    rt.check(rt.cu.cuEventRecord(stop, stream), "cuEventRecord")
    rt.synchronize(stream)
    return rt.check(rt.cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / reps


def copy_bandwidth(device, stream, nbytes: int = 4 << 30, reps: int = 10) -> float:
    """bytes read + written per second of a device-to-device copy (median of ``reps``)."""
    from ninfer.backends.cuda import runtime as rt

    a, b = device.alloc(nbytes, "bw_a"), device.alloc(nbytes, "bw_b")
    rt.memset32(a, 0x3F800000, nbytes // 4, stream)
    start, stop = device.event(timing=True), device.event(timing=True)
    times = []
    for i in range(reps + 2):
        rt.check(rt.cu.cuEventRecord(start, stream), "cuEventRecord")
        rt.copy_d2d(b, a, nbytes, stream)
        rt.check(rt.cu.cuEventRecord(stop, stream), "cuEventRecord")
        rt.synchronize(stream)
        ms = rt.check(rt.cu.cuEventElapsedTime(start, stop), "cuEventElapsedTime")
        if i >= 2:
            times.append(ms / 1e3)
    device.free(a)
    device.free(b)
    return 2 * nbytes / float(np.median(times))


def host_copy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """bytes read + written per second of one host ``memcpy`` on one thread (median of ``reps``,
    after one that faults the destination in); 256 MiB is far past any last-level cache."""
    a = np.ones(nbytes // 8)
    b = np.empty_like(a)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        np.copyto(b, a)
        if i:
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / float(np.median(times))


def weight_bytes_per_step(config) -> int:
    """Bytes of weights a CUDA decode step reads: every matrix but the embedding table (B rows of it)."""
    from ninfer.backends.cuda.weights import device_layout

    total = 0
    for name, (shape, kind) in device_layout(config).items():
        if name != "embed" or config.tie_word_embeddings:
            total += int(np.prod(shape)) * (2 if kind == "bf16" else 4)
    return total


def reference_weight_bytes_per_step(config) -> int:
    """The same for the reference runner, which upcasts every tensor to fp32 at load."""
    from ninfer.models.dense import tensor_names

    return sum(int(np.prod(shape)) * 4 for name, shape in tensor_names(config).items()
               if name != "embed" or config.tie_word_embeddings)


def decode_step_bytes(config, backend: str, batch: int, kv_tokens: int) -> int:
    """Weights + the KV of ``kv_tokens`` positions per row: what one decode step must move.
    The CUDA pool stores bf16 K and V; the reference pool fp32."""
    if backend == "cuda":
        return weight_bytes_per_step(config) + batch * kv_tokens * config.kv_bytes_per_token
    return reference_weight_bytes_per_step(config) + batch * kv_tokens * 2 * config.kv_bytes_per_token


def _max_pages(info) -> int:
    return -(-info.max_context // info.page_size)


def bench_decode(runner, config, batch: int, context: int, steps: int, copy_bw: float | None,
                 sampling: SamplingRow = SamplingRow(), pipelined: bool = True, step_bytes=None,
                 rewind=None) -> dict:
    """Decode steps as the engine drives them: one at a time (``decode``: inputs, launch, wait, tokens)
    and, with ``pipelined``, the next step launched before this one's tokens are read (as the engine
    does while the batch stays the same); on the CUDA runner then its graph replayed back to back:
    device time alone. Row i decodes at positions ``context``.. of its own pages. Figures that a
    runner cannot give (the device time of one without graphs, pipelined steps of one that does not
    pipeline decode, a roofline without ``copy_bw``) are None.

    ``step_bytes(batch, kv_tokens)``: what a step must move, where ``decode_step_bytes`` does not know the
    model (tools/gpu_bench_hybrid.py); ``rewind()``: called before each pass over the positions, for a
    runner that checks each step continues the last (the hybrids' recurrent state)."""
    info = runner.info
    max_pages = _max_pages(info)
    tables = np.stack([np.arange(max_pages) + lane * max_pages for lane in range(batch)]).astype(np.int32)
    lanes = np.arange(batch, dtype=np.int32)
    rows = [sampling] * batch

    def inputs(step, tokens):
        return DecodeBatch(lanes=lanes, tokens=tokens, positions=np.full(batch, context + step, np.int32),
                           page_tables=tables, sampling=rows)

    tokens = np.full(batch, 7, np.int32)
    times = []
    cpu0 = wall0 = 0.0
    if rewind:
        rewind()
    for step in range(steps + 3):
        if step == 3:
            cpu0, wall0 = time.process_time(), time.perf_counter()
        t0 = time.perf_counter()
        tokens = runner.decode(inputs(step, tokens)).tokens
        times.append(time.perf_counter() - t0)
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    step_s = float(np.median(times[3:]))
    pipelined_s = pipelined_cpu = None
    if pipelined and info.pipelined_decode:
        if rewind:
            rewind()
        runner.launch_decode(inputs(0, tokens))
        for step in range(1, steps + 5):  # each round launches ``step`` and collects ``step - 1``
            runner.launch_decode(inputs(step, tokens), follow=True)
            runner.finish_decode()
            if step == 4:
                pipe0, pipe_cpu0 = time.perf_counter(), time.process_time()
        pipelined_s = (time.perf_counter() - pipe0) / steps  # from step 3 collected to step steps + 3
        pipelined_cpu = (time.process_time() - pipe_cpu0) / steps
        runner.finish_decode()
    gpu_s = None
    if getattr(runner, "graphs", None):
        # Device time alone: replay the graph back to back (inputs unchanged: same positions).
        gpu_s = replay_ms(runner.replay_graph(batch), runner.device, runner.stream, steps, warmup=0) / 1e3
    kv_tokens = context + steps // 2
    nbytes = step_bytes(batch, kv_tokens) if step_bytes else decode_step_bytes(config, info.backend, batch, kv_tokens)
    roofline_step = nbytes / copy_bw if copy_bw else None

    def ms(seconds):
        return None if seconds is None else seconds * 1e3

    def pct(seconds):
        return None if roofline_step is None or seconds is None else 100 * roofline_step / seconds

    return {"batch": batch, "context": context, "temperature": sampling.temperature, "step_ms": step_s * 1e3,
            "gpu_step_ms": ms(gpu_s), "host_ms": None if gpu_s is None else (step_s - gpu_s) * 1e3,
            "tok_s": batch / step_s, "achieved_gb_s": nbytes / (gpu_s or step_s) / 1e9,
            "roofline_tok_s": None if roofline_step is None else batch / roofline_step,
            "pct_roofline": pct(step_s), "cpu_cores_busy": cpu_share,
            "pipelined_step_ms": ms(pipelined_s),
            "pipelined_tok_s": None if pipelined_s is None else batch / pipelined_s,
            "pipelined_pct_roofline": pct(pipelined_s), "pipelined_host_cpu_ms": ms(pipelined_cpu)}


def bench_engine(runner, batch: int, context: int, steps: int, pipelined: bool = True) -> dict:
    """Decode driven by the engine core (scheduling, page tables, sampling rows, commits and events;
    with ``pipelined`` the next step launched ahead as the worker does): ``batch`` greedy requests of
    ``context`` prompt tokens. The figure is the stretch where every request decodes, up to the
    first that ends: wall time per step, and the host's own time per step (time outside runner
    calls, the engine's host time as the spec counts it)."""
    from ninfer.engine import EngineConfig, GenerationRequest
    from ninfer.engine.context_cost import load
    from ninfer.engine.core import EngineCore
    from ninfer.engine.sequence import Sequence

    info = runner.info
    config = EngineConfig(max_concurrency=batch, max_context=info.max_context, page_size=info.page_size,
                          kv_capacity=info.num_pages * info.page_size, prefill_chunk=512, prefix_reuse=False)
    core = EngineCore(runner, config, load(None, info.backend, None))
    gc.collect()  # as the engine's worker does once its core is built (a full pass mid-run costs 100+ ms here)
    gc.freeze()
    try:
        core.pipelined = pipelined and info.pipelined_decode
        rng = np.random.default_rng(batch)
        for rid in range(batch):
            prompt = rng.integers(0, info.vocab_size, context).tolist()
            core.add(Sequence(rid, GenerationRequest(prompt=prompt, max_tokens=steps), SamplingRow(), frozenset(),
                              core.limit, float("inf"), time.monotonic()))
        marks = []  # after each step: (wall clock, decode rows so far, engine host seconds so far)
        work = core.counters.host_work
        while core.has_work():
            core.step()
            marks.append((time.perf_counter(), core.counters.decode_row_rounds,
                          work["engine_boundary"] + work["program_submit"] + work["program_post"],
                          core.last_runner_seconds))
    finally:
        gc.unfreeze()
    # The steady stretch: consecutive steps that each decoded all ``batch`` rows, less two at each end.
    full = [i for i in range(1, len(marks)) if marks[i][1] - marks[i - 1][1] == batch]
    first, last = full[2], full[-3]
    (t0, r0, h0, _), (t1, r1, h1, _) = marks[first], marks[last]
    rounds = (r1 - r0) // batch
    step_s, host_s = (t1 - t0) / rounds, (h1 - h0) / rounds
    runner_s = float(np.median([m[3] for m in marks[first + 1:last + 1]]))
    longest_s = max(b[0] - a[0] for a, b in zip(marks[first:last], marks[first + 1:last + 1]))
    return {"batch": batch, "context": context, "pipelined": core.pipelined, "step_ms": step_s * 1e3,
            "tok_s": batch / step_s, "engine_host_us": host_s * 1e6, "runner_ms": runner_s * 1e3,
            "longest_step_ms": longest_s * 1e3}


def _prefill_seconds(runner, tokens: int) -> float:
    """Host-to-host seconds of one prefill of a ``tokens`` prompt from an empty context, first token
    sampled (the prompt's pages start at page 0)."""
    prompt = (np.arange(tokens) * 7919 % runner.info.vocab_size).astype(np.int32)
    table = np.arange(_max_pages(runner.info), dtype=np.int32)
    t0 = time.perf_counter()
    runner.prefill(PrefillChunk(lane=0, tokens=prompt, start=0, page_table=table, sample=SamplingRow()))
    return time.perf_counter() - t0


def bench_prefill(runner, tokens: int) -> dict:
    seconds = _prefill_seconds(runner, tokens)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def bench_ttft(runner, tokens: int, reps: int = 3) -> dict:
    """Time to the first sampled token through the runner (median of ``reps`` prefills)."""
    times = [_prefill_seconds(runner, tokens) for _ in range(reps)]
    return {"prompt": tokens, "ttft_ms": float(np.median(times)) * 1e3}
