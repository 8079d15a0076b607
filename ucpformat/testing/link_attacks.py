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
- distributed saves (``--dist-trials``): the plantings of the writer kinds but the
  streaming writer and the race (``dist-dir-link``, ``dist-overwrite-dir-link``, ...),
  saved to by a process group of two ranks over ``torch.distributed`` (gloo), each
  writing the stored objects it owns, with :func:`~ucpformat.distributed.save_fragments`
  and the DCP plugin in turn (:mod:`ucpformat.testing.gloo_writers`); a refused
  distributed save must leave the location entry for entry as it was (links not
  followed), so that a checkpoint there survives, and ``dist-refused-links`` saves
  without ``overwrite`` onto a checkpoint with the links of an ``overwrite-`` kind, which
  must be refused;
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

Run ``python -m ucpformat.testing.link_attacks --trials 20 --reads 3000 --dist-trials 20`` (``make
stress``); the test suite runs a quick mode.
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

from ucpformat.checkpoint.manager import CheckpointManager, CheckpointWarning
from ucpformat.checkpoint.metadata import IN_PROGRESS_KEY
from ucpformat.checkpoint.reader import open_checkpoint
from ucpformat.checkpoint.streaming import StreamingWriter
from ucpformat.checkpoint.writer import save
from ucpformat.errors import UCPError
from ucpformat.store import LocalStore
from ucpformat.testing.common import (
    SMALL_CHUNKING,
    OutsideWatch,
    differences,
    print_figures,
    small_state,
    tree_bytes,
)
from ucpformat.testing.faults import FaultyStore
from ucpformat.testing.gloo_writers import SaveOrder, WriterGroup, expected

WRITER_KINDS = (
    "dir-link", "overwrite-dir-link", "overwrite-nested-link", "overwrite-file-link",
    "overwrite-hard-link", "marker-hard-link", "marker-link", "streaming-dir-link",
    "race-save",
)
#: Distributed saves (two ranks over gloo) into the same plantings as the writer kinds.
OVERWRITE_KINDS = ("overwrite-dir-link", "overwrite-nested-link", "overwrite-file-link",
                   "overwrite-hard-link")
DIST_KINDS = ("dist-dir-link", *(f"dist-{k}" for k in OVERWRITE_KINDS), "dist-marker-hard-link",
              "dist-marker-link", "dist-refused-links")
#: Saves a race-save trial makes, at most, for its attacker to swap at least once.
RACE_ATTEMPTS = 5
MANAGER_KINDS = ("manager-step-link", "manager-foreign-step")
READER_KINDS = ("reader-swap-file", "reader-swap-dir")
KINDS = WRITER_KINDS + MANAGER_KINDS + READER_KINDS
#: The distributed writers, in turn.
DIST_WRITERS = ("distributed", "dcp")


@dataclass
class Trial:
    kind: str
    writer: str = ""  # dist- kinds: distributed | dcp
    outcome: str = ""  # refused | saved | wrong (writers); read (readers)
    rule: str = ""  # dist- kinds, refused: the requirement the refusal named
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


def plant(kind: str, site: Site, rng: random.Random) -> bool:
    """Plant the links of a writer ``kind`` into ``site.ckpt``; whether the save then
    passes ``overwrite=True`` (a ``dist-`` kind plants what the kind without it does)."""
    kind = kind.removeprefix("dist-")
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
    return overwrite


def writer_trial(kind: str, site: Site, rng: random.Random) -> Trial:
    trial = Trial(kind)
    new = small_state(rng.randrange(1000))
    ckpt = site.ckpt
    overwrite = plant(kind, site, rng)
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


def location_entries(root: Path) -> dict[str, str | bytes]:
    """Every entry under ``root``, links not followed: a file's bytes, a link's target
    (``-> target``), a directory's name (``dir``)."""
    out: dict[str, str | bytes] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            out[key] = "dir"
        elif path.stat().st_nlink > 1:  # a hard link: its bytes may be outside's
            out[key] = f"hard link, inode {path.stat().st_ino}"
        else:
            out[key] = path.read_bytes()
    return out


