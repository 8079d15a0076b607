"""The ``ucp`` command.

Each subcommand module has ``register(subparsers, parent)`` and sets ``run(args) -> int``
as its default; ``main`` parses the arguments and returns the exit status.

(Placeholder of the conformance branch: the ``cli`` branch brings inspect, validate, diff
and demo; merging keeps its version of this file and adds ``conformance`` (the module
ucpformat/cli/conformance.py) to its imports and to COMMANDS.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from ucpformat._version import __version__
from ucpformat.cli import conformance

COMMANDS: tuple[ModuleType, ...] = (conformance,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ucp", description="UCP (universal checkpoint) tools.")
    parser.add_argument("--version", action="version", version=f"ucp (ucpformat) {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS:
        module.register(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        status: int = args.run(args)
        return status
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        sys.stderr.write(f"ucp: error: {type(exc).__name__}: {exc}\n")
        return 2


__all__ = ["COMMANDS", "build_parser", "main"]
