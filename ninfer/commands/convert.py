"""`ninfer convert SRC OUT.ninfer` and `ninfer convert --random CONFIG OUT.ninfer [--seed N]`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ninfer.options import int_range


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("ninfer convert SRC OUT.ninfer\n"
                    "       ninfer convert --random CONFIG OUT.ninfer [--seed N]")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="SRC (Hugging Face checkpoint directory or .gguf file) and OUT.ninfer")
    parser.add_argument("--random", metavar="CONFIG",
                        help="write random weights for a DenseConfig or HybridConfig JSON file or a preset "
                             "(tiny-llama, tiny-qwen3, qwen3-8b, tiny-qwen3-next, tiny-qwen3.5, tiny-qwen3.5-moe) "
                             "instead of converting SRC")
    parser.add_argument("--seed", type=int_range(0, None), default=0,
                        help="seed of the random weights (with --random; NumPy takes only non-negative seeds)")


def _check_output(out: Path) -> None:
    """Refuse an OUT that is not an earlier artifact. The writer renames its finished file over
    OUT: right for an old artifact, but it would destroy anything else found there (the GGUF
    being converted, a checkpoint's weights, a directory, a device)."""
    from ninfer.artifact.format import MAGIC
    from ninfer.convert import ConversionError

    if not os.path.lexists(out):
        return
    if out.is_dir():
        raise ConversionError(f"{out} is a directory; name the .ninfer file to write")
    if not out.is_file():
        raise ConversionError(f"{out} exists and is not a regular file")
    with open(out, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ConversionError(f"{out} exists and is not a .ninfer artifact; not replacing it")


def run(args: argparse.Namespace) -> int:
    from ninfer.artifact import ArtifactError
    from ninfer.convert import ConversionError, convert
    from ninfer.convert.progress import Progress
    from ninfer.convert.random_model import make_random_artifact

    want = 1 if args.random else 2
    if len(args.paths) != want:
        shape = "--random CONFIG OUT.ninfer" if args.random else "SRC OUT.ninfer"
        print(f"ninfer convert: expected {shape}, got {len(args.paths)} path(s)", file=sys.stderr)
        return 2
    out = args.paths[-1]
    progress = Progress(f"convert → {out}")
    try:
        _check_output(Path(out))
        if args.random:
            make_random_artifact(out, args.random, seed=args.seed, progress=progress)
        else:
            convert(args.paths[0], out, progress=progress)
    except (ConversionError, ArtifactError, ValueError, OSError) as exc:
        print(f"ninfer convert: error: {exc}", file=sys.stderr)
        return 1
    progress.finish()
    return 0
