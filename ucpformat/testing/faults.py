"""Crash consistency, measured: writers killed at every step of a save.

A :class:`FaultyStore` wraps a real store and kills its process with SIGKILL at the Nth
storage operation, either before the operation, half-way through a write (the first
half of the bytes reach storage: a torn write) or just after it. A dry run of the same
save records the sequence of operations, so trials can aim at each phase of a save:
``prepare`` (in-progress marker, un-commit, clearing), ``data`` (stored objects),
``metadata`` (node ``zarr.json`` files), ``manifest``, ``flush``, ``commit`` (the root
``zarr.json``) and ``cleanup`` (removing the marker). Other trials kill the writer with
SIGKILL after a random delay instead.

Each trial starts from a committed checkpoint A and runs a save of state B in a child
process, which is killed:

- ``new``: B goes to a fresh location, A lies elsewhere;
- ``overwrite``: B replaces A in place (``overwrite=True``);
- ``threads``: B is a collective save of two ranks (``ThreadGroup``) to a fresh location;
- ``gloo``: B is a collective save of two processes over ``torch.distributed`` (gloo), and
  only one rank is killed; the other must fail, not hang, and nothing is committed.

*Exchange* trials fail a rank instead of killing it: B replaces A in place
(``overwrite=True``), collectively over threads or gloo processes, with shards coarse
enough that owners receive cells from the other rank, and one rank's values become
unreadable after the plan is made (a :class:`FailingArray`: the Nth cell it reads for
the exchange raises, as a copy from a device or a read from a failing disk would). Every
rank must raise, naming the failure, within a time limit (no rank waits for the failed
one); the location must hold A exactly as before (nothing of it was touched: the
failure came before the un-commit), loadable bit for bit; and the save, retried, must
replace it.

Afterwards the harness checks that (1) A still loads bit for bit; (2) the interrupted
location either is refused by ``open`` and by ``validate`` with an error naming a
requirement (UCP-1.0-R051 for an uncommitted one), or - killed after its commit - loads B
bit for bit (or, for ``overwrite`` killed before the un-commit, A); never anything else;
(3) ``open`` and ``validate`` agree; (4) the same save, retried, succeeds and loads B bit
for bit. A *lost checkpoint* is a failure of (1) or (2).

Run ``python -m ucpformat.testing.faults --trials 300 --exchange-trials 40`` (``make
stress``, which adds gloo trials of both kinds); the test suite runs a quick mode.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ucpformat.checkpoint.options import SaveOptions
from ucpformat.checkpoint.reader import open_checkpoint
from ucpformat.checkpoint.validation import validate
from ucpformat.checkpoint.writer import save
from ucpformat.distributed import Fragment, TensorSpec, save_fragments
from ucpformat.distributed.comm import Communicator, run_threads
from ucpformat.distributed.pipeline import FragmentList
from ucpformat.distributed.rank_description import describe
from ucpformat.distributed.save_plan import plan_from_descriptions
from ucpformat.errors import CheckpointExistsError, UCPError
from ucpformat.format import dtypes, names
from ucpformat.store import LocalStore, Store
from ucpformat.testing.common import (
    SMALL_CHUNKING,
    differences,
    print_figures,
    small_state,
    tree_bytes,
)

# the store is its own module; these names stay importable from here (the tests use both)
from ucpformat.testing.fault_store import DiskFull as DiskFull
from ucpformat.testing.fault_store import FaultyStore as FaultyStore
from ucpformat.testing.fault_store import OpCounter as OpCounter
from ucpformat.testing.fault_store import phase_of as phase_of

MODES = ("before", "torn", "after")
PHASES = ("prepare", "data", "metadata", "manifest", "flush", "commit", "cleanup")
SCENARIOS = ("new", "overwrite", "threads")
_DATA_KEY = re.compile(r"(^|/)c(/[0-9]+)*$")


# -- what the trials save ------------------------------------------------------------------


def _arrays(
    tree: Mapping[str, Any], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    for key, value in tree.items():
        if isinstance(value, np.ndarray | np.generic):
            yield (*prefix, key), np.asarray(value)
        elif isinstance(value, Mapping):
            yield from _arrays(value, (*prefix, key))


@dataclass
class DistributedParts:
    """A state cut into the fragments of ``world_size`` ranks (rows split where possible)."""

    specs: list[TensorSpec]
    fragments: list[list[Fragment]]
    group_attributes: dict[str, dict[str, Any]]
    expected: dict[str, Any]


def distributed_parts(seed: int, world_size: int) -> DistributedParts:
    state = small_state(seed)
    specs: list[TensorSpec] = []
    fragments: list[list[Fragment]] = [[] for _ in range(world_size)]
    expected: dict[str, Any] = {}
    for logical, arr in _arrays(state):
        path = names.path_of(*logical)
        dt = dtypes.from_numpy(arr.dtype)
        specs.append(TensorSpec(path, tuple(arr.shape), dt.name))
        node = expected
        for part in logical[:-1]:
            node = node.setdefault(part, {})
        node[logical[-1]] = arr
        if arr.ndim and arr.shape[0] >= world_size:
            cuts = np.linspace(0, arr.shape[0], world_size + 1).astype(int)
            for r in range(world_size):
                a, b = int(cuts[r]), int(cuts[r + 1])
                box = ((a, b), *((0, n) for n in arr.shape[1:]))
                fragments[r].append(Fragment(path, box, np.ascontiguousarray(arr[a:b])))
        else:
            box = tuple((0, n) for n in arr.shape)
            fragments[0].append(Fragment(path, box, np.ascontiguousarray(arr)))
    group_attributes = {"training": {"values": {"step": seed}}}
    expected.setdefault("training", {})["step"] = seed
    expected.setdefault("optimizer", {})
    expected["optimizer"].setdefault("state", {})
    return DistributedParts(specs, fragments, group_attributes, expected)


def distributed_save(
    store: Store,
    comm: Communicator,
    parts: DistributedParts,
    *,
    overwrite: bool = False,
    min_shard_bytes: int = 1,
    fragments: Sequence[Fragment] | None = None,
) -> None:
    """The distributed save of the trials (``fragments``: this rank's, if not its parts)."""
    save_fragments(
        store,
        comm,
        specs=parts.specs,
        fragments=parts.fragments[comm.rank] if fragments is None else fragments,
        group_attributes=parts.group_attributes,
        overwrite=overwrite,
        min_shard_bytes=min_shard_bytes,
        workers=2,
        **SMALL_CHUNKING,
    )


# -- values that fail after planning (exchange trials) ----------------------------------------

#: Shards of the exchange trials: coarser than the two ranks' rows, so that owners receive
#: cells from the other rank (every split tensor is one shard, assembled by one owner).
EXCHANGE_MIN_SHARD_BYTES = 1 << 20


class InjectedFault(RuntimeError):
    """A failure the harness injects into a rank's values (not a bug)."""


class _Countdown:
    def __init__(self, reads: int) -> None:
        self.left = reads
        self._lock = threading.Lock()

    def read(self) -> None:
        with self._lock:
            if self.left <= 0:
                raise InjectedFault("injected: this rank's values became unreadable")
            self.left -= 1


class FailingArray(np.ndarray):  # type: ignore[type-arg]
    """An array whose values fail to be read: indexing raises :class:`InjectedFault` once
    its countdown (shared by every view and every array of one rank) is spent.

    Its shape and size are known, so planning works; reading fails, as a copy from a
    device or a read from a failing disk would. Every cell a rank extracts is one read.
    """

    countdown: _Countdown | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self.countdown = getattr(obj, "countdown", None)

    def __getitem__(self, key: Any) -> Any:
        if self.countdown is not None:
            self.countdown.read()
        return np.asarray(self)[key]


def failing_fragments(fragments: Sequence[Fragment], reads: int) -> list[Fragment]:
    """The same fragments, whose values raise :class:`InjectedFault` at the read after
    the first ``reads`` (counted over all of them)."""
    countdown = _Countdown(reads)
    out = []
    for frag in fragments:
        data = frag.data.view(FailingArray)
        data.countdown = countdown
        out.append(Fragment(frag.path, frag.box, data))
    return out


def exchange_sends(seed: int, rank: int) -> int:
    """How many cells ``rank`` sends in the exchange trials' save: the planner's answer."""
    parts = distributed_parts(seed, 2)
    options = SaveOptions(None, SMALL_CHUNKING["chunk_bytes"], SMALL_CHUNKING["shard_bytes"],
                          EXCHANGE_MIN_SHARD_BYTES)
    descriptions = [describe(parts.specs, FragmentList(frags).boxes(), parts.group_attributes)
                    for frags in parts.fragments]
    return len(plan_from_descriptions(descriptions, options).tasks(rank).sends)


def exchange_save(
    store: Store, comm: Communicator, parts: DistributedParts, *, victim: int, reads: int
) -> None:
    """The exchange trials' save, replacing a checkpoint; ``victim``'s values fail after
    ``reads`` reads (never, if negative)."""
    frags = parts.fragments[comm.rank]
    if comm.rank == victim and reads >= 0:
        frags = failing_fragments(frags, reads)
    distributed_save(store, comm, parts, overwrite=True,
                     min_shard_bytes=EXCHANGE_MIN_SHARD_BYTES, fragments=frags)


def expected_state(scenario: str, seed: int) -> Any:
    if scenario in ("threads", "gloo"):
        return distributed_parts(seed, 2).expected
    return small_state(seed)


def run_save(scenario: str, store: Store, seed: int, *, durable: bool) -> None:
    """The save a trial interrupts (in the child) and retries (in the parent)."""
    if scenario in ("new", "overwrite"):
        save(
            store,
            small_state(seed),
            overwrite=scenario == "overwrite",
            workers=2,
            durable=durable,
            compression="zstd" if seed % 2 else None,
            hash_algorithm="sha256" if seed % 3 == 0 else None,
            **SMALL_CHUNKING,
        )
    elif scenario == "threads":
        parts = distributed_parts(seed, 2)
        run_threads(2, lambda comm: distributed_save(store, comm, parts))
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


# -- one trial -------------------------------------------------------------------------------


@dataclass
class Trial:
    scenario: str
    kind: str  # "op" (kill at an operation), "time" (SIGKILL after a delay) or "raise"
    phase: str
    mode: str
    kill_at: int | None = None
    delay: float = 0.0  # seconds slept before each storage operation
    kill_after: float = 0.0  # "time" trials: SIGKILL this many seconds after the start
    victim: int = 0
    fail_reads: int = -1  # "raise" trials: the victim's values fail after this many reads
    cli: bool = False  # also check with ``ucp validate`` in a subprocess
    # outcome
    killed: bool = False
    outcome: str = ""  # refused | committed | old-intact | (failure kinds)
    problems: list[str] = field(default_factory=list)
    lost: bool = False
    retried: bool = False


def _check_refusal(location: str) -> tuple[str | None, str]:
    """(rule, message) of open's refusal, or (None, '') if it opened."""
    try:
        with open_checkpoint(location):
            return None, ""
    except UCPError as exc:
        return exc.rule or "", str(exc)


def check_after_crash(
    trial: Trial, target: Path, previous: Path | None, seed_a: int, seed_b: int
) -> None:
    """Every check of a trial but the retry; fills ``trial.outcome``/``problems``/``lost``."""
    state_a = small_state(seed_a)
    if previous is not None:
        diffs = _diffs(previous, state_a)
        if diffs:
            trial.lost = True
            trial.problems.append(f"the previous checkpoint changed: {diffs[:3]}")
    new = expected_state(trial.scenario, seed_b)
    rule, message = _check_refusal(str(target))
    report = validate(target)
    if rule is None:
        got_new = _diffs(target, new) == []
        got_old = trial.scenario == "overwrite" and _diffs(target, state_a) == []
        trial.outcome = "committed" if got_new else "old-intact" if got_old else "WRONG-DATA"
        if trial.outcome == "WRONG-DATA":
            trial.lost = True
            trial.problems.append("the interrupted location opens with data that is neither "
                                  "the old nor the new state")
        if not report.valid:
            trial.problems.append(f"open accepts it but validate refuses: {report.errors[:2]}")
    else:
        trial.outcome = "refused"
        if not rule:
            trial.problems.append(f"refused without a requirement id: {message}")
        if "UCP-1.0-R051" not in rule:
            trial.problems.append(f"refused, but not as an incomplete checkpoint: {message}")
        if report.valid:
            trial.problems.append("open refuses it but validate finds it valid")
        elif "UCP-1.0-R051" not in report.rules():
            trial.problems.append(f"validate refuses it without UCP-1.0-R051: {report.errors[:2]}")


def cli_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ucpformat.cli") is not None


def check_cli(trial: Trial, target: Path) -> None:
    """``ucp validate`` (when the CLI exists) agrees: exit 0 for a committed checkpoint,
    1 (invalid, naming UCP-1.0-R051) or 2 (nothing there) for an interrupted one."""
    proc = subprocess.run(
        [sys.executable, "-m", "ucpformat.cli", "validate", "--json", str(target)],
        capture_output=True, text=True, timeout=120,
    )
    if trial.outcome == "refused":
        if proc.returncode == 1 and "UCP-1.0-R051" not in proc.stdout:
            trial.problems.append(f"ucp validate refuses without UCP-1.0-R051: {proc.stdout[:200]}")
        elif proc.returncode not in (1, 2):
            trial.problems.append(f"ucp validate exits {proc.returncode} on an interrupted save")
    elif proc.returncode != 0:
        trial.problems.append(f"ucp validate exits {proc.returncode} on a committed checkpoint")


def _diffs(location: Path, expected: Any) -> list[str]:
    try:
        with open_checkpoint(location) as ckpt:
            return differences(ckpt.to_dict(), expected)
    except UCPError as exc:
        return [f"refused: {exc}"]


def retry_and_check(trial: Trial, target: Path, seed_b: int, *, durable: bool) -> None:
    """The interrupted save, run again to completion, must succeed and load bit for bit.

    A save killed after its commit needs no retry; then the same call must refuse to
    overwrite the committed checkpoint (UCP-1.0-R053), which the harness checks too.
    """
    committed = trial.outcome == "committed"
    trial.retried = not committed
    try:
        if trial.scenario == "gloo":
            run_threads(
                2,
                lambda comm: distributed_save(
                    LocalStore(target), comm, distributed_parts(seed_b, 2)
                ),
            )
        else:
            run_save(trial.scenario, LocalStore(target, durable=durable), seed_b, durable=durable)
    except CheckpointExistsError as exc:
        if not committed:
            trial.problems.append(f"the retried save failed: {exc}")
    except UCPError as exc:
        if not (committed and "UCP-1.0-R053" in str(exc)):
            trial.problems.append(f"the retried save failed: {exc}")
    else:
        if committed and trial.scenario != "overwrite":
            trial.problems.append(
                "a save onto a committed checkpoint did not refuse (UCP-1.0-R053)")
    diffs = _diffs(target, expected_state(trial.scenario, seed_b))
    if diffs:
        trial.problems.append(f"the retried save does not load back: {diffs[:3]}")
    report = validate(target, deep=True)
    if not report.valid:
        trial.problems.append(f"the retried save is invalid: {report.errors[:2]}")


def run_fork_trial(
    trial: Trial, workdir: Path, previous: Path, seed_a: int, seed_b: int, *, durable: bool
) -> None:
    """Run one trial whose writer is a forked child of this process."""
    target = workdir / f"target-{uuid.uuid4().hex[:8]}"
    if trial.scenario == "overwrite":
        shutil.copytree(previous, target)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the writer
        code = 0
        try:
            store = FaultyStore(
                LocalStore(target, durable=durable),
                kill_at=trial.kill_at if trial.kind == "op" else None,
                mode=trial.mode,
                delay=trial.delay,
            )
            run_save(trial.scenario, store, seed_b, durable=durable)
        except BaseException:
            code = 3
        os._exit(code)
    if trial.kind == "time":
        time.sleep(trial.kill_after)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    trial.killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0:
        trial.problems.append(f"the writer failed by itself (exit {os.WEXITSTATUS(status)})")
    check_after_crash(trial, target, previous, seed_a, seed_b)
    if trial.cli:
        check_cli(trial, target)
    retry_and_check(trial, target, seed_b, durable=durable)
    shutil.rmtree(target, ignore_errors=True)


# -- torch.distributed (gloo) trials ---------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_worker(args: argparse.Namespace) -> int:
    """One rank of a gloo trial (run as ``python -m ucpformat.testing.faults --worker``)."""
    import datetime

    import torch.distributed as dist

    from ucpformat.testing.gloo import communicator

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    comm = communicator()
    store: Store = LocalStore(args.target, durable=args.durable)
    raising = args.fail_reads >= 0
    if args.rank == args.victim and not raising:
        store = FaultyStore(store, kill_at=args.kill_at, mode=args.mode)
    code = 0
    try:
        if raising:
            exchange_save(store, comm, distributed_parts(args.seed, 2), victim=args.victim,
                          reads=args.fail_reads)
        else:
            distributed_save(store, comm, distributed_parts(args.seed, 2))
        comm.barrier()
    except BaseException as exc:  # the survivor of a killed rank ends up here, and both
        # ranks of a raise trial
        print(f"rank {args.rank}: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
        code = 3
    sys.stdout.flush()
    os._exit(code)  # never run gloo's shutdown (see DESIGN.md: aborts at exit)


def gloo_ops(seed: int) -> list[list[tuple[str, str]]]:
    """Per-rank operation traces of the gloo trials' save (dry run with threads)."""
    traces: list[list[tuple[str, str]]] = [[], []]
    parts = distributed_parts(seed, 2)
    with tempfile.TemporaryDirectory() as tmp:
        run_threads(
            2,
            lambda comm: distributed_save(
                FaultyStore(LocalStore(Path(tmp) / "dry", durable=False), trace=traces[comm.rank]),
                comm,
                parts,
            ),
        )
    return traces


def run_gloo_trial(
    trial: Trial, workdir: Path, previous: Path, seed_a: int, seed_b: int, *, durable: bool,
    timeout: float = 60.0,
) -> None:
    target = workdir / f"gloo-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable, "-m", "ucpformat.testing.faults", "--worker",
                "--rank", str(r), "--port", str(port), "--target", str(target),
                "--victim", str(trial.victim), "--kill-at", str(trial.kill_at),
                "--mode", trial.mode, "--seed", str(seed_b),
                *(["--durable"] if durable else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    for r, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            trial.problems.append(f"rank {r} hung after rank {trial.victim} was killed")
        outputs.append(out.decode(errors="replace"))
    victim = procs[trial.victim]
    trial.killed = victim.returncode == -signal.SIGKILL
    if not trial.killed:
        trial.problems.append(f"rank {trial.victim} was not killed: {outputs[trial.victim][-300:]}")
    check_after_crash(trial, target, previous, seed_a, seed_b)
    retry_and_check(trial, target, seed_b, durable=durable)
    shutil.rmtree(target, ignore_errors=True)


# -- exchange trials: a rank fails mid-exchange --------------------------------------------


def _threads_raising(
    trial: Trial, target: Path, seed_b: int, timeout: float
) -> list[str | None] | None:
    """Each rank's error (None: it did not raise) of a two-thread exchange trial; None if
    a rank waited ``timeout`` seconds in a collective for the other."""
    errors: list[str | None] = [None, None]
    parts = distributed_parts(seed_b, 2)
    hung = False

    def rank_main(comm: Communicator) -> None:
        nonlocal hung
        try:  # caught here, so that run_threads never breaks a barrier for the others
            exchange_save(LocalStore(target), comm, parts, victim=trial.victim,
                          reads=trial.fail_reads)
        except threading.BrokenBarrierError:  # the time limit
            hung = True
        except BaseException as exc:
            errors[comm.rank] = f"{type(exc).__name__}: {exc}"

    run_threads(2, rank_main, timeout=timeout)
    return None if hung else errors


def _gloo_raising(
    trial: Trial, target: Path, seed_b: int, timeout: float
) -> list[str | None] | None:
    """The same over two gloo processes (``--worker --fail-reads``)."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ucpformat.testing.faults", "--worker", "--rank", str(r),
             "--port", str(port), "--target", str(target), "--victim", str(trial.victim),
             "--fail-reads", str(trial.fail_reads), "--seed", str(seed_b)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        )
        for r in range(2)
    ]
    deadline = time.monotonic() + timeout
    errors: list[str | None] = []
    hung = False
    for r, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            hung = True
        text = out.decode(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith(f"rank {r}: ")]
        if proc.returncode == 3 and lines:
            errors.append(lines[-1][len(f"rank {r}: "):])
        elif proc.returncode == 0:
            errors.append(None)
        else:
            errors.append(f"exit {proc.returncode}: {text[-300:]}")
    return None if hung else errors


def run_raise_trial(
    trial: Trial, workdir: Path, previous: Path, seed_a: int, seed_b: int, *,
    timeout: float = 60.0,
) -> list[str | None] | None:
    """Run one exchange trial in place of a copy of ``previous``; returns each rank's
    error (None if it did not raise; None for all if a rank hung)."""
    target = workdir / f"raise-{uuid.uuid4().hex[:8]}"
    shutil.copytree(previous, target)
    before = tree_bytes(target)
    run = _threads_raising if trial.scenario == "threads" else _gloo_raising
    errors = run(trial, target, seed_b, timeout)
    if errors is None:
        trial.problems.append(f"a rank hung after rank {trial.victim} failed")
    else:
        for r, error in enumerate(errors):
            if error is None:
                trial.problems.append(f"rank {r} did not raise")
            elif "injected" not in error:
                trial.problems.append(f"rank {r} raised without naming the failure: {error}")
    diffs = _diffs(target, small_state(seed_a))
    trial.outcome = "old-intact" if not diffs else "refused" if diffs[0].startswith(
        "refused") else "WRONG-DATA"
    if diffs:
        trial.lost = True
        trial.problems.append(f"the checkpoint being replaced changed: {diffs[:3]}")
    elif tree_bytes(target) != before:
        trial.problems.append("the location of the checkpoint being replaced changed (a "
                              "file was added, removed or modified)")
    report = validate(target)
    if not report.valid:
        trial.problems.append(f"the intact checkpoint does not validate: {report.errors[:2]}")
    # the same save, retried without the fault, replaces it
    parts = distributed_parts(seed_b, 2)
    try:
        run_threads(2, lambda comm: exchange_save(LocalStore(target), comm, parts,
                                                  victim=trial.victim, reads=-1))
    except UCPError as exc:
        trial.problems.append(f"the retried save failed: {exc}")
    diffs = _diffs(target, parts.expected)
    if diffs:
        trial.problems.append(f"the retried save does not load back: {diffs[:3]}")
    trial.retried = True
    shutil.rmtree(target, ignore_errors=True)
    return errors


def plan_raise_trials(n: int, rng: random.Random, seed_b: int, scenario: str) -> list[Trial]:
    """``n`` exchange trials: each rank in turn fails at its first cell, at its last, then
    at random ones."""
    sends = [exchange_sends(seed_b, victim) for victim in range(2)]
    trials = []
    for k in range(n):
        victim = k % 2
        visit = k // 2
        last = sends[victim] - 1
        reads = 0 if visit == 0 else last if visit == 1 else rng.randint(0, last)
        trials.append(Trial(scenario, "raise", "exchange", "raise", victim=victim,
                            fail_reads=reads))
    return trials


# -- planning and running trials -------------------------------------------------------------


def dry_run(
    scenario: str, seed_a: int, seed_b: int, workdir: Path
) -> tuple[list[tuple[str, str]], float]:
    """The operations of one scenario's save, and how long it takes."""
    trace: list[tuple[str, str]] = []
    target = workdir / f"dry-{scenario}"
    if scenario == "overwrite":
        save(target, small_state(seed_a), **SMALL_CHUNKING)
    start = time.perf_counter()
    run_save(scenario, FaultyStore(LocalStore(target, durable=False), trace=trace), seed_b,
             durable=False)
    elapsed = time.perf_counter() - start
    shutil.rmtree(target, ignore_errors=True)
    return trace, elapsed


def plan_trials(
    n: int,
    rng: random.Random,
    traces: Mapping[str, tuple[list[tuple[str, str]], float]],
    *,
    time_share: float,
    delay: float = 0.002,
) -> list[Trial]:
    """``n`` trials: every phase of every scenario in turn, a share of random-time kills."""
    by_phase: dict[tuple[str, str], list[int]] = {}
    for scenario, (ops, _) in traces.items():
        for i in range(len(ops)):
            by_phase.setdefault((scenario, phase_of(ops, i)), []).append(i)
    cells = sorted(by_phase)
    trials = []
    n_time = round(n * time_share)
    for k in range(n - n_time):
        scenario, phase = cells[k % len(cells)]
        where = by_phase[(scenario, phase)]
        visit = k // len(cells)
        # the first and the last operation of each phase first, then random ones
        index = where[0] if visit == 0 else where[-1] if visit == 1 else rng.choice(where)
        trials.append(
            Trial(scenario, "op", phase, MODES[(visit + k) % len(MODES)], kill_at=index)
        )
    for k in range(n_time):
        scenario = SCENARIOS[k % len(SCENARIOS)]
        ops, elapsed = traces[scenario]
        # the child sleeps ``delay`` before each operation; kill anywhere in the save
        total = elapsed + len(ops) * delay + 0.3  # + start-up of the forked writer
        trials.append(Trial(scenario, "time", "random", "before", delay=delay,
                            kill_after=rng.uniform(0.0, 1.1 * total)))
    rng.shuffle(trials)
    return trials


def plan_gloo_trials(n: int, rng: random.Random, seed_b: int) -> list[Trial]:
    traces = gloo_ops(seed_b)
    cells = [
        (victim, phase, i)
        for victim, ops in enumerate(traces)
        for i in range(len(ops))
        for phase in [phase_of(ops, i)]
    ]
    phases = sorted({(v, p) for v, p, _ in cells})
    trials = []
    for k in range(n):
        victim, phase = phases[k % len(phases)]
        index = rng.choice([i for v, p, i in cells if v == victim and p == phase])
        trials.append(Trial("gloo", "op", phase, MODES[(k // len(phases)) % len(MODES)],
                            kill_at=index, victim=victim))
    return trials


@dataclass
class Figures:
    trials: int = 0
    killed: int = 0
    lost: int = 0
    problems: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, trial: Trial) -> None:
        self.trials += 1
        self.killed += trial.killed
        self.lost += trial.lost
        self.outcomes[trial.outcome] += 1
        self.phases[f"{trial.scenario}/{trial.phase}"] += 1
        if trial.problems:
            self.problems += 1
            self.failures.append(
                f"{trial.scenario} {trial.kind} phase={trial.phase} mode={trial.mode} "
                f"kill_at={trial.kill_at} victim={trial.victim}: {'; '.join(trial.problems)}"
            )

    def as_dict(self) -> dict[str, Any]:
        return {
            "trials": self.trials,
            "writers killed": self.killed,
            "checkpoints lost": self.lost,
            "trials with any failed check": self.problems,
            "outcomes": dict(sorted(self.outcomes.items())),
            "trials per scenario/phase": dict(sorted(self.phases.items())),
        }


def run(
    trials: int,
    *,
    gloo_trials: int = 0,
    exchange_trials: int = 0,
    gloo_exchange_trials: int = 0,
    cli_every: int = 0,
    seed: int = 0,
    durable: bool = False,
    workdir: Path | None = None,
    time_share: float = 0.2,
    progress: bool = False,
) -> Figures:
    """Run the trials; ``durable`` makes every write fsync'd (slower, same outcomes)."""
    rng = random.Random(seed)
    seed_a, seed_b = 2 * seed + 1, 2 * seed + 2
    figures = Figures()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        root = Path(tmp)
        previous = root / "previous"
        save(previous, small_state(seed_a), **SMALL_CHUNKING)
        traces = {s: dry_run(s, seed_a, seed_b, root) for s in SCENARIOS}
        plan = plan_trials(trials, rng, traces, time_share=time_share)
        if gloo_trials:
            plan += plan_gloo_trials(gloo_trials, rng, seed_b)
        plan += plan_raise_trials(exchange_trials, rng, seed_b, "threads")
        plan += plan_raise_trials(gloo_exchange_trials, rng, seed_b, "gloo")
        use_cli = cli_every > 0 and cli_available()
        for i, trial in enumerate(plan):
            trial.cli = use_cli and i % cli_every == 0
            if trial.kind == "raise":
                run_raise_trial(trial, root, previous, seed_a, seed_b)
            elif trial.scenario == "gloo":
                run_gloo_trial(trial, root, previous, seed_a, seed_b, durable=durable)
            else:
                run_fork_trial(trial, root, previous, seed_a, seed_b, durable=durable)
            figures.add(trial)
            if progress and (i + 1) % 25 == 0:
                print(f"  {i + 1}/{len(plan)} trials, {figures.lost} lost", flush=True)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.faults",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=300, help="single-process trials")
    parser.add_argument("--gloo-trials", type=int, default=0,
                        help="trials of a two-process torch.distributed (gloo) save")
    parser.add_argument("--exchange-trials", type=int, default=0,
                        help="trials of a two-thread save in which one rank fails mid-exchange")
    parser.add_argument("--gloo-exchange-trials", type=int, default=0,
                        help="the same with two gloo processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cli-every", type=int, default=10,
                        help="check every Nth trial with `ucp validate` too, where the CLI "
                        "exists (0: never)")
    parser.add_argument("--durable", action="store_true", help="fsync every write")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    # worker mode (internal)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--target", default="", help=argparse.SUPPRESS)
    parser.add_argument("--victim", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="before", help=argparse.SUPPRESS)
    parser.add_argument("--fail-reads", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return gloo_worker(args)
    start = time.perf_counter()
    figures = run(args.trials, gloo_trials=args.gloo_trials,
                  exchange_trials=args.exchange_trials,
                  gloo_exchange_trials=args.gloo_exchange_trials, seed=args.seed,
                  cli_every=args.cli_every, durable=args.durable, progress=not args.json)
    out = figures.as_dict()
    out["seconds"] = round(time.perf_counter() - start, 1)
    print_figures("crash consistency (ucpformat.testing.faults)", out, as_json=args.json)
    for line in figures.failures[:20]:
        print("FAILED:", line)
    return 0 if figures.lost == 0 and figures.problems == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
