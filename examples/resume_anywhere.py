"""Resume anywhere: train on 4 processes (TP 2 x FSDP2 2), resume on 2 and on 1.

A thin wrapper of ``python -m ucpformat.torch.demo`` (see that module):

    python examples/resume_anywhere.py [--out DIR] [--steps N] [--quick]

It prints the loss table, writes losses.csv, summary.json and resume.png (with
matplotlib) into --out, and exits with status 1 if a resumed curve leaves the
uninterrupted one by more than the stated tolerance.
"""

import sys

from ucpformat.torch.demo import main

if __name__ == "__main__":
    sys.exit(main())
