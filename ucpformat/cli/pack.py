"""``ucp pack SRC DST.ucpz``: a committed checkpoint written as one file (spec §11.5).

The logic is :func:`ucpformat.checkpoint.pack.pack`; this module parses the arguments and
prints one line. ``ucp unpack`` (:mod:`ucpformat.cli.unpack`) is its reverse and shares
:func:`add_arguments` and :func:`run_copy`.

Exit status: 0 copied; 1 the source is not a valid committed checkpoint (refused, nothing
written); 2 could not run (a missing source, a destination that exists without
``--overwrite``, a failed write).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from ucpformat.checkpoint.pack import PackResult, pack
from ucpformat.cli.common import FOUND, OK, human_bytes, resolve_location


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "pack",
        parents=[common],
        help="write a checkpoint directory as one file (.ucpz)",
        description="Write a committed checkpoint (a directory, as a distributed save "
        "writes it) as one file: a ZIP archive of exactly its objects, byte for byte "
        "(spec 11.5). The source is validated first, every byte read (--no-verify: only "
        "its metadata, its manifest and each file's size); an invalid one is refused and "
        "nothing is written. The file is written beside DST and renamed onto it at the "
        "end: a failure leaves DST as it was. Exit status: 0 packed, 1 the source is "
        "invalid, 2 could not run.",
    )
    add_arguments(p, "checkpoint directory (or any checkpoint location)",
                  "the file to write (its name should end in .ucpz)")
    p.set_defaults(run=run, invalid_status=FOUND)


def add_arguments(p: argparse.ArgumentParser, source: str, destination: str) -> None:
    """The arguments ``ucp pack`` and ``ucp unpack`` share."""
    p.add_argument("src", metavar="SRC", help=source)
    p.add_argument("dst", metavar="DST", help=destination)
    p.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint at DST (never anything else)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not read and check every byte of SRC first (its metadata, "
                   "manifest and file sizes are still checked)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")


def run_copy(args: argparse.Namespace, copy: Callable[..., PackResult], verb: str) -> int:
    """Run ``copy`` (:func:`~ucpformat.checkpoint.pack.pack` or ``unpack``) with the
    arguments of :func:`add_arguments`; one line on stdout says what was written."""
    source = resolve_location(args.src)
    show = not args.no_progress and not args.quiet and sys.stderr.isatty()
    result = copy(source, args.dst, overwrite=args.overwrite, verify=args.verify,
                  progress=show)
    if not args.quiet:
        checked = ("every byte of the source verified first" if args.verify
                   else "not verified: --no-verify")
        print(f"{verb} {source} -> {result.location}: {result.files:,} files, "
              f"{human_bytes(result.file_bytes)}, {result.tensors:,} tensors ({checked})")
    return OK


def run(args: argparse.Namespace) -> int:
    return run_copy(args, pack, "packed")


__all__ = ["add_arguments", "register", "run", "run_copy"]
