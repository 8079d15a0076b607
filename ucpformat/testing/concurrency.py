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

Distributed saves (``--gloo-trials``) run the same trials with writers that are process
groups of two ranks over ``torch.distributed`` (gloo, on the CPU; the distributed save
pipeline of :mod:`ucpformat.distributed.pipeline`, :mod:`ucpformat.testing.gloo_writers`): in
``gloo`` mode two groups, each saving with :func:`~ucpformat.distributed.save_fragments`
or the DCP plugin (:class:`~ucpformat.torch.dcp.UCPWriter`), in turn; in ``gloo-single``
mode one group against one process saving with :func:`~ucpformat.checkpoint.writer.save`. There,
too, a trial that commits must commit exactly one writer's objects, every byte of them
(deep validation, SHA-256 digests), and no rank may hang (a group that does not answer
within a time limit is a failure). While a distributed save replaces a checkpoint
(``overwrite=True`` onto one), a reader in this process opens the location and reads
everything, again and again: each read must be the old checkpoint, a writer's whole
checkpoint or a refusal (a UCPError), never a mix.

Run ``python -m ucpformat.testing.concurrency --trials 100 --gloo-trials 100`` (``make
stress``); the test suite runs a quick mode.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucpformat.checkpoint.reader import open_checkpoint
from ucpformat.checkpoint.validation import validate
from ucpformat.checkpoint.writer import save
from ucpformat.errors import UCPError
from ucpformat.store import LocalStore, Store
from ucpformat.testing.common import SMALL_CHUNKING, differences, print_figures, small_state
from ucpformat.testing.faults import FaultyStore
from ucpformat.testing.gloo_writers import Answer, SaveOrder, WriterGroup, expected

#: Modes of two single-process writers.
MODES = ("proc", "thread", "s3")
#: Modes of distributed writers (process groups over gloo).
GLOO_MODES = ("gloo", "gloo-single")
#: The writers of a ``gloo`` trial (the first starts first), in turn.
GLOO_PAIRS = (("distributed", "distributed"), ("distributed", "dcp"), ("dcp", "distributed"),
              ("dcp", "dcp"))
#: The writers of a ``gloo-single`` trial, in turn.
GLOO_SINGLE_PAIRS = (("distributed", "single"), ("single", "distributed"), ("dcp", "single"),
                     ("single", "dcp"))
#: Seconds slept before each storage operation: a save of the small state takes ~0.1 s.
DELAY = 0.002


@dataclass
class Trial:
    mode: str
    overwrite: bool
    old: bool
    offset: float
    writers: tuple[str, str] = ("single", "single")  # gloo modes: see GLOO_PAIRS
    results: list[tuple[str, float, str]] = field(default_factory=list)  # (outcome, end, why)
    holds: str = ""  # writer-0 | writer-1 | old | nothing | MIXED | WRONG
    reads: Counter[str] = field(default_factory=Counter)  # old | new | refused | MIXED
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
    states = {"writer-0": small_state(seeds[0]), "writer-1": small_state(seeds[1])}
    if trial.old:
        states["old"] = small_state(old_seed)
    judge(trial, make_inner, states)
    try:  # and a later save can always write there (UCP-1.0-R049)
        save(make_inner(), small_state(seeds[0] + 1), overwrite=True, **SMALL_CHUNKING)
    except UCPError as exc:
        trial.problems.append(f"the location cannot be saved into any more: {exc}")


def judge(trial: Trial, make_inner: Callable[[], Store], states: dict[str, Any], *,
          deep: bool = False) -> None:
    """What the writers said (``trial.results``) against what the location holds: one
    of ``states`` (writer-0, writer-1, old) whole, or nothing a reader accepts; and, if
    ``deep``, a committed checkpoint must pass deep validation."""
    for outcome, _, why in trial.results:
        if outcome == "crashed":
            trial.problems.append(f"a writer failed with a non-UCP error: {why}")
        elif outcome == "refused" and "UCP-1.0-R059" not in why and "UCP-1.0-R053" not in why:
            trial.problems.append(f"a writer was refused for another reason: {why[:300]}")
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
    if deep and trial.holds.startswith("writer-"):
        report = validate(make_inner(), deep=True)
        if not report.valid:
            trial.problems.append(f"the committed checkpoint fails deep validation: "
                                  f"{[str(i) for i in report.errors[:2]]}")


