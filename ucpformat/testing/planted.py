"""The checkpoint manager under planted directories, links, records and odd names, measured.

Each trial runs a :class:`~ucpformat.manager.CheckpointManager` (``keep_last`` 1 to 3,
with or without a ``record_key``) through a few saves of its own, restarting it (a new
manager on the same root) now and then, and plants one thing under its root at a random
moment. Kinds:

- ``planted-newest``: a valid checkpoint of another state at ``step-<12 digits>``, newer
  than anything the manager writes (issue 31: it became the newest, and the run's own
  saves were deleted);
- ``planted-older``: valid checkpoints at canonical names older than, or between, the
  manager's own;
- ``odd-name``: valid checkpoints at names the formatter never writes (``step-00000000012``,
  ``step-12``, Arabic-Indic digits), some of which the old parser read as steps;
- ``step-link``: a ``step-*`` symbolic link to a valid checkpoint outside the root;
- ``replaced-own``: one of the manager's own checkpoints replaced by another valid
  checkpoint at the same name;
- ``planted-remains``: the remains of a save (in-progress marker, a stored object) at a
  canonical name the manager never used;
- ``next-location``: a valid checkpoint at exactly the location of the manager's next save;
- ``planted-record``: the manager's record rewritten to list a planted valid checkpoint
  with its correct root digest (the live manager notices; restarted managers use a
  ``record_key`` here, whose HMAC the planted record lacks);
- ``record-link``: the record replaced by a symbolic link to a record outside that lists a
  planted checkpoint;
- ``record-other-user``: the record rewritten as above and owned by another user (only
  where the harness runs as root, which can ``chown``; without a key).

After the last save, a new manager restores the newest checkpoint. Outcomes, per trial:
``refused`` (the restore, or a save, raised an error that says why), ``restored own``
(a checkpoint holding exactly what the manager saved at that step), ``restored foreign``
(anything else), ``nothing`` (no checkpoint: right only where every checkpoint it
keeps was replaced);
and over all trials: ``deleted foreign`` (a planted file, directory, link or link target
changed or gone), ``deleted own`` (a checkpoint the manager saved and retention keeps —
of its newest ``keep_last`` saves, those not replaced — gone or changed) and ``unreported`` (a
plant the manager met without a warning or an error naming it). **Restored foreign,
deleted foreign, deleted own and unreported must be 0.**

Run ``python -m ucpformat.testing.planted --trials 200`` (``make stress``); the test suite
runs a quick mode (one trial of each kind).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ucpformat
from ucpformat.checkpoint.manager import RECORD_KEY, CheckpointManager, parse_step_name, step_name
from ucpformat.errors import UCPError
from ucpformat.testing.common import SMALL_CHUNKING, differences, print_figures, small_state

KINDS = ("planted-newest", "planted-older", "odd-name", "step-link", "replaced-own",
         "planted-remains", "next-location", "planted-record", "record-link",
         "record-other-user")
FOREIGN_SEED = 10_000  # planted checkpoints hold small_state(FOREIGN_SEED + n)
KEY = b"the run's record key"


@dataclass
class Trial:
    kind: str
    outcome: str = ""  # refused | restored own | restored foreign | nothing
    refusals: int = 0  # saves (or restores) refused along the way
    deleted_foreign: int = 0
    deleted_own: int = 0
    unreported: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class _Plant:
    path: Path  # what was planted (a directory, a link, a file)
    said: str  # a name a warning or an error about it must contain
    snapshot: Any = None


def _snapshot(path: Path) -> Any:
    if path.is_symlink():
        return ("link", os.readlink(path))
    if path.is_dir():
        return ("dir", {p.relative_to(path).as_posix(): p.read_bytes()
                        for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()})
    if path.is_file():
        return ("file", path.read_bytes())
    return None


def _save_foreign(path: Path, n: int) -> None:
    ucpformat.save(path, small_state(FOREIGN_SEED + n), durable=False, **SMALL_CHUNKING)


def _root_sha256(location: Path) -> str:
    return hashlib.sha256((location / "zarr.json").read_bytes()).hexdigest()


def _planted_record(root: Path, planted: Path, step: int) -> bytes:
    """The manager's record with ``planted`` (a valid checkpoint) listed as step ``step``."""
    try:
        doc = json.loads((root / RECORD_KEY).read_text())
    except (OSError, ValueError):
        doc = {"format": "ucpformat.manager.record/1", "checkpoints": {}}
    doc.pop("hmac_sha256", None)
    doc["checkpoints"][step_name(step)] = {"step": step, "state": "saved",
                                           "root_sha256": _root_sha256(planted)}
    return json.dumps(doc).encode()


