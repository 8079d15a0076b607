"""``ucp demo``: the universal-checkpointing experiment, on CPU in a few minutes.

Trains a small GPT under tensor parallelism x FSDP2 on 4 processes, saves a UCP checkpoint
half-way, resumes it on 2 processes and on 1 with other layouts, and compares the loss
curves with the uninterrupted run (table, CSV and PNG plot in ``--out``). The work is in
:mod:`ucpformat.torch.demo`; torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from ucpformat.cli.common import ERROR


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "demo",
        parents=[common],
        help="train on 4 processes, resume on 2 and 1 with other layouts, compare the curves",
        description="The universal-checkpointing experiment, on CPU in a few minutes: train "
        "a small GPT with TP=2 x FSDP2=2 on 4 processes, save half-way, resume on 2 processes "
        "and on 1 with other layouts, and compare the loss curves with the uninterrupted run.",
    )
    p.add_argument("--out", default="demo-out", help="output directory (default: demo-out)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default 150; 12 with --quick); saved half-way")
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of the resumed losses (default: the demo's)")
    p.set_defaults(run=run, invalid_status=ERROR)


def run(args: argparse.Namespace) -> int:
    try:
        from ucpformat.torch.demo import DEFAULT_RTOL
        from ucpformat.torch.demo import run as resume
    except ImportError as exc:  # torch is an optional dependency of the format
        print(f"ucp: error: the demo needs torch (pip install 'ucpformat[torch]'): {exc}")
        return ERROR
    if args.rtol is None:
        args.rtol = DEFAULT_RTOL
    return resume(args)
