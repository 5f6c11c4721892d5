"""Time the reference backend's prefill and decode on an artifact (default: the demo SmolLM2).

    .venv/bin/python tools/bench_reference.py [ARTIFACT] [--blas-threads N] [--batch B]
        [--prompt-tokens P] [--decode-tokens D] [--repeat R]

Each repeat prefills ``B`` random prompts of ``P`` tokens one by one, then decodes ``D`` steps of
one batch of ``B`` rows (greedy, each on its own pages) and prints prefill tok/s, decode tok/s
(tokens of all rows) and the fp32 weight bandwidth of the decode steps. ``--blas-threads 0``
leaves OpenBLAS at its own thread count.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from ninfer.artifact import open_artifact
from ninfer.backends.reference import ReferenceRunner
from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow
from ninfer.commands.generate import weight_bytes_per_token

PAGE_SIZE = 16


def bench_once(runner: ReferenceRunner, rng: np.random.Generator, batch: int, prompt_tokens: int,
               decode_tokens: int) -> tuple[float, float]:
    pages_per_row = -(-(prompt_tokens + decode_tokens) // PAGE_SIZE)
    tables = np.arange(batch * pages_per_row, dtype=np.int32).reshape(batch, pages_per_row)
    vocab = runner.info.vocab_size
    first = []
    started = time.perf_counter()
    for row in range(batch):
        runner.bind_lane(row, [])
        prompt = rng.integers(0, vocab, size=prompt_tokens).astype(np.int32)
        result = runner.prefill(PrefillChunk(lane=row, tokens=prompt, start=0, page_table=tables[row],
                                             sample=SamplingRow()))
        first.append(int(result.tokens[0]))
    prefill_s = time.perf_counter() - started
    tokens = np.array(first, np.int32)
    lanes = np.arange(batch, dtype=np.int32)
    started = time.perf_counter()
    for step in range(decode_tokens):
        positions = np.full(batch, prompt_tokens + step, np.int32)
        result = runner.decode(DecodeBatch(lanes=lanes, tokens=tokens, positions=positions, page_tables=tables,
                                           sampling=[SamplingRow()] * batch))
        tokens = result.tokens
    decode_s = time.perf_counter() - started
    return batch * prompt_tokens / prefill_s, batch * decode_tokens / decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?", type=Path)
    parser.add_argument("--blas-threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=42)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.artifact is None:
        from ninfer.demo import default_artifact

        args.artifact = default_artifact()
    context = args.prompt_tokens + args.decode_tokens
    pages = args.batch * -(-context // PAGE_SIZE)
    with open_artifact(args.artifact) as art:
        runner = ReferenceRunner(art, page_size=PAGE_SIZE, num_pages=pages, max_batch=args.batch,
                                 max_context=context, blas_threads=args.blas_threads or None)
    per_step = weight_bytes_per_token(runner.config)
    print(f"{args.artifact.name}: batch {args.batch}, prompt {args.prompt_tokens}, decode {args.decode_tokens}, "
          f"BLAS threads {args.blas_threads or 'library default'}, {os.cpu_count()} CPUs")
    rng = np.random.default_rng(0)
    for _ in range(args.repeat):
        load = os.getloadavg()[0]
        prefill, decode = bench_once(runner, rng, args.batch, args.prompt_tokens, args.decode_tokens)
        bandwidth = per_step * decode / args.batch / 1e9
        print(f"prefill {prefill:7.1f} tok/s   decode {decode:6.1f} tok/s   {bandwidth:5.1f} GB/s of fp32 weights"
              f"   (load average {load:.2f})")


if __name__ == "__main__":
    main()
