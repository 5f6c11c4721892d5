"""`ninfer serve [ARTIFACT] [options]`: the HTTP server over one resident Engine.

Options come from ``ninfer.options`` (the one definition shared with docs/cli.md); startup itself
lives in ``ninfer.server.main``.
"""

from __future__ import annotations

import argparse
import sys

from ninfer import options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", nargs="?", default=None,
                        help="a .ninfer artifact (default: the embedded SmolLM2 demo model)")
    options.add_to_parser(parser)


def run(args: argparse.Namespace) -> int:
    try:
        cuda = False
        if args.device != "cpu":
            from ninfer.server.backend import cuda_available

            cuda = cuda_available()
        options.check_capabilities(args, cuda_available=cuda)
    except options.OptionError as e:
        print(f"ninfer serve: {e}", file=sys.stderr)
        return 2
    from ninfer.server.main import main

    return main(args, argv=sys.argv[1:])
