"""The `ninfer` command: one subcommand per module in ninfer/commands/.

Each module exposes ``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them,
so a subcommand's options are defined once, beside its code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

SUBCOMMANDS = {
    "serve": "serve the OpenAI and Anthropic HTTP APIs over one resident model",
    "generate": "generate text from a prompt on the command line",
    "convert": "convert a Hugging Face checkpoint or a GGUF file into a .ninfer artifact",
    "inspect": "print an artifact's metadata, components and tensor sizes",
    "bench": "measure the engine, a backend or a running server",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        module = importlib.import_module(f"ninfer.commands.{name}")
        child = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(child)
        child.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args._module.run(args) or 0)
        sys.stdout.flush()  # here, where a reader that left can be handled, not at interpreter exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader left (`ninfer inspect --tensors x | head`): stop quietly, as a tool killed by
        # SIGPIPE would, and point stdout at /dev/null so the flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
