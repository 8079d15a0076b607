"""Does ucpformat make gloo's teardown abort more likely? Counts over many two-rank runs.

With torch 2.13 and gloo, a process sometimes aborts at exit after all its work is done
("terminate called without an active exception", SIGABRT; torchrun then exits 1). This
harness runs two-rank jobs the way ``torchrun`` starts them (``env://`` rendezvous,
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``) in four arms, interleaved so that
every arm sees the same machine load, and counts the runs in which a rank aborted:

* ``plain``: no ucpformat at all; a few ``all_reduce`` (a training step's gradient
  averaging), then ``destroy_process_group()`` and a normal interpreter exit;
* ``ucp``: ``load_distributed`` (ucpformat.torch) of a small model and its optimizer, then
  the same end;
* ``plain+barrier`` and ``ucp+barrier``: the same with ``dist.barrier()`` before
  ``destroy_process_group()`` (the recipe of docs/torch-distributed.md).

    python -m ucpformat.testing.teardown [--runs 30] [--jobs 1 | --fork] [--torchrun]
                                         [--arms A,B] [--json]

``--fork`` forks the ranks from the harness (torch imported once; each rank still ends
through the interpreter's normal shutdown), to afford many runs on a small machine.

The result on this project's machine is in docs/torch-distributed.md ("Ending a
torchrun script"). Each run costs two interpreter starts with torch (seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

ARMS = ("plain", "ucp", "plain+barrier", "ucp+barrier")
#: What gloo's abort prints (and SIGABRT's status).
ABORT_TEXT = "terminate called without an active exception"


def _worker(arm: str, ckpt: str) -> None:
    """One rank of one run (started with the torchrun environment)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if arm.startswith("ucp"):
        import ucpformat.torch as ucpt

        ucpt.load_distributed(ckpt, model=model, optimizer=optimizer)
    else:
        for p in model.parameters():  # a training step's gradient averaging
            dist.all_reduce(p.detach().clone())
    if arm.endswith("+barrier"):
        dist.barrier()
    dist.destroy_process_group()
    print("done", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RunResult:
    arm: str
    aborted: bool
    statuses: list[int]
    other_failure: str | None = None


def run_once(arm: str, ckpt: str, *, timeout: float = 300.0) -> RunResult:
    """One two-rank run of ``arm``; whether a rank aborted at teardown."""
    env_base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                    WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ucpformat.testing.teardown", "--worker", arm, ckpt],
            env={**env_base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    statuses = [p.returncode for p in procs]
    aborted = any(s == -6 or ABORT_TEXT in err for s, (_, err) in zip(statuses, outs,
                                                                       strict=True))
    other = None
    if not aborted and (any(statuses) or not all("done" in out for out, _ in outs)):
        other = " | ".join(err.strip().splitlines()[-1] if err.strip() else f"status {s}"
                           for s, (_, err) in zip(statuses, outs, strict=True))
    return RunResult(arm, aborted, statuses, other)


def run_forked(arm: str, ckpt: str, logdir: str, *, timeout: float = 300.0) -> RunResult:
    """:func:`run_once` with the two ranks forked from this process, torch already
    imported (ucpformat is imported in the ranks of the ``ucp`` arms only): the same
    teardown, without two interpreter starts per run. Each rank exits through the
    interpreter's normal shutdown, where the abort happens; so this function and its
    callers hold no finally block or context manager (the rank unwinds them)."""
    port = str(_free_port())
    pids = []
    for r in range(2):
        err = os.path.join(logdir, f"rank{r}.err")
        pid = os.fork()
        if pid == 0:  # the rank: never returns into the caller's frames
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            os.dup2(fd, 1)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2",
                              RANK=str(r), LOCAL_RANK=str(r))
            code = 0
            try:
                _worker(arm, ckpt)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            # the interpreter's normal shutdown (atexit, module teardown, C++ static
            # destructors), where the abort happens: SystemExit unwinds the caller's
            # frames, which therefore hold no finally block or context manager
            raise SystemExit(code)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    statuses = []
    for pid in pids:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses.append(os.waitstatus_to_exitcode(status))
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
            time.sleep(0.05)
    errs = []
    for r in range(2):
        with open(os.path.join(logdir, f"rank{r}.err"), errors="replace") as f:
            errs.append(f.read())
    aborted = any(s == -6 or ABORT_TEXT in e for s, e in zip(statuses, errs, strict=True))
    other = None
    if not aborted and (any(statuses) or not all("done" in e for e in errs)):
        other = " | ".join(e.strip().splitlines()[-1] if e.strip() else f"status {s}"
                           for s, e in zip(statuses, errs, strict=True))
    return RunResult(arm, aborted, statuses, other)


def run_torchrun(arm: str, ckpt: str, *, timeout: float = 300.0) -> RunResult:
    """:func:`run_once` through ``torchrun --nproc_per_node 2`` itself (one more
    interpreter per run): the abort shows as torchrun's exit status 1 and the text, or
    the signal, in its output."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(_free_port()), "-m", "ucpformat.testing.teardown",
            "--worker", arm, ckpt]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    aborted = ABORT_TEXT in text or "Signal 6 (SIGABRT)" in text
    other = None
    if not aborted and (proc.returncode or text.count("done") < 2):
        other = (proc.stderr.strip().splitlines() or [f"status {proc.returncode}"])[-1]
    return RunResult(arm, aborted, [proc.returncode], other)


def make_checkpoint(path: str) -> None:
    """The checkpoint the ``ucp`` arms load (one process, the same model)."""
    import torch

    import ucpformat.torch as ucpt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    ucpt.save(path, model=model, optimizer=optimizer, step=1, durable=False)


@dataclass
class Counts:
    runs: int = 0
    aborted: int = 0
    failed: list[str] = field(default_factory=list)


def fisher_exact(a: int, n1: int, b: int, n2: int) -> float:
    """Two-sided p-value of Fisher's exact test: ``a`` of ``n1`` against ``b`` of ``n2``."""
    k, n = a + b, n1 + n2

    def p(x: int) -> float:
        return math.comb(n1, x) * math.comb(n2, k - x) / math.comb(n, k)

    observed = p(a)
    return min(1.0, sum(p(x) for x in range(max(0, k - n2), min(k, n1) + 1)
                        if p(x) <= observed * (1 + 1e-9)))


def measure(runs: int, jobs: int = 1, arms: Sequence[str] = ARMS, *,
            torchrun: bool = False) -> dict[str, Counts]:
    """``runs`` runs of each arm, interleaved (arm by arm within each round); through
    ``torchrun`` itself with ``torchrun``."""
    counts = {arm: Counts() for arm in arms}
    with tempfile.TemporaryDirectory(prefix="ucp-teardown-") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        make_checkpoint(ckpt)
        order = [arm for _ in range(runs) for arm in arms]
        with ThreadPoolExecutor(jobs) as pool:
            one = run_torchrun if torchrun else run_once
            for i, res in enumerate(pool.map(lambda arm: one(arm, ckpt), order)):
                c = counts[res.arm]
                c.runs += 1
                c.aborted += res.aborted
                if res.other_failure:
                    c.failed.append(res.other_failure)
                print(f"[{i + 1}/{len(order)}] {res.arm:<14} "
                      f"{'ABORT' if res.aborted else 'ok'} {res.statuses}",
                      file=sys.stderr, flush=True)
    return counts


def measure_forked(runs: int, arms: Sequence[str] = ARMS) -> dict[str, Counts]:
    """:func:`measure` through :func:`run_forked` (one run at a time)."""
    import shutil

    import torch.distributed  # noqa: F401 - imported once, before the ranks are forked

    counts = {arm: Counts() for arm in arms}
    tmp = tempfile.mkdtemp(prefix="ucp-teardown-")
    ckpt = os.path.join(tmp, "ckpt")
    subprocess.run([sys.executable, "-c", "import sys; from ucpformat.testing.teardown import "
                    "make_checkpoint; make_checkpoint(sys.argv[1])", ckpt], check=True)
    order = [arm for _ in range(runs) for arm in arms]
    for i, arm in enumerate(order):
        res = run_forked(arm, ckpt, tmp)
        c = counts[arm]
        c.runs += 1
        c.aborted += res.aborted
        if res.other_failure:
            c.failed.append(res.other_failure)
        print(f"[{i + 1}/{len(order)}] {arm:<14} {'ABORT' if res.aborted else 'ok'} "
              f"{res.statuses}", file=sys.stderr, flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per arm")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--arms", default=",".join(ARMS),
                        help=f"comma-separated arms (default: {','.join(ARMS)})")
    parser.add_argument("--torchrun", action="store_true",
                        help="start each run with torchrun itself")
    parser.add_argument("--fork", action="store_true",
                        help="fork the ranks from this process (torch imported once)")
    parser.add_argument("--worker", nargs=2, metavar=("ARM", "CKPT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return 0
    start = time.monotonic()
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; known: {list(ARMS)}")
    counts = (measure_forked(args.runs, arms) if args.fork
              else measure(args.runs, args.jobs, arms, torchrun=args.torchrun))
    doc: dict[str, Any] = {
        arm: {"runs": c.runs, "aborted": c.aborted, "other_failures": c.failed}
        for arm, c in counts.items()}
    for base, other in (("plain", "ucp"), ("plain+barrier", "ucp+barrier"),
                        ("ucp", "ucp+barrier"), ("plain", "plain+barrier")):
        if base not in counts or other not in counts:
            continue
        a, b = counts[base], counts[other]
        doc[f"p({base} vs {other})"] = fisher_exact(a.aborted, a.runs, b.aborted, b.runs)
    doc["seconds"] = round(time.monotonic() - start, 1)
    if args.json:
        print(json.dumps(doc))
    else:
        for key, value in doc.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
