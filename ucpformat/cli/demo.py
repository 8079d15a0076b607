"""``ucp demo``: the universal-checkpointing experiment, on CPU in a few minutes.

Trains a small GPT under tensor parallelism x FSDP2 on 4 processes, saves a UCP checkpoint
half-way, resumes it on 2 processes and on 1 with other layouts, and compares the loss
curves with the uninterrupted run (table, CSV and PNG plot in ``--out``). The work is in
:mod:`ucpformat.torch.demo`; torch is imported only when the command runs.
``--framework deepspeed`` runs the same experiment with DeepSpeed engines (ZeRO-2 on 4
processes, ZeRO-3 on 2, no ZeRO on 1; :mod:`ucpformat.deepspeed.demo`).
``--framework jax`` trains the same GPT in JAX on a (2, 4) mesh of 8 virtual CPU devices
and resumes it on (4, 2) and (1, 8) (:mod:`ucpformat.jax.demo`; torch is not needed).
``--framework cross`` trains the GPT half-way in PyTorch (TP 2 x FSDP2 2 on 4 processes)
and resumes it in JAX on a (2, 4) mesh, and the reverse (:mod:`ucpformat.cli.cross_demo`;
needs torch and jax).
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
    p.add_argument("--framework", choices=["torch", "deepspeed", "jax", "cross"],
                   default="torch",
                   help="torch (FSDP2 and tensor parallelism, the default), deepspeed "
                        "(ZeRO-2 -> ZeRO-3 and no ZeRO), jax (a (2, 4) mesh -> (4, 2) "
                        "and (1, 8)) or cross (PyTorch TP x FSDP2 on 4 processes -> JAX on "
                        "a (2, 4) mesh, and JAX -> PyTorch)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default 150; 12 with --quick); saved half-way")
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of the resumed losses (default: the demo's)")
    p.set_defaults(run=run, invalid_status=ERROR)


def run(args: argparse.Namespace) -> int:
    if args.framework == "cross":
        try:
            import jax  # noqa: F401  (both frameworks are optional dependencies: say so now)
            import torch  # noqa: F401
        except ImportError as exc:
            print("ucp: error: the demo across frameworks needs torch and jax (pip install "
                  f"'ucpformat[torch,jax]'): {exc}")
            return ERROR
        from ucpformat.cli import cross_demo

        return cross_demo.run(args)
    if args.framework == "jax":
        try:
            from ucpformat.jax import demo as jax_demo
        except ImportError as exc:  # JAX is an optional dependency
            print(f"ucp: error: the JAX demo needs jax (pip install 'ucpformat[jax]'): {exc}")
            return ERROR
        if args.rtol is None:
            args.rtol = jax_demo.DEFAULT_RTOL
        return jax_demo.run(args)
    try:
        from ucpformat.torch.demo import DEFAULT_RTOL
        from ucpformat.torch.demo import run as resume

        if args.framework == "deepspeed":
            import deepspeed  # noqa: F401  (an optional dependency: say so now)

            from ucpformat.deepspeed.demo import run as resume
    except ImportError as exc:  # torch and DeepSpeed are optional dependencies
        print(f"ucp: error: the demo needs torch (pip install 'ucpformat[torch]')"
              f"{' and deepspeed' if args.framework == 'deepspeed' else ''}: {exc}")
        return ERROR
    if args.rtol is None:
        args.rtol = DEFAULT_RTOL
    return resume(args)