def distributed_trial(kind: str, site: Site, rng: random.Random, group: WriterGroup,
                      writer: str) -> Trial:
    """A ``dist-`` kind: the links of the kind without the prefix, saved to by every
    rank of a distributed save (``writer``: ``distributed`` or ``dcp``, see
    :mod:`ucpformat.testing.gloo_writers`). Refused, the location must be as it was.
    ``dist-refused-links``: the links of an ``overwrite-`` kind, saved to without
    ``overwrite``: the save must be refused (a checkpoint is committed there)."""
    trial = Trial(kind, writer=writer)
    seed = rng.randrange(1000)
    refuse = kind == "dist-refused-links"
    overwrite = plant(rng.choice(OVERWRITE_KINDS) if refuse else kind, site, rng) and not refuse
    before = location_entries(site.ckpt)
    with site.watched(trial):
        answers = group.save(SaveOrder(writer, str(site.ckpt), seed, overwrite))
    outcomes = {a.outcome for a in answers}
    why = next((a.why for a in answers if a.why), "")
    if outcomes == {"saved"}:
        try:
            with open_checkpoint(site.ckpt) as ckpt:
                diffs = differences(ckpt.to_dict(), expected(writer, seed))
        except UCPError as exc:
            diffs = [f"does not open: {exc}"]
        trial.outcome = "saved" if not diffs else "wrong"
        if diffs:
            trial.problems.append(f"saved, but loads something else: {diffs[:2]}")
        if refuse:
            trial.problems.append("saved over a committed checkpoint without overwrite")
    elif outcomes == {"refused"}:
        trial.outcome = "refused"
        trial.rule = next((a.rule for a in answers if a.rule), "")
        if not trial.rule:
            trial.problems.append(f"refused without a requirement: {why[:300]}")
        after = location_entries(site.ckpt)
        if after != before:
            changed = sorted(k for k in set(before) | set(after)
                             if before.get(k) != after.get(k))
            trial.problems.append(f"refused, but the location changed: {changed[:3]}")
    else:
        trial.outcome = "refused"
        trial.problems.append(f"the ranks said {[a.outcome for a in answers]}: {why[:300]}")
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

    # A save can end before the attacker's thread is first scheduled (a loaded machine):
    # then it is saved again over itself, up to RACE_ATTEMPTS times, until the attacker
    # has swapped at least once during a save.
    with site.watched(trial):
        for attempt in range(RACE_ATTEMPTS):
            stop.clear()
            thread = threading.Thread(target=attacker, daemon=True)
            store = FaultyStore(LocalStore(site.ckpt, durable=False), delay=0.001)
            thread.start()
            try:
                save(store, new, durable=False, workers=2, overwrite=attempt > 0,
                     **SMALL_CHUNKING)
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
            if swaps:
                break
    if swaps == 0:
        trial.problems.append(f"the attacker never swapped the directory in {RACE_ATTEMPTS} "
                              "saves")
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
    refusals: Counter[str] = field(default_factory=Counter)  # dist- kinds: by rule
    failures: list[str] = field(default_factory=list)

    def add(self, trial: Trial) -> None:
        if trial.rule:
            self.refusals[f"{trial.kind}: {trial.rule}"] += 1
        label = f"{trial.kind} ({trial.writer})" if trial.writer else trial.kind
        self.trials[label] += 1
        self.outcomes.setdefault(label, Counter())[trial.outcome] += 1
        if trial.outside:
            self.outside_touched[label] += 1
            trial.problems.append(f"outside touched: {trial.outside[:3]}")
        self.reads.update(trial.reads)
        if trial.problems:
            self.failures.append(f"{label}: {'; '.join(trial.problems)}")

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
            "distributed refusals by rule": dict(sorted(self.refusals.items())),
        }


def run(trials: int, *, reads: int = 1000, seed: int = 0,
        kinds: Sequence[str] = KINDS, dist_trials: int = 0, dist_kinds: Sequence[str] = DIST_KINDS,
        progress: bool = False, gloo_timeout: float = 60.0, gloo_setup: str = "") -> Figures:
    """``trials`` trials of every kind; reader trials make ``reads`` reads each; then
    ``dist_trials`` trials of every distributed kind, their writers in turn
    (``gloo_timeout``, ``gloo_setup``: see :class:`~ucpformat.testing.gloo_writers.WriterGroup`)."""
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
    if dist_trials and dist_kinds:
        with WriterGroup(2, timeout=gloo_timeout, setup=gloo_setup) as group:
            for i in range(dist_trials):
                for k, kind in enumerate(dist_kinds):
                    with tempfile.TemporaryDirectory() as tmp:
                        site = Site(Path(tmp), rng.randrange(10**6))
                        writer = DIST_WRITERS[(i + k) % len(DIST_WRITERS)]
                        figures.add(distributed_trial(kind, site, rng, group, writer))
                if progress:
                    print(f"  distributed round {i + 1}/{dist_trials}: {figures.failed} failed",
                          flush=True)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.link_attacks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials of every kind")
    parser.add_argument("--reads", type=int, default=3000, help="reads per reader trial")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--dist-trials", type=int, default=0,
                        help="trials of every distributed kind (two gloo ranks)")
    parser.add_argument("--dist-kinds", nargs="*", default=list(DIST_KINDS), choices=DIST_KINDS)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if not OutsideWatch.available():
        print("note: no inotify here: only changed bytes outside are detected, not reads",
              file=sys.stderr)
    start = time.perf_counter()
    figures = run(args.trials, reads=args.reads, seed=args.seed, kinds=args.kinds,
                  dist_trials=args.dist_trials, dist_kinds=args.dist_kinds,
                  progress=not args.json)
    out = figures.as_dict()
    out["seconds"] = round(time.perf_counter() - start, 1)
    print_figures("link attacks (ucpformat.testing.link_attacks)", out, as_json=args.json)
    for line in figures.failures[:20]:
        print("FAILED:", line)
    return 0 if figures.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