# -- distributed writers -------------------------------------------------------------------


class GlooWriters:
    """The writer groups of the gloo modes, started when first needed: two groups of two
    ranks (``gloo``), one of them and one single process (``gloo-single``)."""

    def __init__(self, *, timeout: float = 60.0, setup: str = "") -> None:
        self.timeout = timeout
        self.setup = setup
        self._groups: dict[str, WriterGroup] = {}

    def group(self, name: str) -> WriterGroup:
        """``a`` and ``b`` (two ranks each), ``single`` (one process)."""
        if name not in self._groups:
            world = 1 if name == "single" else 2
            self._groups[name] = WriterGroup(world, timeout=self.timeout, setup=self.setup)
        return self._groups[name]

    def for_trial(self, trial: Trial) -> list[WriterGroup]:
        """The group that runs each writer of ``trial``."""
        if trial.mode == "gloo":
            return [self.group("a"), self.group("b")]
        return [self.group("single" if w == "single" else "a") for w in trial.writers]

    def close(self) -> None:
        for group in self._groups.values():
            group.close()
        self._groups.clear()


def _group_result(answers: Sequence[Answer]) -> tuple[str, float, str]:
    """One writer's result from its ranks' answers: theirs if they agree; ``hung`` if a
    rank gave none; ``crashed`` if they disagree (every rank must raise if one fails)."""
    outcomes = {a.outcome for a in answers}
    end = max(a.end for a in answers)
    why = next((a.why for a in answers if a.why), "")
    if "hung" in outcomes:
        return "hung", end, why
    if len(outcomes) > 1:
        return "crashed", end, f"the ranks disagree ({[a.outcome for a in answers]}): {why}"
    return outcomes.pop(), end, why


def _read_during(location: Path, states: Mapping[str, Any], stop: threading.Event,
                 trial: Trial) -> None:
    """Open ``location`` and read everything, again and again until ``stop``: each read
    is one of ``states`` (``old``, else ``new``), refused (a UCPError), or MIXED."""
    while not stop.is_set():
        try:
            with open_checkpoint(LocalStore(location, durable=False)) as ckpt:
                found = ckpt.to_dict()
        except UCPError:
            trial.reads["refused"] += 1
        except Exception as exc:  # a failure of the library
            trial.reads["crashed"] += 1
            trial.problems.append(f"a reader failed with a non-UCP error: "
                                  f"{type(exc).__name__}: {exc}")
        else:
            same = [name for name, state in states.items() if not differences(found, state)]
            trial.reads[("old" if same[0] == "old" else "new") if same else "MIXED"] += 1
        time.sleep(0.003)


