"""``ucp validate``: check a checkpoint against the spec.

Exit status 0 valid, 1 invalid, 2 could not run (missing or unreadable path, bad arguments).
Without ``--deep`` no chunk is read (a flipped byte inside a chunk goes unnoticed); the
environment variable :data:`DEEP_ENV` (``UCP_VALIDATE_DEEP=1``) makes ``--deep`` the
default, for CI, and ``--shallow`` overrides it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rich.text import Text

from ucpformat.checkpoint.validation import Issue, Report, validate
from ucpformat.cli.common import FOUND, OK, CommandError, console, resolve_location, write_json


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "validate",
        parents=[common],
        help="check a checkpoint against the spec",
        description="Check a checkpoint against the spec and its JSON Schemas. Every problem "
        "names the requirement it breaks. Exit status: 0 valid, 1 invalid, 2 could not run.",
    )
    p.add_argument("path", help="checkpoint directory")
    depth = p.add_mutually_exclusive_group()
    depth.add_argument("--deep", action="store_true", default=None,
                       help="also read every stored object: check every CRC32C, and every "
                       f"SHA-256 the manifest records (the default where {DEEP_ENV}=1)")
    depth.add_argument("--shallow", dest="deep", action="store_false",
                       help=f"metadata and manifest only, whatever {DEEP_ENV} says")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true",
                     help='print {"valid", "errors", "warnings"} as JSON')
    out.add_argument("--quiet", "-q", action="store_true",
                     help="print nothing; the exit status says it all")
    p.set_defaults(run=run, invalid_status=FOUND)


#: ``UCP_VALIDATE_DEEP=1`` (or ``true``, ``yes``, ``on``) makes ``ucp validate`` deep by
#: default; ``0``, ``false``, ``no``, ``off`` or empty keep it shallow; other values are refused.
DEEP_ENV = "UCP_VALIDATE_DEEP"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def deep_default() -> bool:
    """Whether ``ucp validate`` without ``--deep`` or ``--shallow`` is deep (:data:`DEEP_ENV`)."""
    value = os.environ.get(DEEP_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise CommandError(f"{DEEP_ENV}={os.environ[DEEP_ENV]!r}: expected 1 or 0 (true/false, "
                       "yes/no, on/off)")


_STYLE = {"error": "bold red", "warning": "yellow"}


def issue_line(issue: Issue) -> Text:
    """``error: [UCP-1.0-R031] model/w/c/0: listed in the manifest but missing``."""
    return Text.assemble(
        (issue.level, _STYLE.get(issue.level, "")),
        ": ",
        (f"[{issue.rule}] " if issue.rule else "", "bold"),
        f"{issue.path}: {issue.message}",
    )


def verdict(report: Report) -> Text:
    if report.valid:
        detail = (
            f"deep: {report.checked_objects:,} stored objects read, every checksum verified"
            if report.deep
            else "metadata and manifest checked, no chunk read: damage inside a chunk goes "
            f"unnoticed; --deep or {DEEP_ENV}=1 verifies every checksum"
        )
        warnings = f", {len(report.warnings)} warning(s)" if report.warnings else ""
        return Text.assemble(("valid", "bold green"), f": {report.location} ({detail}{warnings})")
    return Text.assemble(
        ("invalid", "bold red"),
        f": {report.location} ({len(report.errors)} error(s), {len(report.warnings)} warning(s))",
    )


def run(args: argparse.Namespace) -> int:
    deep = deep_default() if args.deep is None else args.deep
    path = resolve_location(args.path)
    progress = deep and not args.quiet and sys.stderr.isatty()
    report = validate(path, deep=deep, progress=progress)
    if args.json:
        write_json(report.to_json())
    elif not args.quiet:
        out = console()
        for issue in report.issues:
            out.print(issue_line(issue), soft_wrap=True)
        out.print(verdict(report), soft_wrap=True)
    return OK if report.valid else FOUND
