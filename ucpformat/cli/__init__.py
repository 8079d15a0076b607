"""The ``ucp`` command: inspect, validate, diff, pack and unpack checkpoints, and a demo.

Each subcommand lives in its own module with ``register(subparsers, parent)`` and a
``run(args) -> int``; ``main`` only parses arguments and turns errors into one line on
stderr and an exit status (0 ok, 1 invalid or different, 2 could not run)::

    ucp inspect CKPT [--json] [--all]
    ucp validate CKPT [--json] [--deep] [--quiet]
    ucp diff A B [--json] [--atol X] [--rtol X] [--all]
    ucp pack SRC DST.ucpz [--overwrite] [--no-verify]
    ucp unpack SRC.ucpz DST [--overwrite] [--no-verify]
    ucp tour [--dir DIR]
    ucp demo [--out DIR] [--quick]
    ucp conformance check|reader|writer ...
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType

from ucpformat._version import __version__
from ucpformat.cli import (
    conformance,
    convert,
    demo,
    diff,
    export,
    inspect,
    pack,
    tour,
    unpack,
    validate,
)
from ucpformat.cli.common import ERROR, FOUND, CommandError, as_flags, long_options
from ucpformat.errors import (
    CheckpointNotFoundError,
    FormatError,
    ResourceLimitError,
    UCPError,
)

#: The subcommands, in the order ``ucp --help`` lists them. The demo is one module, so
#: that a fuller demo can replace it without touching anything else.
COMMANDS: tuple[ModuleType, ...] = (
    inspect, validate, diff, pack, unpack, conformance, convert, export, tour, demo
)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one ``ucp: error:`` line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"ucp: error: {message}\n")
        raise SystemExit(ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ucp",
        description="Inspect, validate, compare, pack and unpack UCP (universal checkpoint) "
        "checkpoints.",
        epilog="Exit status: 0 ok, 1 invalid (validate, inspect; the source of pack and "
        "unpack) or different (diff), 2 could not run.",
    )
    parser.add_argument("--version", action="version", version=f"ucp (ucpformat) {__version__}")
    parser.add_argument("--debug", action="store_true", default=False,
                        help="show a Python traceback on errors")
    # Accept --debug after the subcommand too; SUPPRESS keeps the global value otherwise.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show a Python traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for module in COMMANDS:
        module.register(sub, common)
    for command in sub.choices.values():
        # error messages name the library's keywords (overwrite=True): say --overwrite
        command.set_defaults(flags=long_options(command))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ucp`` with ``argv`` (default: the process arguments); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed)
        return exc.code if isinstance(exc.code, int) else ERROR
    debug: bool = args.debug
    try:
        status: int = args.run(args)
        return status
    except KeyboardInterrupt:
        sys.stderr.write("ucp: interrupted\n")
        return 130
    except BrokenPipeError:  # `ucp inspect ... | head`
        return ERROR
    except Exception as exc:
        if debug:
            traceback.print_exc()
        code, line = _describe(exc, invalid_status=getattr(args, "invalid_status", FOUND))
        sys.stderr.write(f"ucp: error: {as_flags(line, getattr(args, 'flags', ()))}\n")
        return code


def _describe(exc: Exception, *, invalid_status: int) -> tuple[int, str]:
    """Exit status and one-line message of an error."""
    if isinstance(exc, CheckpointNotFoundError | CommandError | ResourceLimitError):
        return ERROR, str(exc)
    if isinstance(exc, FormatError):  # the checkpoint breaks the spec
        return invalid_status, str(exc)
    if isinstance(exc, UCPError):
        return ERROR, str(exc)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return ERROR, f"{where}{exc.strerror or exc}"
    return ERROR, f"internal error: {type(exc).__name__}: {exc} (run with --debug for a traceback)"


__all__ = ["COMMANDS", "build_parser", "main"]
