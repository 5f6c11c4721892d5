"""`ninfer generate`: one prompt, one sequence, text streamed to stdout, speeds on stderr.

It drives a ``ReferenceRunner`` directly with a tiny single-sequence loop (no Engine): prefill the
whole prompt, then decode one token at a time until ``--max-tokens``, an end-of-sequence token, or
the context limit. The speeds it prints are the backend's own: prompt tokens per second of the
prefill, and generated tokens per second of the decode steps.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

PAGE_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", nargs="?", type=Path,
                        help="a .ninfer file (default: the embedded SmolLM2-135M-Instruct demo model)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="render the prompt as one user message through the artifact's chat template")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 (the default) is greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


@dataclass
class Timing:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0  # tokens produced by decode steps (all but the first)
    decode_s: float = 0.0


def generate_tokens(runner, prompt: Sequence[int], *, max_tokens: int, temperature: float, seed: int,
                    stop_ids: Sequence[int], timing: Timing) -> Iterator[int]:
    """Yield generated ids (an id in ``stop_ids`` ends generation and is not yielded)."""
    from ninfer.backends.runner import DecodeBatch, PrefillChunk, SamplingRow

    def row(step: int) -> SamplingRow:
        return SamplingRow(temperature=temperature, seed=seed, step=step)

    limit = min(max_tokens, runner.info.max_context - len(prompt))
    table = np.arange(runner.info.num_pages, dtype=np.int32)
    runner.bind_lane(0, [])
    started = time.perf_counter()
    first = runner.prefill(PrefillChunk(lane=0, tokens=np.asarray(prompt, np.int32), start=0,
                                        page_table=table, sample=row(0)))
    timing.prompt_tokens, timing.prefill_s = len(prompt), time.perf_counter() - started
    token = int(first.tokens[0])
    for step in range(1, limit + 1):
        if token in stop_ids:
            return
        yield token
        if step == limit:
            return
        started = time.perf_counter()
        result = runner.decode(DecodeBatch(
            lanes=np.zeros(1, np.int32), tokens=np.array([token], np.int32),
            positions=np.array([len(prompt) + step - 1], np.int32), page_tables=table[None, :],
            sampling=[row(step)]))
        timing.decode_s += time.perf_counter() - started
        timing.decode_tokens += 1
        token = int(result.tokens[0])


def _resolve_artifact(path: Path | None) -> Path:
    if path is not None:
        if not path.is_file():
            raise SystemExit(f"ninfer generate: {path}: no such artifact file")
        return path
    from ninfer import demo
    from ninfer.convert.progress import Progress

    progress = Progress("converting the demo model (first use only)")
    converted = False

    def report(done: int, total: int, name: str) -> None:
        nonlocal converted
        converted = True
        progress(done, total, name)

    from ninfer.artifact import ArtifactError
    from ninfer.convert import ConversionError

    try:
        artifact = demo.default_artifact(progress=report)
    except demo.DemoModelMissing as exc:
        raise SystemExit(f"ninfer generate: {exc}") from None
    except (ConversionError, ArtifactError, OSError) as exc:  # e.g. $NINFER_CACHE is a file or read-only
        raise SystemExit(f"ninfer generate: cannot prepare the demo model in {demo.cache_dir()}: {exc}") from None
    if converted:
        progress.finish()
    return artifact


def _prompt_ids(art, tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        from ninfer.text import ChatFormatter

        if not art.chat_template:
            raise SystemExit("ninfer generate: --chat: the artifact has no chat template")
        formatter = ChatFormatter(tokenizer, art.chat_template, art.special_tokens)
        return list(formatter.render([{"role": "user", "content": text}], add_generation_prompt=True).token_ids)
    if not text:
        raise SystemExit("ninfer generate: --prompt is empty (only --chat can render an empty message)")
    return tokenizer.encode(text)


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tok/s" if seconds > 0 and tokens else "n/a"


def weight_bytes_per_token(config) -> int:
    """fp32 weight bytes one decode step reads: every matrix once; the embedding table only when
    it doubles as the LM head (a lookup touches just one row)."""
    from ninfer.models.dense import tensor_names
    from ninfer.models.hybrid import HybridConfig, tensor_names as hybrid_tensor_names

    names = hybrid_tensor_names(config) if isinstance(config, HybridConfig) else tensor_names(config)
    total = 0
    for name, shape in names.items():
        if name != "embed" or config.tie_word_embeddings:
            size = 4 * int(np.prod(shape))
            if ".experts." in name:  # MoE: a token reads only its top-k experts
                size = size * config.num_experts_per_tok // config.num_experts
            total += size
    return total


def _bandwidth(config, tokens: int, seconds: float) -> str:
    if seconds <= 0 or not tokens:
        return ""
    return f", {weight_bytes_per_token(config) * tokens / seconds / 1e9:.1f} GB/s of fp32 weights"


def _check_options(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise SystemExit(f"ninfer generate: --max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise SystemExit(f"ninfer generate: --temperature must be >= 0, got {args.temperature}")
    if not math.isfinite(args.temperature):  # nan and inf pass the test above
        raise SystemExit(f"ninfer generate: --temperature must be finite, got {args.temperature}")
    if not -2**63 <= args.seed < 2**63:  # the samplers' seed is a signed 64-bit integer
        raise SystemExit(f"ninfer generate: --seed must fit a signed 64-bit integer, got {args.seed}")


def _load(args: argparse.Namespace):
    """(tokenizer, prompt ids, runner) for the artifact and the prompt."""
    from ninfer.artifact import open_artifact
    from ninfer.backends.reference import ReferenceRunner
    from ninfer.text import Tokenizer

    with open_artifact(_resolve_artifact(args.artifact), components=("text",)) as art:
        tokenizer = Tokenizer.from_artifact(art)
        prompt = _prompt_ids(art, tokenizer, args.prompt, args.chat)
        context = min(len(prompt) + args.max_tokens, int(art.config["max_position_embeddings"]))
        if len(prompt) >= context:
            raise SystemExit(f"ninfer generate: the prompt has {len(prompt)} tokens, the model's context is {context}")
        runner = ReferenceRunner(art, page_size=PAGE_SIZE, num_pages=-(-context // PAGE_SIZE), max_batch=1,
                                 max_context=context)
    return tokenizer, prompt, runner


def run(args: argparse.Namespace, out: Callable[[str], None] | None = None) -> int:
    _check_options(args)
    from ninfer.artifact import ArtifactError
    from ninfer.text import TemplateError
    from ninfer.text.detokenizer import IncrementalDetokenizer

    try:
        tokenizer, prompt, runner = _load(args)
    # A truncated or foreign file, a broken tokenizer or chat template, a model the backend does not run.
    except (ArtifactError, ValueError, TemplateError, OSError) as exc:
        raise SystemExit(f"ninfer generate: {exc}") from None
    write = out or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    detokenizer = IncrementalDetokenizer(tokenizer.decode)
    timing = Timing()
    tokens = generate_tokens(runner, prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                             seed=args.seed, stop_ids=tokenizer.eos_token_ids, timing=timing)
    generated = 0
    for token in tokens:
        generated += 1
        write(detokenizer.push([token]))
    write(detokenizer.flush() + "\n")
    print(f"prompt: {timing.prompt_tokens} tokens, {_rate(timing.prompt_tokens, timing.prefill_s)}; "
          f"decode: {generated} tokens, {_rate(timing.decode_tokens, timing.decode_s)}"
          f"{_bandwidth(runner.config, timing.decode_tokens, timing.decode_s)} (reference backend)", file=sys.stderr)
    runner.close()
    return 0
