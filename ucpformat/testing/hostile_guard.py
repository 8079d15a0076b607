"""The guard of the hostile-input harness (:mod:`ucpformat.testing.hostile`): every read of
a hostile checkpoint must end in a :class:`~ucpformat.errors.UCPError` or a result, within
a time and memory bound, reading no file outside the checkpoint (:func:`exercise`).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import ucpformat
from ucpformat.checkpoint.metadata import ZARR_JSON
from ucpformat.checkpoint.reader import open_checkpoint
from ucpformat.checkpoint.validation import validate
from ucpformat.errors import UCPError
from ucpformat.store import Store
from ucpformat.testing.common import OutsideWatch

#: Readers get this limit: a hostile input must never make them allocate much more.
LIMIT = 8 << 20
#: Traced allocation allowed beyond LIMIT (thread pools, JSON documents, interpreter).
MARGIN = 24 << 20
#: Seconds one example may take.
TIME_LIMIT = 20.0
#: The CLI (which reads with its default limits, 256 MiB of metadata) runs on roots up to
#: this size; larger hostile roots are for the library's readers, which get LIMIT.
CLI_ROOT_BYTES = 32 << 10


class HostileInputFailure(AssertionError):
    """A reader broke a safety property on a generated input."""




class _Audit:
    """Records files opened while armed (the hook cannot be removed, only disarmed)."""

    installed = False
    armed: Guard | None = None

    @classmethod
    def install(cls) -> None:
        if not cls.installed:
            sys.addaudithook(cls.hook)
            cls.installed = True

    @classmethod
    def hook(cls, event: str, args: tuple[Any, ...]) -> None:
        guard = cls.armed
        if guard is None or event not in ("open", "os.listdir", "os.scandir", "os.remove",
                                          "os.rename", "os.rmdir", "os.mkdir", "os.symlink",
                                          "shutil.rmtree", "os.truncate"):
            return
        target = args[0] if args else None
        if isinstance(target, int) or target is None:
            return
        guard.check_path(event, target, args)


_LIBRARY_ROOTS = tuple(
    os.path.realpath(p)
    for p in {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(ucpformat.__file__)),
              # the process's own memory limits (reader.physical_memory bounds allocations
              # by them): read, never written, and named by no checkpoint
              "/sys/fs/cgroup", "/proc/self"}
)


@dataclass
class Guard:
    """Arms the checks for one example on the checkpoint at ``root``."""

    root: Path
    limit: int = LIMIT
    time_limit: float = TIME_LIMIT
    violations: list[str] = field(default_factory=list)

    def check_path(self, event: str, target: Any, args: tuple[Any, ...]) -> None:
        try:
            name = os.fsdecode(target)
        except (TypeError, ValueError):
            return
        if not os.path.isabs(name):
            # opened relative to a directory descriptor (the local store opens every path
            # component by component without following links, UCP-1.0-R089): the hook
            # cannot place it; the link target's watch (inotify) sees any access outside
            return
        path = os.path.realpath(name)
        root = os.path.realpath(self.root)
        inside = path == root or path.startswith(root + os.sep)
        if inside:
            return
        writing = event not in ("open", "os.listdir", "os.scandir") or (
            event == "open" and len(args) > 1 and isinstance(args[1], str)
            and any(c in args[1] for c in "wax+")
        )
        if event == "open" and len(args) > 2 and isinstance(args[2], int):
            writing = writing or bool(args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        library = any(path == r or path.startswith(r + os.sep) for r in _LIBRARY_ROOTS)
        if writing or not library:
            self.violations.append(f"{event} {path} (outside the checkpoint)")

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        _Audit.install()
        tracemalloc.start()
        tracemalloc.reset_peak()
        use_alarm = threading.current_thread() is threading.main_thread()
        previous: Any = None
        if use_alarm:

            def on_alarm(signum: int, frame: FrameType | None) -> None:
                raise HostileInputFailure(f"no answer within {self.time_limit} s (a hang)")

            previous = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.time_limit)
        _Audit.armed = self
        start = time.monotonic()
        try:
            yield
        finally:
            _Audit.armed = None
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        elapsed = time.monotonic() - start
        if peak > self.limit + MARGIN:
            self.violations.append(
                f"allocated {peak} bytes at peak, over {self.limit} + {MARGIN} (UCP-1.0-R090)"
            )
        if elapsed > self.time_limit:
            self.violations.append(f"took {elapsed:.1f} s")
        if self.violations:
            raise HostileInputFailure("; ".join(self.violations))


def exercise(root: Path, *, limit: int = LIMIT, store: Store | None = None,
             opened: list[bool] | None = None) -> list[str]:
    """Run every reader on ``root``; return the errors (UCPError) met, raise on anything else.

    The readers are ``open`` and a read of every tensor, ``validate`` and
    ``validate(deep=True)`` (through ``store`` if given: one that fails as the operating
    system can), and ``ucp inspect --json`` and ``ucp validate --json`` writing to a strict
    UTF-8 stream, which must exit 0, 1 or 2 with no internal error. ``opened`` receives
    whether ``open`` succeeded.
    """
    outcomes: list[str] = []
    guard = Guard(root, limit)
    location: Path | Store = root if store is None else store
    with guard.armed():
        try:
            with open_checkpoint(location, max_read_bytes=limit, workers=1) as ckpt:
                if opened is not None:
                    opened.append(True)
                for path in list(ckpt.arrays):
                    try:
                        ckpt[path].read()
                    except UCPError as exc:
                        outcomes.append(_describe(exc))
                for group in ckpt.groups:
                    try:
                        ckpt.values(group)
                    except UCPError as exc:
                        outcomes.append(_describe(exc))
                ckpt.metadata  # noqa: B018 - decoding it is the point
        except UCPError as exc:
            outcomes.append(_describe(exc))
        # deep validation runs every shallow check first
        report = validate(location, deep=True, max_read_bytes=limit, workers=1)
        outcomes.extend(f"{i.rule} {i.path}: {i.message}" for i in report.errors)
        if store is None and (root / ZARR_JSON).is_file() and (
                (root / ZARR_JSON).stat().st_size <= CLI_ROOT_BYTES):
            _run_cli(root)
    return outcomes


def exercise_watching(root: Path, outside: Path) -> list[str]:
    """:func:`exercise`, failing if anything under ``outside`` is opened or changed, as the
    kernel reports it (inotify, where there is one)."""
    if not OutsideWatch.available():
        return exercise(root)
    with OutsideWatch(outside) as watch:
        outcomes = exercise(root)
        touched = watch.events()
    if touched:
        raise HostileInputFailure(f"files outside the checkpoint were touched: {touched[:3]}")
    return outcomes


def _run_cli(root: Path) -> None:
    """``ucp inspect --json`` and ``ucp validate --json``, as a pipe would take their output
    (strict UTF-8): exit 0, 1 or 2, and never an internal error (UCP-1.0-R006, UCP-1.0-R097)."""
    from ucpformat.cli import main as ucp

    for argv in (["inspect", "--json", str(root)], ["validate", "--json", str(root)]):
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        err = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = ucp(argv)
            out.flush()
        if code not in (0, 1, 2) or "internal error" in err.getvalue():
            raise HostileInputFailure(f"ucp {argv[0]}: exit {code}: {err.getvalue()[:300]}")


def _describe(exc: UCPError) -> str:
    if not exc.message:
        raise HostileInputFailure(f"{type(exc).__name__} without a message")
    return f"{exc.rule} {exc}"


