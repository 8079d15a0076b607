"""Link attacks, measured: symbolic and hard links planted in a checkpoint's location.

Each trial plants links into a location next to a directory ``outside`` that holds a
valid checkpoint of another state (so that data read through a link would pass its
checksums) and a file ``secret``, then runs the library, and records whether anything
outside was touched: the kernel reports every open, read, listing, write, creation and
deletion under ``outside`` (inotify, :class:`~ucpformat.testing.common.OutsideWatch`),
and the bytes of every file there are compared before and after. Kinds:

- writers (UCP-1.0-R091, UCP-1.0-R089): a destination holding only a link ``model -> outside``
  (``dir-link``); a committed checkpoint whose ``model`` directory, a shard directory or
  a stored object is replaced by a symbolic link (``overwrite-dir-link``,
  ``overwrite-nested-link``, ``overwrite-file-link``) or a stored object by a hard link
  (``overwrite-hard-link``), written over with ``overwrite=True``; the remains of a save
  whose in-progress marker is a hard or a symbolic link to ``secret``
  (``marker-hard-link``, ``marker-link``); the streaming writer (``streaming-dir-link``);
  and a directory of the destination swapped for a link again and again while a save
  runs (``race-save``);
- the checkpoint manager: a ``step-*`` entry that is a link to a checkpoint outside the
  run directory, and a ``step-*`` directory of other files, during rotation
  (``manager-step-link``, ``manager-foreign-step``);
- readers (UCP-1.0-R089, time of check to time of use): a thread swaps a stored object, or the
  directory of an array's shards, for a link to its counterpart outside and back, while
  an open checkpoint reads the tensor again and again (``reader-swap-file``,
  ``reader-swap-dir``).

Outcomes: a write is *refused* (an error that names the requirement) or *saved* (and
then it must load back the state saved); a read is *read* (the saved values), *refused*
or *wrong* (other values: read through a link); a trial is *outside-touched* if anything
under ``outside`` was opened, listed, written or deleted. Every figure but refused, saved
and read must be zero.

Run ``python -m ucpformat.testing.links --trials 20 --reads 3000`` (``make stress``); the
test suite runs a quick mode.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ucpformat.errors import UCPError
from ucpformat.manager import CheckpointManager, CheckpointWarning
from ucpformat.metadata import IN_PROGRESS_KEY
from ucpformat.reader import open_checkpoint
from ucpformat.storage import LocalStore
from ucpformat.testing.common import (
    SMALL_CHUNKING,
    OutsideWatch,
    differences,
    print_figures,
    small_state,
    tree_bytes,
)
from ucpformat.testing.faults import FaultyStore
from ucpformat.writer import StreamingWriter, save

WRITER_KINDS = (
    "dir-link", "overwrite-dir-link", "overwrite-nested-link", "overwrite-file-link",
    "overwrite-hard-link", "marker-hard-link", "marker-link", "streaming-dir-link",
    "race-save",
)
MANAGER_KINDS = ("manager-step-link", "manager-foreign-step")
READER_KINDS = ("reader-swap-file", "reader-swap-dir")
KINDS = WRITER_KINDS + MANAGER_KINDS + READER_KINDS


@dataclass
class Trial:
    kind: str
    outcome: str = ""  # refused | saved | wrong (writers); read (readers)
    outside: list[str] = field(default_factory=list)  # what touched the outside
    reads: Counter[str] = field(default_factory=Counter)  # readers: read/refused/wrong
    problems: list[str] = field(default_factory=list)


class Site:
    """One trial's directories: the location ``ckpt``, and ``outside`` with a valid
    checkpoint of another state (``outside/ckpt``) and a file ``secret``."""

    def __init__(self, root: Path, seed: int) -> None:
        self.root = root
        self.ckpt = root / "ckpt"
        self.outside = root / "outside"
        self.outside.mkdir()
        (self.outside / "secret").write_bytes(b"outside the checkpoint\n")
        self.other = small_state(seed + 1000)
        save(self.outside / "ckpt", self.other, durable=False, **SMALL_CHUNKING)
        self.before = tree_bytes(self.outside)

    @contextlib.contextmanager
    def watched(self, trial: Trial, *, reads_allowed: bool = False) -> Iterator[None]:
        """Record in ``trial`` everything that touches ``outside`` inside the block (but
        opening, reading and listing if ``reads_allowed``)."""
        watch = OutsideWatch(self.outside) if OutsideWatch.available() else None
        try:
            yield
        finally:
            if watch is not None:
                events = watch.events()
                if reads_allowed:
                    events = [e for e in events
                              if set(e.split()[0].split("|")) - {"OPEN", "ACCESS", "ISDIR",
                                                                  "CLOSE_NOWRITE"}]
                trial.outside.extend(events)
                watch.close()
            after = tree_bytes(self.outside)
            changed = sorted(k for k in set(self.before) | set(after)
                             if self.before.get(k) != after.get(k))
            trial.outside.extend(f"changed {k}" for k in changed)


def _files(root: Path, pattern: str) -> list[Path]:
    return sorted(p for p in root.rglob(pattern) if p.is_file() and not p.is_symlink())


def _chunk_files(root: Path) -> list[Path]:
    """The stored objects under ``root`` (files under a ``c`` directory)."""
    return [p for p in _files(root, "*") if "c" in p.relative_to(root).parts[:-1]]


def _counterpart(site: Site, path: Path) -> Path:
    return site.outside / "ckpt" / path.relative_to(site.ckpt)


def _save_outcome(trial: Trial, run: Callable[[], object], location: Path,
                  expected: Any) -> None:
    try:
        run()
    except UCPError as exc:
        trial.outcome = "refused"
        if not exc.rule:
            trial.problems.append(f"refused without a requirement: {exc}")
        return
    except Exception as exc:  # anything but a UCPError is a failure of the library
        trial.outcome = "refused"
        trial.problems.append(f"{type(exc).__name__}: {exc}")
        return
    try:
        with open_checkpoint(location) as ckpt:
            diffs = differences(ckpt.to_dict(), expected)
    except UCPError as exc:
        diffs = [f"does not open: {exc}"]
    trial.outcome = "saved" if not diffs else "wrong"
    if diffs:
        trial.problems.append(f"saved, but loads something else: {diffs[:2]}")


# -- writers ---------------------------------------------------------------------------------


def writer_trial(kind: str, site: Site, rng: random.Random) -> Trial:
    trial = Trial(kind)
    new = small_state(rng.randrange(1000))
    ckpt = site.ckpt
    overwrite = True
    if kind == "dir-link":
        ckpt.mkdir()
        (ckpt / "model").symlink_to(site.outside / "ckpt" / "model", target_is_directory=True)
        overwrite = False
    elif kind == "marker-hard-link" or kind == "marker-link":
        LocalStore(ckpt, durable=False).put("model/fc.weight/zarr.json", [b"{}"])
        marker = ckpt / IN_PROGRESS_KEY
        if kind == "marker-hard-link":
            os.link(site.outside / "secret", marker)
        else:
            marker.symlink_to(site.outside / "secret")
        overwrite = rng.random() < 0.5
    else:
        save(ckpt, small_state(rng.randrange(1000)), durable=False, **SMALL_CHUNKING)
        if kind in ("overwrite-dir-link", "streaming-dir-link"):
            target = ckpt / "model"
        elif kind == "overwrite-nested-link":
            target = rng.choice(sorted(p for p in ckpt.rglob("c") if p.is_dir()))
        else:
            target = rng.choice(_chunk_files(ckpt))
        if kind in ("overwrite-file-link", "overwrite-hard-link"):
            target.unlink()
            link = site.outside / "ckpt" / target.relative_to(ckpt)
            if kind == "overwrite-hard-link":
                os.link(link, target)
            else:
                target.symlink_to(link)
        else:
            shutil.rmtree(target)
            target.symlink_to(_counterpart(site, target), target_is_directory=True)
    with site.watched(trial):
        if kind == "streaming-dir-link":
            _save_outcome(trial, lambda: _streaming_save(ckpt, new), ckpt, _model_only(new))
        else:
            _save_outcome(
                trial,
                lambda: save(ckpt, new, overwrite=overwrite, durable=False, **SMALL_CHUNKING),
                ckpt, new,
            )
    return trial


def _model_only(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": state["model"]}


def _streaming_save(location: Path, state: dict[str, Any]) -> None:
    with StreamingWriter(location, overwrite=True, durable=False, **SMALL_CHUNKING) as w:
        for name, array in state["model"].items():
            w.declare(f"model/{name}", array.shape, array.dtype)
            w.write(f"model/{name}", array)
        w.commit()


def race_trial(site: Site, rng: random.Random) -> Trial:
    """A directory of the destination is swapped for a link to its counterpart outside,
    and back, again and again, while a save (slowed down) writes into it."""
    trial = Trial("race-save")
    new = small_state(rng.randrange(1000))
    victim = rng.choice(["model", "model/fc.weight", "model/fc.weight/c", "optimizer"])
    stop = threading.Event()
    swaps = 0

    def attacker() -> None:
        nonlocal swaps
        path = site.ckpt / victim
        hidden = site.ckpt / f"hidden-{rng.randrange(10**6)}"
        outside = site.outside / "ckpt" / victim
        while not stop.is_set():
            try:
                os.rename(path, hidden)
            except OSError:
                time.sleep(0.0005)
                continue
            with contextlib.suppress(OSError):
                path.symlink_to(outside, target_is_directory=True)
                swaps += 1
            time.sleep(rng.uniform(0.0, 0.003))
            with contextlib.suppress(OSError):
                path.unlink()
            with contextlib.suppress(OSError):
                os.rename(hidden, path)
            time.sleep(rng.uniform(0.0, 0.003))

    thread = threading.Thread(target=attacker, daemon=True)
    store = FaultyStore(LocalStore(site.ckpt, durable=False), delay=0.001)
    with site.watched(trial):
        thread.start()
        try:
            save(store, new, durable=False, workers=2, **SMALL_CHUNKING)
            trial.outcome = "saved"
        except UCPError as exc:
            trial.outcome = "refused"
            if not exc.rule and "the save failed" not in str(exc):
                trial.problems.append(f"refused without saying why: {exc}")
        except Exception as exc:
            trial.outcome = "refused"
            trial.problems.append(f"{type(exc).__name__}: {exc}")
        finally:
            stop.set()
            thread.join()
    if swaps == 0:
        trial.problems.append("the attacker never swapped the directory")
    return trial


# -- the manager -----------------------------------------------------------------------------


def manager_trial(kind: str, site: Site, rng: random.Random) -> Trial:
    """Rotation in a run directory whose ``step-0000000001`` is a link to a checkpoint
    outside it, or a directory of other files: neither may be deleted (or read through)."""
    trial = Trial(kind)
    run = site.root / "run"
    run.mkdir()
    first = run / "step-0000000001"
    if kind == "manager-step-link":
        first.symlink_to(site.outside / "ckpt", target_is_directory=True)
    else:  # a directory of other files: it counts as outside too, and must stay as it is
        shutil.copytree(site.outside, first)
        site.outside = first
        site.before = tree_bytes(first)
    manager = CheckpointManager(run, keep_last=1, durable=False, **SMALL_CHUNKING)
    steps = rng.sample(range(2, 50), 3)
    # a directory in the run directory may be looked into (what is it?), never changed
    with site.watched(trial, reads_allowed=kind == "manager-foreign-step"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        try:
            for step in sorted(steps):
                manager.maybe_save(step, small_state(step))
            manager.prune()
            manager.remove_partial()
            trial.outcome = "saved"
        except UCPError as exc:
            trial.outcome = "refused"
            trial.problems.append(f"the manager failed: {exc}")
    if not (first.is_symlink() or first.is_dir()):
        trial.problems.append(f"{first.name} was deleted")
    return trial


# -- readers ---------------------------------------------------------------------------------


def reader_trial(kind: str, site: Site, rng: random.Random, reads: int) -> Trial:
    """Reads of an open checkpoint while a thread swaps a stored object (or an array's
    shard directory) for a link to its counterpart outside and back."""
    trial = Trial(kind)
    state = small_state(rng.randrange(1000))
    save(site.ckpt, state, durable=False, **SMALL_CHUNKING)
    tensor = rng.choice(["fc.weight", "emb.weight"])
    expected = state["model"][tensor]
    if kind == "reader-swap-file":
        victim = rng.choice(_chunk_files(site.ckpt / "model" / tensor))
    else:
        victim = site.ckpt / "model" / tensor / "c"
    outside = _counterpart(site, victim)
    hidden = victim.with_name(victim.name + ".hidden")
    is_dir = victim.is_dir()
    stop = threading.Event()

    def attacker() -> None:
        while not stop.is_set():
            os.rename(victim, hidden)
            victim.symlink_to(outside, target_is_directory=is_dir)
            time.sleep(rng.uniform(0.0, 0.0005))
            victim.unlink()
            os.rename(hidden, victim)
            time.sleep(rng.uniform(0.0, 0.0005))

    thread = threading.Thread(target=attacker, daemon=True)
    with site.watched(trial), open_checkpoint(site.ckpt) as ckpt:
        array = ckpt[f"model/{tensor}"]
        thread.start()
        try:
            for _ in range(reads):
                try:
                    got = array.read()
                except UCPError:
                    trial.reads["refused"] += 1
                    continue
                except Exception as exc:
                    trial.reads["crashed"] += 1
                    trial.problems.append(f"{type(exc).__name__}: {exc}")
                    continue
                same = np.ascontiguousarray(got).tobytes() == expected.tobytes()
                trial.reads["read" if same else "wrong"] += 1
        finally:
            stop.set()
            thread.join()
    trial.outcome = "read"
    if trial.reads["wrong"]:
        trial.problems.append(f"{trial.reads['wrong']} reads returned data from outside")
    return trial


# -- running ---------------------------------------------------------------------------------


@dataclass
class Figures:
    trials: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    outside_touched: Counter[str] = field(default_factory=Counter)
    reads: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, trial: Trial) -> None:
        self.trials[trial.kind] += 1
        self.outcomes.setdefault(trial.kind, Counter())[trial.outcome] += 1
        if trial.outside:
            self.outside_touched[trial.kind] += 1
            trial.problems.append(f"outside touched: {trial.outside[:3]}")
        self.reads.update(trial.reads)
        if trial.problems:
            self.failures.append(f"{trial.kind}: {'; '.join(trial.problems)}")

    @property
    def failed(self) -> int:
        return len(self.failures)

    def as_dict(self) -> dict[str, Any]:
        return {
            "trials": sum(self.trials.values()),
            "outside touched (trials)": sum(self.outside_touched.values()),
            "wrong reads": self.reads["wrong"],
            "trials with any failed check": self.failed,
            "reads (read / refused / wrong)": (
                f"{self.reads['read']} / {self.reads['refused']} / {self.reads['wrong']}"
            ),
            "outcomes per kind": {k: dict(sorted(v.items()))
                                  for k, v in sorted(self.outcomes.items())},
        }


def run(trials: int, *, reads: int = 1000, seed: int = 0,
        kinds: Sequence[str] = KINDS, progress: bool = False) -> Figures:
    """``trials`` trials of every kind; reader trials make ``reads`` reads each."""
    rng = random.Random(seed)
    figures = Figures()
    for i in range(trials):
        for kind in kinds:
            with tempfile.TemporaryDirectory() as tmp:
                site = Site(Path(tmp), rng.randrange(10**6))
                if kind in WRITER_KINDS and kind != "race-save":
                    trial = writer_trial(kind, site, rng)
                elif kind == "race-save":
                    trial = race_trial(site, rng)
                elif kind in MANAGER_KINDS:
                    trial = manager_trial(kind, site, rng)
                else:
                    trial = reader_trial(kind, site, rng, reads)
            figures.add(trial)
        if progress:
            print(f"  round {i + 1}/{trials}: {figures.failed} failed", flush=True)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.links",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials of every kind")
    parser.add_argument("--reads", type=int, default=3000, help="reads per reader trial")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if not OutsideWatch.available():
        print("note: no inotify here: only changed bytes outside are detected, not reads",
              file=sys.stderr)
    start = time.perf_counter()
    figures = run(args.trials, reads=args.reads, seed=args.seed, kinds=args.kinds,
                  progress=not args.json)
    out = figures.as_dict()
    out["seconds"] = round(time.perf_counter() - start, 1)
    print_figures("link attacks (ucpformat.testing.links)", out, as_json=args.json)
    for line in figures.failures[:20]:
        print("FAILED:", line)
    return 0 if figures.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