def run_gloo_trial(trial: Trial, writers: GlooWriters, location: Path, rng: random.Random,
                   save_seconds: float) -> None:
    """Run the two writers of a gloo-mode ``trial`` (each a process group, or one process)
    into ``location``, a reader beside them if they replace a checkpoint, and judge."""
    seeds = [rng.randrange(10**6) for _ in range(2)]
    old_seed = rng.randrange(10**6)
    states = {f"writer-{i}": expected(w, seed)
              for i, (w, seed) in enumerate(zip(trial.writers, seeds, strict=True))}
    if trial.old:
        save(LocalStore(location, durable=False), small_state(old_seed), **SMALL_CHUNKING)
        states["old"] = small_state(old_seed)
    t0 = time.time() + 0.05
    starts = [t0, t0 + trial.offset * save_seconds]
    groups = writers.for_trial(trial)
    for writer, group, seed, start in zip(trial.writers, groups, seeds, starts, strict=True):
        group.send(SaveOrder(writer, str(location), seed, trial.overwrite, start, DELAY))
    stop = threading.Event()
    reader = threading.Thread(target=_read_during, args=(location, states, stop, trial),
                              daemon=True)
    if trial.old and trial.overwrite:
        reader.start()
    try:
        trial.results = [_group_result(group.collect()) for group in groups]
    finally:
        stop.set()
        if reader.is_alive():
            reader.join()
    for i, (outcome, _, why) in enumerate(trial.results):
        if outcome == "hung":
            trial.problems.append(f"writer {i} ({trial.writers[i]}) hung: {why[:300]}")
    if trial.reads["MIXED"]:
        trial.problems.append(f"{trial.reads['MIXED']} reads during the save saw a mix")

    def inner() -> Store:
        return LocalStore(location, durable=False)

    judge(trial, inner, states, deep=True)
    try:  # and a later save can always write there (UCP-1.0-R049)
        save(inner(), small_state(seeds[0] + 1), overwrite=True, **SMALL_CHUNKING)
    except UCPError as exc:
        trial.problems.append(f"the location cannot be saved into any more: {exc}")


def _gloo_duration(writers: GlooWriters, root: Path) -> float:
    """Seconds of a distributed save of two ranks (after one to warm the workers up)."""
    group = writers.group("a")
    for i in range(2):
        start = time.perf_counter()
        answers = group.save(SaveOrder("distributed", str(root / f"gloo-timing-{i}"), 0,
                                       delay=DELAY))
        if any(a.outcome != "saved" for a in answers):
            raise RuntimeError(f"a distributed save into a new location failed: {answers}")
    return time.perf_counter() - start


