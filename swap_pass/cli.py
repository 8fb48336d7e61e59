"""The ``swap-pass`` command line: ``demo``, ``bench``, ``plan``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swap-pass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a small Llama-style model with and without swap")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        print("swap-pass demo: not built yet (see the CLI issue).", file=sys.stderr)
        return 0
    return 2
