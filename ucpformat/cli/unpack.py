"""``ucp unpack SRC.ucpz DST``: a checkpoint in one file written as a directory.

The reverse of ``ucp pack`` (:mod:`ucpformat.cli.pack`, whose arguments and output it
shares); the logic is :func:`ucpformat.checkpoint.pack.unpack`. Exit status: 0 copied;
1 the source is not a valid committed checkpoint (refused, nothing written); 2 could not
run.
"""

from __future__ import annotations

import argparse
from typing import Any

from ucpformat.checkpoint.pack import unpack
from ucpformat.cli.common import FOUND
from ucpformat.cli.pack import add_arguments, run_copy


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "unpack",
        parents=[common],
        help="write a checkpoint in one file (.ucpz) as a directory",
        description="Write a committed checkpoint in one file (a .ucpz archive) as a "
        "directory, byte for byte, through the commit protocol (the root last). The "
        "source is validated first, every byte read (--no-verify: only its metadata, its "
        "manifest and each file's size); an invalid one is refused and nothing is "
        "written. A failure removes what was written; with --overwrite, the checkpoint "
        "that was at DST is gone once the copy has begun. Exit status: 0 unpacked, 1 the "
        "source is invalid, 2 could not run.",
    )
    add_arguments(p, "checkpoint in one file (or any checkpoint location)",
                  "the directory to write")
    p.set_defaults(run=run, invalid_status=FOUND)


def run(args: argparse.Namespace) -> int:
    return run_copy(args, unpack, "unpacked")


__all__ = ["register", "run"]