@dataclass
class Figures:
    trials: Counter[str] = field(default_factory=Counter)
    writers: Counter[str] = field(default_factory=Counter)
    holds: Counter[str] = field(default_factory=Counter)
    by_scenario: dict[str, Counter[str]] = field(default_factory=dict)
    reads: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)  # by the rule they name
    failures: list[str] = field(default_factory=list)

    def add(self, trial: Trial) -> None:
        onto = " onto a checkpoint" if trial.old else ""
        label = f"{trial.mode} overwrite={trial.overwrite}{onto}"
        if trial.mode in GLOO_MODES:
            label = f"{trial.mode} {'+'.join(trial.writers)} overwrite={trial.overwrite}{onto}"
        self.reads.update(trial.reads)
        for outcome, _, why in trial.results:
            if outcome == "refused":
                rules = [r for r in ("UCP-1.0-R059", "UCP-1.0-R053") if r in why]
                self.refusals[rules[0] if rules else "other"] += 1
        self.trials[label] += 1
        for outcome, _, _ in trial.results:
            self.writers[outcome] += 1
        self.holds[trial.holds] += 1
        saved = sum(outcome == "saved" for outcome, _, _ in trial.results)
        self.by_scenario.setdefault(label, Counter())[f"{saved} saved, holds {trial.holds}"] += 1
        if trial.problems:
            self.failures.append(f"{label} offset={trial.offset:.2f}: "
                                 f"{'; '.join(trial.problems)}")

    @property
    def one_saved(self) -> int:
        return sum(n for c in self.by_scenario.values() for k, n in c.items()
                   if k.startswith("1 saved"))

    @property
    def both_saved(self) -> int:
        return sum(n for c in self.by_scenario.values() for k, n in c.items()
                   if k.startswith("2 saved"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "trials": sum(self.trials.values()),
            "mixed checkpoints": self.holds["MIXED"],
            "wrong (not what the last 'saved' writer wrote)": self.holds["WRONG"],
            "trials with any failed check": len(self.failures),
            "writers (saved / refused / crashed / hung)": (
                f"{self.writers['saved']} / {self.writers['refused']} / "
                f"{self.writers['crashed']} / {self.writers['hung']}"
            ),
            "refused writers by the rule named": dict(sorted(self.refusals.items())),
            "trials with one writer saved (both saved: one after the other)": (
                f"{self.one_saved} ({self.both_saved})"),
            "reads during a distributed overwrite (old / new / refused / mixed / crashed)": (
                f"{self.reads['old']} / {self.reads['new']} / {self.reads['refused']} / "
                f"{self.reads['MIXED']} / {self.reads['crashed']}"
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
        gloo_trials: int = 0, gloo_modes: Sequence[str] = GLOO_MODES,
        progress: bool = False, s3_options: dict[str, Any] | None = None,
        gloo_timeout: float = 60.0, gloo_setup: str = "") -> Figures:
    """``trials`` trials, spread over ``modes`` and the overwrite/old scenarios (``s3``:
    against the server of ``s3_options``, or a local one started for the run), then
    ``gloo_trials`` spread over ``gloo_modes``, their writer pairs and the same scenarios
    (``gloo_timeout``: seconds a group may take to answer; ``gloo_setup``: see
    :class:`~ucpformat.testing.gloo_writers.WriterGroup`)."""
    rng = random.Random(seed)
    figures = Figures()

    def scenarios(of: Sequence[str]) -> list[tuple[str, bool, bool]]:
        return [(m, ow, old) for m in of for ow in (False, True)
                for old in ((False, True) if ow else (False,))]

    plain, gloo = scenarios(modes), scenarios(gloo_modes)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        duration = _local_duration(root) if trials else 0.0
        s3: Any = None
        options = s3_options or {}
        if trials and "s3" in modes and s3_options is None:
            from ucpformat.testing.s3 import s3_server

            s3 = s3_server()
            options = s3.__enter__()
        try:
            for i in range(trials):
                mode, overwrite, old = plain[i % len(plain)]
                trial = Trial(mode, overwrite, old, rng.uniform(0.0, 1.0))
                if mode == "s3":
                    from ucpformat.store.fsspec_store import FsspecStore
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
        if gloo_trials:
            _run_gloo(figures, gloo, gloo_trials, root, rng, progress=progress,
                      timeout=gloo_timeout, setup=gloo_setup)
    return figures


def _run_gloo(figures: Figures, scenarios: Sequence[tuple[str, bool, bool]], trials: int,
              root: Path, rng: random.Random, *, progress: bool, timeout: float, setup: str
              ) -> None:
    writers = GlooWriters(timeout=timeout, setup=setup)
    try:
        duration = _gloo_duration(writers, root)
        for i in range(trials):
            mode, overwrite, old = scenarios[i % len(scenarios)]
            pairs = GLOO_PAIRS if mode == "gloo" else GLOO_SINGLE_PAIRS
            # the second writer starts within the first half of the first's save
            trial = Trial(mode, overwrite, old, rng.uniform(0.0, 0.5),
                          pairs[(i // len(scenarios)) % len(pairs)])
            run_gloo_trial(trial, writers, root / f"g{i}", rng, duration)
            figures.add(trial)
            if progress and (i + 1) % 10 == 0:
                print(f"  {i + 1}/{trials} distributed trials, {len(figures.failures)} failed",
                      flush=True)
    finally:
        writers.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucpformat.testing.concurrency",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="*", default=["proc", "thread", "s3"], choices=MODES)
    parser.add_argument("--gloo-trials", type=int, default=0,
                        help="trials of distributed writers (process groups over gloo)")
    parser.add_argument("--gloo-modes", nargs="*", default=list(GLOO_MODES),
                        choices=GLOO_MODES)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    figures = run(args.trials, seed=args.seed, modes=args.modes, gloo_trials=args.gloo_trials,
                  gloo_modes=args.gloo_modes, progress=not args.json)
    out = figures.as_dict()
    out["seconds"] = round(time.perf_counter() - start, 1)
    print_figures("concurrent writers (ucpformat.testing.concurrency)", out, as_json=args.json)
    for line in figures.failures[:20]:
        print("FAILED:", line)
    return 0 if not figures.failures else 1


if __name__ == "__main__":
    sys.exit(main())