class _Run:
    def __init__(self, kind: str, site: Path, rng: random.Random) -> None:
        self.kind, self.site, self.rng = kind, site, rng
        self.root = site / "run"
        self.outside = site / "outside"
        self.keep_last = rng.choice([1, 2, 3])
        self.key = KEY if kind in ("planted-record", "record-link") or rng.random() < 0.3 \
            else None
        self.plants: list[_Plant] = []
        self.saved: list[int] = []  # the manager's own saves that succeeded
        self.replaced: set[int] = set()
        self.messages: list[str] = []
        self.trial = Trial(kind)

    def manager(self) -> CheckpointManager:
        return CheckpointManager(self.root, keep_last=self.keep_last, durable=False,
                                 record_key=self.key, **SMALL_CHUNKING)

    def call(self, fn: Any, *args: Any) -> Any:
        """Call the manager; its warnings and errors are what it said."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return fn(*args)
            except UCPError as exc:
                self.messages.append(str(exc))
                self.trial.refusals += 1
                return exc
            finally:
                self.messages.extend(str(w.message) for w in caught)

    # -- plantings ------------------------------------------------------------------------

    def plant(self, next_step: int) -> None:
        kind, rng, root = self.kind, self.rng, self.root
        root.mkdir(parents=True, exist_ok=True)
        if kind == "planted-newest":
            self._dir(root / step_name(rng.randrange(10**11, 10**12)))
        elif kind == "planted-older":
            taken = set(self.saved) | {next_step}
            for step in rng.sample([s for s in range(0, 60) if s not in taken], 2):
                self._dir(root / step_name(step))
        elif kind == "odd-name":
            step = rng.randrange(0, 60)
            for name in rng.sample([f"step-0{step:010d}", f"step-{step}",
                                    "step-" + "".join(chr(0x660 + int(c))
                                                      for c in f"{step:010d}")], 2):
                self._dir(root / name)
        elif kind == "step-link":
            _save_foreign(self.outside / "ckpt", 1)
            link = root / step_name(rng.choice([next_step + 1000, rng.randrange(0, 60)]))
            if not link.exists():
                link.symlink_to(self.outside / "ckpt", target_is_directory=True)
                self.plants.append(_Plant(link, link.name))
                self.plants.append(_Plant(self.outside / "ckpt", link.name))
        elif kind == "replaced-own":
            if not self.saved:  # nothing of its own yet: a checkpoint it will meet later
                self._dir(root / step_name(next_step + 1))
            else:
                step = rng.choice(self.saved[-self.keep_last:])
                shutil.rmtree(root / step_name(step))
                self._dir(root / step_name(step))
                self.replaced.add(step)
        elif kind == "planted-remains":
            taken = set(self.saved) | {next_step}
            where = root / step_name(rng.choice([s for s in range(0, 60) if s not in taken]))
            where.mkdir()
            (where / "write-in-progress.ucp.json").write_text("{}")
            (where / "model").mkdir()
            (where / "model" / "zarr.json").write_text("{}")
            self.plants.append(_Plant(where, where.name))
        elif kind == "next-location":
            self._dir(root / step_name(next_step))
        else:  # the record
            planted = root / step_name(next_step + 500)
            self._dir(planted)
            self.plants[-1].said = RECORD_KEY  # the record is refused, naming itself
            body = _planted_record(root, planted, next_step + 500)
            record = root / RECORD_KEY
            if kind == "record-link":
                (self.outside).mkdir(parents=True, exist_ok=True)
                (self.outside / "record.json").write_bytes(body)
                record.unlink(missing_ok=True)
                record.symlink_to(self.outside / "record.json")
                self.plants.append(_Plant(self.outside / "record.json", RECORD_KEY))
            else:
                record.write_bytes(body)
                if kind == "record-other-user":
                    os.chown(record, 65534, 65534)
            self.plants.append(_Plant(record, RECORD_KEY))
        for p in self.plants:
            if p.snapshot is None:
                p.snapshot = _snapshot(p.path)

    def _dir(self, path: Path) -> None:
        _save_foreign(path, len(self.plants))
        self.plants.append(_Plant(path, path.name))

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> Trial:
        rng = self.rng
        steps = sorted(rng.sample(range(1, 60), 5))
        plant_at = rng.randrange(len(steps) + 1)
        manager = self.manager()
        for i, step in enumerate(steps):
            if i == plant_at:
                self.plant(step)
            if rng.random() < 0.3:
                manager = self.manager()  # a restart
            got = self.call(manager.maybe_save, step, small_state(step))
            if not isinstance(got, UCPError):
                self.saved.append(step)
        if plant_at == len(steps):
            self.plant(steps[-1] + 1)
        self.call(manager.prune)
        self._restore(self.manager() if rng.random() < 0.5 else manager)
        self._check()
        return self.trial

    def _restore(self, manager: CheckpointManager) -> None:
        got = self.call(manager.restore)
        if isinstance(got, UCPError):
            self.trial.outcome = "refused"
            return
        kept = self._kept()
        if got is None:
            self.trial.outcome = "nothing"
            if kept:  # possible only when every checkpoint it keeps was replaced
                self.trial.problems.append(f"nothing restored, though it keeps steps {kept}")
            return
        with got as ckpt:
            step = parse_step_name(ckpt.location.rstrip("/").rsplit("/", 1)[-1])
            own = (step is not None and step in self.saved and step not in self.replaced
                   and Path(ckpt.location).parent == self.root
                   and differences(ckpt.to_dict(), small_state(step)) == [])
        self.trial.outcome = "restored own" if own else "restored foreign"
        if not own:
            self.trial.problems.append(f"restored {ckpt.location}, not the manager's own")
        elif step != max(kept):
            self.trial.problems.append(f"restored step {step}, not the newest of its own")

    def _kept(self) -> list[int]:
        """What retention keeps of its own: the newest ``keep_last`` of its saves (as of the
        last one), those not replaced."""
        return [s for s in self.saved[-self.keep_last:] if s not in self.replaced]

    def _check(self) -> None:
        said = "\n".join(self.messages)
        for plant in self.plants:
            now = _snapshot(plant.path)
            if now != plant.snapshot:
                self.trial.deleted_foreign += 1
                self.trial.problems.append(f"{plant.path} was changed or deleted")
            if plant.said not in said:
                self.trial.unreported += 1
                self.trial.problems.append(f"nothing said about {plant.path}")
        for step in self._kept():
            location = self.root / step_name(step)
            try:
                with ucpformat.open(location) as ckpt:
                    same = differences(ckpt.to_dict(), small_state(step)) == []
            except UCPError:
                same = False
            if not same:
                self.trial.deleted_own += 1
                self.trial.problems.append(f"its own checkpoint {location} is gone or changed")


@dataclass
class Figures:
    trials: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    per_kind: dict[str, Counter[str]] = field(default_factory=dict)
    refusals: int = 0
    deleted_foreign: int = 0
    deleted_own: int = 0
    unreported: int = 0
    failed_trials: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, trial: Trial) -> None:
        self.trials += 1
        self.failed_trials += bool(trial.problems)
        self.outcomes[trial.outcome] += 1
        self.per_kind.setdefault(trial.kind, Counter())[trial.outcome] += 1
        self.refusals += trial.refusals
        self.deleted_foreign += trial.deleted_foreign
        self.deleted_own += trial.deleted_own
        self.unreported += trial.unreported
        self.failures.extend(f"{trial.kind}: {p}" for p in trial.problems)

    def as_dict(self) -> dict[str, Any]:
        return {
            "trials": self.trials,
            "refused": self.outcomes["refused"],
            "restored own": self.outcomes["restored own"],
            "restored foreign": self.outcomes["restored foreign"],
            "nothing restored": self.outcomes["nothing"],
            "deleted foreign": self.deleted_foreign,
            "deleted own": self.deleted_own,
            "unreported plants": self.unreported,
            "refusals along the way": self.refusals,
            "trials with any failed check": self.failed_trials,
            "outcomes per kind": {k: dict(v) for k, v in sorted(self.per_kind.items())},
        }


def run(trials: int, *, seed: int = 0, kinds: Sequence[str] = KINDS,
        progress: bool = False) -> Figures:
    """``trials`` rounds of every kind (``record-other-user`` only as root)."""
    rng = random.Random(seed)
    figures = Figures()
    kinds = [k for k in kinds if k != "record-other-user" or os.geteuid() == 0]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(trials):
            for kind in kinds:
                site = Path(tmp) / f"{i}-{kind}"
                site.mkdir()
                try:
                    figures.add(_Run(kind, site, rng).run())
                finally:
                    shutil.rmtree(site, ignore_errors=True)
            if progress and (i + 1) % 10 == 0:
                print(f"  round {i + 1}/{trials}: {len(figures.failures)} failed", flush=True)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.planted",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="rounds of every kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    figures = run(args.trials, seed=args.seed, kinds=args.kinds, progress=not args.json)
    out = figures.as_dict()
    out["seconds"] = round(time.perf_counter() - start, 1)
    print_figures("the manager under plantings (ucpformat.testing.planted)", out,
                  as_json=args.json)
    for line in figures.failures[:20]:
        print("FAILED:", line)
    return 0 if not figures.failures else 1


if __name__ == "__main__":
    sys.exit(main())
