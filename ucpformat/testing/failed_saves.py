"""Failed saves, measured: what a save that cannot finish leaves behind.

A failed save must never take the previous checkpoint with it unless its error says so,
must remove what it wrote, and must leave a location that a retry can save into
(UCP-1.0-R049). Kinds:

- ``stray``: a committed checkpoint holds a file whose name no checkpoint file has (the
  writer cannot address it with a key: ``zarr.json~``, ``notes (1).txt``, ``café.txt``,
  ...), at its root or in a node's directory; it is saved over with ``overwrite=True``.
  The save must be refused before it changes anything; once the stray file is removed,
  the same save must succeed. ``s3-stray`` does the same on an object store, with keys
  such as ``model/../x`` (a local S3 server, moto);
- ``disk-full``: the disk fills up at a random write of a save (every write after it
  fails with ENOSPC, deletions still work), onto a committed checkpoint with
  ``overwrite=True`` or into a fresh location. The error must say whether the previous
  checkpoint is gone (it is gone exactly when the save had un-committed it), no file of
  the failed save may remain, and once the disk has room again the retry must succeed;
- ``manager-disk-full``: a :class:`~ucpformat.checkpoint.manager.CheckpointManager` whose disk is
  full for one to three consecutive steps: each failed step must leave no partial
  location, every committed checkpoint must stay, and the first step after the disk has
  room again must save and rotate as usual.

Outcomes: *refused* (stray) or *failed* (disk full) as required, *saved*; and the figures
that must be zero: *lost* (the previous checkpoint gone without the error saying so, or
a committed one deleted by the manager), *wrong message*, *leftovers* (files of a failed
save still there), *stuck* (the retry failed).

Run ``python -m ucpformat.testing.failed_saves --trials 100`` (``make stress``); the test
suite runs a quick mode.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucpformat.checkpoint.manager import CheckpointManager, CheckpointWarning
from ucpformat.checkpoint.metadata import ZARR_JSON
from ucpformat.checkpoint.writer import save
from ucpformat.errors import UCPError
from ucpformat.store import LocalStore, Store
from ucpformat.testing.common import SMALL_CHUNKING, print_figures, same_state, small_state
from ucpformat.testing.faults import DiskFull, FaultyStore

KINDS = ("stray", "disk-full", "manager-disk-full", "s3-stray")
#: Names that no checkpoint file has (refused by the key check, UCP-1.0-R091).
STRAY_NAMES = ("zarr.json~", "notes (1).txt", "café.txt", "#zarr.json#", ".~lock.x#",
               "a b", "x:y", "tab\there", "Ω", "emoji-\U0001f600")
#: The same on an object store, where any byte string is a key.
S3_STRAY_KEYS = ("model/../x", "..", "a//b", "./zarr.json", "notes (1).txt", "café.txt")


@dataclass
class Trial:
    kind: str
    outcome: str = ""  # refused | failed | saved
    lost: bool = False
    wrong_message: bool = False
    leftovers: int = 0
    stuck: bool = False
    problems: list[str] = field(default_factory=list)


def _files(location: Path) -> list[str]:
    return sorted(p.relative_to(location).as_posix() for p in location.rglob("*")
                  if not p.is_dir())


def stray_trial(root: Path, rng: random.Random) -> Trial:
    trial = Trial("stray")
    location = root / "ckpt"
    old, new = small_state(rng.randrange(1000)), small_state(rng.randrange(1000))
    save(location, old, durable=False, **SMALL_CHUNKING)
    directory = rng.choice([location, *sorted(p for p in location.rglob("*") if p.is_dir())])
    stray = directory / rng.choice(STRAY_NAMES)
    stray.write_bytes(b"someone else's file\n")
    try:
        save(location, new, overwrite=True, durable=False, **SMALL_CHUNKING)
        trial.outcome = "saved"
        trial.problems.append("a save that would have to delete a stray file went ahead")
    except UCPError as exc:
        trial.outcome = "refused"
        key = stray.relative_to(location).as_posix()
        if exc.rule != "UCP-1.0-R049" or repr(key) not in str(exc):
            trial.wrong_message = True
            trial.problems.append(f"refused without naming the file and UCP-1.0-R049: {exc}")
    if not same_state(location, old):
        trial.lost = True
        trial.problems.append("the previous checkpoint is lost")
    if not stray.exists():
        trial.problems.append("the stray file was deleted")
    stray.unlink(missing_ok=True)
    _retry(trial, lambda: save(location, new, overwrite=True, durable=False, **SMALL_CHUNKING),
           location, new)
    return trial


def s3_stray_trial(options: dict[str, Any], name: str, rng: random.Random) -> Trial:
    from ucpformat.store.fsspec_store import FsspecStore
    from ucpformat.testing.s3 import BUCKET

    trial = Trial("s3-stray")
    url = f"s3://{BUCKET}/{name}"
    store = FsspecStore(url, storage_options=options)
    old, new = small_state(rng.randrange(1000)), small_state(rng.randrange(1000))
    save(store, old, **SMALL_CHUNKING)
    key = rng.choice(S3_STRAY_KEYS)
    store.fs.pipe_file(f"{store.root}/{key}", b"someone else's object\n")
    try:
        save(store, new, overwrite=True, **SMALL_CHUNKING)
        trial.outcome = "saved"
        trial.problems.append(f"a save that would have to delete the stray key {key!r} went "
                              "ahead")
    except UCPError as exc:
        trial.outcome = "refused"
        if exc.rule != "UCP-1.0-R049":
            trial.wrong_message = True
            trial.problems.append(f"refused without UCP-1.0-R049: {exc}")
    if not same_state(store, old):
        trial.lost = True
        trial.problems.append(f"the previous checkpoint is lost (stray key {key!r})")
    store.fs.rm_file(f"{store.root}/{key}")
    _retry(trial, lambda: save(store, new, overwrite=True, **SMALL_CHUNKING), store, new)
    return trial


def _retry(trial: Trial, again: Any, location: Path | Store, expected: Any) -> None:
    try:
        again()
    except UCPError as exc:
        trial.stuck = True
        trial.problems.append(f"the retry failed: {exc}")
        return
    if not same_state(location, expected):
        trial.stuck = True
        trial.problems.append("the retry does not load back")


def disk_full_trial(root: Path, rng: random.Random, writes: int) -> Trial:
    trial = Trial("disk-full")
    location = root / "ckpt"
    onto = rng.random() < 0.7
    old, new = small_state(rng.randrange(1000)), small_state(rng.randrange(1000))
    if onto:
        save(location, old, durable=False, **SMALL_CHUNKING)
    disk = DiskFull(after=rng.randrange(1, writes + 1))
    store = FaultyStore(LocalStore(location, durable=False), disk=disk)
    try:
        save(store, new, overwrite=onto, workers=2, **SMALL_CHUNKING)
        trial.outcome = "saved"
        trial.problems.append("the save succeeded on a full disk")
    except UCPError as exc:
        trial.outcome = "failed"
        message = str(exc)
        old_there = onto and same_state(location, old)
        says_gone = "is gone" in message
        if onto and not old_there and not says_gone:
            trial.lost = True
            trial.problems.append(f"the previous checkpoint is gone, the error does not say "
                                  f"so: {message}")
        if old_there and says_gone:
            trial.wrong_message = True
            trial.problems.append(f"the error says the checkpoint is gone; it is not: {message}")
        if "No space left" not in message:
            trial.wrong_message = True
            trial.problems.append(f"the error does not say why: {message}")
        if not old_there:
            left = _files(location)
            trial.leftovers = len(left)
            if left:
                trial.problems.append(f"{len(left)} files of the failed save remain: {left[:3]}")
    except Exception as exc:
        trial.outcome = "failed"
        trial.wrong_message = True
        trial.problems.append(f"{type(exc).__name__} (not a UCPError): {exc}")
    disk.free()
    _retry(trial, lambda: save(location, new, overwrite=onto, durable=False, **SMALL_CHUNKING),
           location, new)
    return trial


def manager_trial(root: Path, rng: random.Random) -> Trial:
    trial = Trial("manager-disk-full")
    disk = DiskFull()
    manager = CheckpointManager(
        root / "run", keep_last=2,
        store_factory=lambda loc: FaultyStore(LocalStore(loc, durable=False), disk=disk),
        **SMALL_CHUNKING,
    )
    full_from = rng.randrange(2, 5)
    full_steps = set(range(full_from, full_from + rng.randrange(1, 4)))
    committed: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        for step in range(1, max(full_steps) + 3):
            if step in full_steps:
                disk.fill()
            else:
                disk.free()
            try:
                manager.maybe_save(step, small_state(step))
                committed = {s for s in committed if s >= step - 1} | {step}
                trial.outcome = "saved"
            except UCPError as exc:
                if step not in full_steps:
                    trial.stuck = True
                    trial.problems.append(f"step {step} (disk free) failed: {exc}")
            present = {e.step for e in manager.checkpoints()}
            partial = sorted(s for s in present
                             if not (root / "run" / f"step-{s:010d}" / ZARR_JSON).exists())
            if partial:
                trial.leftovers += len(partial)
                trial.problems.append(f"after step {step}: partial saves of steps {partial}")
            if not committed <= present:
                trial.lost = True
                trial.problems.append(f"after step {step}: committed {sorted(committed)} but "
                                      f"{sorted(present)} present")
    final = manager.latest_valid()
    if final is None or final.step != max(full_steps) + 2:
        trial.stuck = True
        trial.problems.append(f"after the disk had room again, the newest valid is {final}")
    return trial


@dataclass
class Figures:
    trials: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    lost: int = 0
    wrong_message: int = 0
    leftovers: int = 0
    stuck: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, trial: Trial) -> None:
        self.trials[trial.kind] += 1
        self.outcomes.setdefault(trial.kind, Counter())[trial.outcome] += 1
        self.lost += trial.lost
        self.wrong_message += trial.wrong_message
        self.leftovers += trial.leftovers
        self.stuck += trial.stuck
        if trial.problems:
            self.failures.append(f"{trial.kind}: {'; '.join(trial.problems)}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "trials": sum(self.trials.values()),
            "checkpoints lost": self.lost,
            "wrong messages": self.wrong_message,
            "files left by failed saves": self.leftovers,
            "retries that failed": self.stuck,
            "trials with any failed check": len(self.failures),
            "outcomes per kind": {k: dict(sorted(v.items()))
                                  for k, v in sorted(self.outcomes.items())},
        }


def _writes_of_a_save(root: Path) -> int:
    trace: list[tuple[str, str]] = []
    save(FaultyStore(LocalStore(root / "count", durable=False), trace=trace), small_state(0),
         workers=2, **SMALL_CHUNKING)
    return sum(op == "put" for op, _ in trace)


def run(trials: int, *, seed: int = 0, kinds: Sequence[str] = KINDS,
        progress: bool = False, s3_options: dict[str, Any] | None = None) -> Figures:
    """``trials`` trials of every kind (the manager's and s3's: a fifth as many; s3's
    against the server of ``s3_options``, or a local one started for the run)."""
    rng = random.Random(seed)
    figures = Figures()
    with tempfile.TemporaryDirectory() as tmp:
        writes = _writes_of_a_save(Path(tmp))
        s3: Any = None
        options: dict[str, Any] = s3_options or {}
        if "s3-stray" in kinds and s3_options is None:
            from ucpformat.testing.s3 import s3_server

            s3 = s3_server()
            options = s3.__enter__()
        try:
            for i in range(trials):
                for kind in kinds:
                    if kind in ("manager-disk-full", "s3-stray") and i % 5 and trials >= 5:
                        continue
                    with tempfile.TemporaryDirectory(dir=tmp) as sub:
                        where = Path(sub)
                        if kind == "stray":
                            trial = stray_trial(where, rng)
                        elif kind == "disk-full":
                            trial = disk_full_trial(where, rng, writes)
                        elif kind == "manager-disk-full":
                            trial = manager_trial(where, rng)
                        else:
                            trial = s3_stray_trial(options, f"stray-{seed}-{i}", rng)
                    figures.add(trial)
                if progress and (i + 1) % 20 == 0:
                    print(f"  {i + 1}/{trials}, {len(figures.failures)} failed", flush=True)
        finally:
            if s3 is not None:
                s3.__exit__(None, None, None)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.failed_saves",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    figures = run(args.trials, seed=args.seed, kinds=args.kinds, progress=not args.json)
    out = figures.as_dict()
    out["seconds"] = round(time.perf_counter() - start, 1)
    print_figures("failed saves (ucpformat.testing.failed_saves)", out, as_json=args.json)
    for line in figures.failures[:20]:
        print("FAILED:", line)
    return 0 if not figures.failures else 1


if __name__ == "__main__":
    sys.exit(main())
