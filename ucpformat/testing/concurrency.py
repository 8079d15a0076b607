"""Concurrent writers, measured: two saves into one location at the same time.

Each trial starts two writers, each saving its own state into the same location, the
second after a random delay within the length of a save, through stores slowed down so
that the saves overlap: in two processes (``proc``) or two threads of one process
(``thread``) on a local file system, or two threads against a local S3 server (``s3``,
moto); with ``overwrite=False`` or ``True``; into a fresh location or onto a committed
checkpoint (``old``). Afterwards:

- what each writer returned: *saved*, or *refused* (an error naming UCP-1.0-R059, another
  writer, or UCP-1.0-R053, a committed checkpoint);
- what the location holds: exactly the state of the writer that returned "saved" last,
  the old checkpoint, or nothing a reader accepts (UCP-1.0-R051) — anything else that opens is a
  *mixed* checkpoint (some of one writer's objects, some of the other's), and a location
  that does not hold what its last "saved" writer wrote is *wrong*. Both must be zero;
- and that a later save into the location (``overwrite=True``) succeeds.

Run ``python -m ucpformat.testing.concurrency --trials 100`` (``make stress``); the test
suite runs a quick mode.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucpformat.errors import UCPError
from ucpformat.reader import open_checkpoint
from ucpformat.storage import LocalStore, Store
from ucpformat.testing.common import SMALL_CHUNKING, differences, print_figures, small_state
from ucpformat.testing.faults import FaultyStore
from ucpformat.writer import save

MODES = ("proc", "thread", "s3")
#: Seconds slept before each storage operation: a save of the small state takes ~0.1 s.
DELAY = 0.002


@dataclass
class Trial:
    mode: str
    overwrite: bool
    old: bool
    offset: float
    results: list[tuple[str, float, str]] = field(default_factory=list)  # (outcome, end, why)
    holds: str = ""  # writer-0 | writer-1 | old | nothing | MIXED | WRONG
    problems: list[str] = field(default_factory=list)


def _save_one(make_store: Callable[[], Store], seed: int, overwrite: bool, start: float
              ) -> tuple[str, float, str]:
    """One writer: wait for ``start``, save; (outcome, when it returned, the error)."""
    store = make_store()
    time.sleep(max(0.0, start - time.time()))
    try:
        save(store, small_state(seed), overwrite=overwrite, workers=2, **SMALL_CHUNKING)
    except UCPError as exc:
        return "refused", time.time(), f"{exc.rule or ''} {type(exc).__name__}: {exc}"
    except Exception as exc:  # a failure of the library: reported as a problem
        return "crashed", time.time(), f"{type(exc).__name__}: {exc}"
    return "saved", time.time(), ""


def _in_processes(make_store: Callable[[], Store], seeds: Sequence[int], overwrite: bool,
                  starts: Sequence[float]) -> list[tuple[str, float, str]]:
    pipes, pids = [], []
    for seed, start in zip(seeds, starts, strict=True):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer
            code = 0
            try:
                os.close(read)
                result = _save_one(make_store, seed, overwrite, start)
                os.write(write, json.dumps(result).encode())
            except BaseException:
                code = 3
            finally:
                os._exit(code)
        os.close(write)
        pipes.append(read)
        pids.append(pid)
    results = []
    for read, pid in zip(pipes, pids, strict=True):
        with os.fdopen(read, "rb") as f:
            raw = f.read()
        os.waitpid(pid, 0)
        out: list[Any] = json.loads(raw) if raw else ["crashed", time.time(), "it died"]
        results.append((str(out[0]), float(out[1]), str(out[2])))
    return results


def _in_threads(make_store: Callable[[], Store], seeds: Sequence[int], overwrite: bool,
                starts: Sequence[float]) -> list[tuple[str, float, str]]:
    results: list[tuple[str, float, str]] = [("crashed", 0.0, "")] * len(seeds)

    def one(i: int) -> None:
        results[i] = _save_one(make_store, seeds[i], overwrite, starts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def run_trial(trial: Trial, make_inner: Callable[[], Store], rng: random.Random,
              save_seconds: float) -> None:
    """Run the two writers of ``trial`` on the stores ``make_inner`` gives, and judge."""
    seeds = [rng.randrange(10**6) for _ in range(2)]
    old_seed = rng.randrange(10**6)
    if trial.old:
        save(make_inner(), small_state(old_seed), **SMALL_CHUNKING)
    t0 = time.time() + 0.2  # time for both writers to start (fork, imports are done)
    starts = [t0, t0 + trial.offset * save_seconds]

    def make_store() -> Store:
        return FaultyStore(make_inner(), delay=DELAY)

    if trial.mode == "proc":
        trial.results = _in_processes(make_store, seeds, trial.overwrite, starts)
    else:
        trial.results = _in_threads(make_store, seeds, trial.overwrite, starts)
    for outcome, _, why in trial.results:
        if outcome == "crashed":
            trial.problems.append(f"a writer failed with a non-UCP error: {why}")
        elif outcome == "refused" and "UCP-1.0-R059" not in why and "UCP-1.0-R053" not in why:
            trial.problems.append(f"a writer was refused for another reason: {why[:300]}")
    states = {"writer-0": small_state(seeds[0]), "writer-1": small_state(seeds[1])}
    if trial.old:
        states["old"] = small_state(old_seed)
    try:
        with open_checkpoint(make_inner()) as ckpt:
            found = ckpt.to_dict()
    except UCPError:
        trial.holds = "nothing"
    else:
        same = [name for name, state in states.items() if not differences(found, state)]
        trial.holds = same[0] if same else "MIXED"
    saved = [(end, i) for i, (outcome, end, _) in enumerate(trial.results) if outcome == "saved"]
    if trial.holds == "MIXED":
        trial.problems.append("the location holds a mixed checkpoint")
    elif saved and trial.holds != f"writer-{max(saved)[1]}":
        trial.problems.append(f"writer {max(saved)[1]} said saved last, but the location "
                              f"holds {trial.holds}")
        trial.holds = "WRONG"
    elif not saved and trial.holds not in ("old", "nothing"):
        trial.problems.append(f"no writer said saved, but the location holds {trial.holds}")
        trial.holds = "WRONG"
    try:  # and a later save can always write there (UCP-1.0-R049)
        save(make_inner(), small_state(seeds[0] + 1), overwrite=True, **SMALL_CHUNKING)
    except UCPError as exc:
        trial.problems.append(f"the location cannot be saved into any more: {exc}")


@dataclass
class Figures:
    trials: Counter[str] = field(default_factory=Counter)
    writers: Counter[str] = field(default_factory=Counter)
    holds: Counter[str] = field(default_factory=Counter)
    by_scenario: dict[str, Counter[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, trial: Trial) -> None:
        onto = " onto a checkpoint" if trial.old else ""
        label = f"{trial.mode} overwrite={trial.overwrite}{onto}"
        self.trials[label] += 1
        for outcome, _, _ in trial.results:
            self.writers[outcome] += 1
        self.holds[trial.holds] += 1
        saved = sum(outcome == "saved" for outcome, _, _ in trial.results)
        self.by_scenario.setdefault(label, Counter())[f"{saved} saved, holds {trial.holds}"] += 1
        if trial.problems:
            self.failures.append(f"{label} offset={trial.offset:.2f}: "
                                 f"{'; '.join(trial.problems)}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "trials": sum(self.trials.values()),
            "mixed checkpoints": self.holds["MIXED"],
            "wrong (not what the last 'saved' writer wrote)": self.holds["WRONG"],
            "trials with any failed check": len(self.failures),
            "writers (saved / refused / crashed)": (
                f"{self.writers['saved']} / {self.writers['refused']} / "
                f"{self.writers['crashed']}"
            ),
            "the location holds": dict(sorted(self.holds.items())),
            "per scenario (writers saved, what the location holds)": {
                k: dict(sorted(v.items())) for k, v in sorted(self.by_scenario.items())},
        }


def _local_duration(root: Path) -> float:
    start = time.perf_counter()
    save(FaultyStore(LocalStore(root / "timing"), delay=DELAY), small_state(0),
         workers=2, **SMALL_CHUNKING)
    return time.perf_counter() - start


def run(trials: int, *, seed: int = 0, modes: Sequence[str] = ("proc", "thread"),
        progress: bool = False, s3_options: dict[str, Any] | None = None) -> Figures:
    """``trials`` trials, spread over ``modes`` and the overwrite/old scenarios (``s3``:
    against the server of ``s3_options``, or a local one started for the run)."""
    rng = random.Random(seed)
    figures = Figures()
    scenarios = [(m, ow, old) for m in modes for ow in (False, True)
                 for old in ((False, True) if ow else (False,))]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        duration = _local_duration(root)
        s3: Any = None
        options = s3_options or {}
        if "s3" in modes and s3_options is None:
            from ucpformat.testing.s3 import s3_server

            s3 = s3_server()
            options = s3.__enter__()
        try:
            for i in range(trials):
                mode, overwrite, old = scenarios[i % len(scenarios)]
                trial = Trial(mode, overwrite, old, rng.uniform(0.0, 1.0))
                if mode == "s3":
                    from ucpformat.storage_fsspec import FsspecStore
                    from ucpformat.testing.s3 import BUCKET

                    url = f"s3://{BUCKET}/concurrency-{seed}-{i}"

                    def inner(url: str = url) -> Store:
                        return FsspecStore(url, storage_options=options)

                    run_trial(trial, inner, rng, 3 * duration)
                else:
                    location = root / f"t{i}"

                    def inner_local(location: Path = location) -> Store:
                        return LocalStore(location, durable=False)

                    run_trial(trial, inner_local, rng, duration)
                figures.add(trial)
                if progress and (i + 1) % 20 == 0:
                    print(f"  {i + 1}/{trials} trials, {len(figures.failures)} failed",
                          flush=True)
        finally:
            if s3 is not None:
                s3.__exit__(None, None, None)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.concurrency",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="*", default=["proc", "thread", "s3"], choices=MODES)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    figures = run(args.trials, seed=args.seed, modes=args.modes, progress=not args.json)
    out = figures.as_dict()
    out["seconds"] = round(time.perf_counter() - start, 1)
    print_figures("concurrent writers (ucpformat.testing.concurrency)", out, as_json=args.json)
    for line in figures.failures[:20]:
        print("FAILED:", line)
    return 0 if not figures.failures else 1


if __name__ == "__main__":
    sys.exit(main())
