"""`ninfer bench` (not built yet: it says so instead of pretending)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    print("ninfer bench: not available in this build yet", file=sys.stderr)
    return 2
