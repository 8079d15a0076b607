"""Checkpoint management: save every N steps, keep the last K, restart from the newest valid.

::

    manager = CheckpointManager("runs/exp1", save_every=1000, keep_last=3)
    found = manager.latest_valid()            # (step, location) or None
    if found:
        state = manager.restore().to_dict()   # the newest checkpoint that is valid
    for step in range(start, steps):
        ...
        manager.maybe_save(step, lambda: make_state())           # core save
        # or, with PyTorch objects:
        manager.maybe_save(step, lambda path: ucpformat.torch.save(
            path, model=model, optimizer=opt, step=step))

Each checkpoint is its own location, ``<root>/step-<step, 10 digits>`` (a new location
per save, so readers of older ones are never disturbed: spec section 11.3). The rules:

- a new checkpoint is written completely and verified (it opens and validates) before
  anything old is deleted;
- after that, checkpoints older than the newest ``keep_last`` valid ones are deleted, and
  so are incomplete or invalid ones older than the new one (left by crashes); the newest
  valid checkpoint is never deleted, whatever ``keep_last`` is;
- a checkpoint is deleted by first removing its root ``zarr.json`` (UCP-1.0-R053), so that
  a crash half-way through a deletion leaves something every reader refuses, never a
  committed checkpoint with missing files;
- only what is a checkpoint, or the remains of a save, is deleted (``writer.delete_checkpoint``):
  a ``step-*`` entry that is a symbolic link, or a directory of other files, is left as it
  is with a :class:`CheckpointWarning`; nothing is ever read, written or deleted through a
  link;
- a save that fails removes what it wrote, and so do the remains of earlier interrupted
  saves then (every committed checkpoint stays), so that a full disk that frees up again
  finds nothing of the failed saves;
- :meth:`latest_valid` walks from the newest step down and skips, with a
  :class:`CheckpointWarning`, every location that is incomplete or fails validation
  (``deep=True`` also reads every chunk).

Works on local directories and on object stores (``s3://bucket/runs/exp1`` with
``storage_options``).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from ucpformat.errors import UCPError
from ucpformat.metadata import ZARR_JSON
from ucpformat.reader import Checkpoint, open_checkpoint
from ucpformat.storage import LocalStore, Store, open_store
from ucpformat.validation import validate
from ucpformat.writer import delete_checkpoint, save

_NAME = re.compile(r"^step-([0-9]{10,})$")

StateOrCallback = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | Callable[[str], Any]


class CheckpointWarning(UserWarning):
    """A checkpoint location was skipped (incomplete or invalid) or could not be removed."""


@dataclass(frozen=True)
class Entry:
    """One checkpoint location of a manager."""

    step: int
    location: str


class CheckpointManager:
    """Periodic saves into ``root``, rotation, and restart from the newest valid checkpoint.

    ``state_or_callback`` of :meth:`maybe_save` is a state mapping (saved with
    ``ucpformat.save``), a callable without arguments that returns one (called only when a
    save is due), or a callable that takes the location and writes a checkpoint there
    (``lambda path: ucpformat.torch.save(path, model=m, optimizer=o, step=s)``).
    ``save_kwargs`` go to ``ucpformat.save``. ``store_factory`` maps a location to the
    :class:`~ucpformat.storage.Store` used for it (default: ``open_store``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        save_every: int = 1,
        keep_last: int = 3,
        storage_options: Mapping[str, Any] | None = None,
        validate_deep: bool = False,
        store_factory: Callable[[str], Store] | None = None,
        **save_kwargs: Any,
    ) -> None:
        if save_every < 1 or keep_last < 1:
            raise ValueError("save_every and keep_last must be at least 1")
        self.root = os.fspath(root).rstrip("/")
        self.save_every = save_every
        self.keep_last = keep_last
        self.storage_options = dict(storage_options or {})
        self.validate_deep = validate_deep
        self.save_kwargs = save_kwargs
        self._store_factory = store_factory
        self.is_url = "://" in self.root and not self.root.startswith("file://")

    # -- locations ------------------------------------------------------------------------

    def location(self, step: int) -> str:
        if step < 0:
            raise ValueError("steps are non-negative")
        return f"{self.root}/step-{step:010d}"

    def store(self, location: str) -> Store:
        """The store of a location; on a file system, one that never follows the location if
        it is a symbolic link (the manager writes only real directories under its root)."""
        if self._store_factory is not None:
            return self._store_factory(location)
        if not self.is_url:
            local = location[len("file://") :] if location.startswith("file://") else location
            return LocalStore(local, follow_link=False)
        return open_store(location, storage_options=self.storage_options)

    def checkpoints(self) -> list[Entry]:
        """Every checkpoint location under ``root`` (committed or not), oldest first."""
        names: list[str]
        if self.is_url:
            import fsspec

            fs, path = fsspec.core.url_to_fs(self.root, skip_instance_cache=True,
                                             use_listings_cache=False, **self.storage_options)
            try:
                names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
            except FileNotFoundError:
                names = []
        else:
            try:
                names = os.listdir(self.root)
            except FileNotFoundError:
                names = []
        found = [(int(m.group(1)), n) for n in names if (m := _NAME.match(n))]
        return [Entry(step, f"{self.root}/{name}") for step, name in sorted(found)]

    # -- checking -------------------------------------------------------------------------

    def problem(self, location: str, *, deep: bool | None = None) -> str | None:
        """Why ``location`` is not a valid checkpoint, or None if it is one."""
        deep = self.validate_deep if deep is None else deep
        try:
            store = self.store(location)
            with open_checkpoint(store):
                pass
            report = validate(store, deep=deep)
        except UCPError as exc:
            return str(exc)
        if not report.valid:
            return "; ".join(str(i) for i in report.errors[:3])
        return None

    def latest_valid(self, *, deep: bool | None = None) -> Entry | None:
        """The newest checkpoint that opens and validates; skipped ones give a warning."""
        for entry in reversed(self.checkpoints()):
            why = self.problem(entry.location, deep=deep)
            if why is None:
                return entry
            warnings.warn(
                f"skipping checkpoint of step {entry.step} at {entry.location}: {why}",
                CheckpointWarning,
                stacklevel=2,
            )
        return None

    def restore(self, *, deep: bool | None = None, **open_kwargs: Any) -> Checkpoint | None:
        """Open the newest valid checkpoint (None if there is none); close it when done."""
        entry = self.latest_valid(deep=deep)
        if entry is None:
            return None
        return open_checkpoint(self.store(entry.location), **open_kwargs)

    # -- saving ---------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return step % self.save_every == 0

    def maybe_save(
        self, step: int, state_or_callback: StateOrCallback, *, force: bool = False
    ) -> Entry | None:
        """Save at ``step`` if it is due (or ``force``); then delete what rotation allows.

        Returns the new checkpoint, or None if no save was due. A location that already
        holds a valid checkpoint of this step is kept as it is (a warning says so); one
        that holds the remains of an interrupted save is written over. Errors of the save
        propagate, after which nothing has been deleted.
        """
        if not force and not self.should_save(step):
            return None
        location = self.location(step)
        store = self.store(location)
        if store.exists(ZARR_JSON) and self.problem(location) is None:
            warnings.warn(f"step {step} is already saved at {location}; kept as it is",
                          CheckpointWarning, stacklevel=2)
            return Entry(step, location)
        try:
            if _takes_location(state_or_callback):
                if not store.is_empty():
                    delete_checkpoint(store)  # the remains of an interrupted save
                cast(Callable[[str], Any], state_or_callback)(location)
            else:
                state = (
                    cast(Callable[[], Mapping[str, Any]], state_or_callback)()
                    if callable(state_or_callback)
                    else state_or_callback
                )
                # overwrite=True only replaces what is not a committed checkpoint here
                save(store, state, overwrite=True, **self.save_kwargs)
        except BaseException:
            self.remove_partial()  # this save's remains, and those of earlier ones
            raise
        why = self.problem(location)
        if why is not None:
            raise UCPError(f"the checkpoint just saved at {location} is not valid: {why}; "
                           "nothing was deleted")
        self.prune(newest=step)
        return Entry(step, location)

    def remove_partial(self) -> list[Entry]:
        """Delete every location that holds no committed checkpoint: the remains of saves
        that failed or were interrupted (every committed checkpoint stays, valid or not).
        Returns the deleted locations; one that cannot be deleted gives a warning."""
        deleted = []
        for entry in self.checkpoints():
            try:
                committed = self.store(entry.location).exists(ZARR_JSON)
            except (OSError, UCPError) as exc:
                warnings.warn(f"left {entry.location} as it is: {exc}", CheckpointWarning,
                              stacklevel=2)
                continue
            if not committed and self._delete(entry.location):
                deleted.append(entry)
        return deleted

    def prune(self, *, newest: int | None = None) -> list[Entry]:
        """Delete what rotation allows; returns the deleted locations.

        Only checkpoints older than the newest valid one are candidates: the ``keep_last``
        newest valid checkpoints stay, and so does anything newer than the newest valid
        one (a save may be in progress there).
        """
        entries = self.checkpoints()
        valid = [e for e in entries if self.problem(e.location, deep=False) is None]
        if not valid:
            return []
        newest_valid = valid[-1].step if newest is None else max(newest, valid[-1].step)
        keep = {e.step for e in valid[-self.keep_last :]}
        deleted = []
        for entry in entries:
            if entry.step >= newest_valid or entry.step in keep:
                continue
            if self._delete(entry.location):
                deleted.append(entry)
        return deleted

    def _delete(self, location: str) -> bool:
        """Delete a checkpoint or the remains of a save (un-committing first, UCP-1.0-R053);
        anything else is left as it is, with a warning. True if it was deleted."""
        try:
            delete_checkpoint(self.store(location))
        except (OSError, UCPError) as exc:
            warnings.warn(f"left {location} as it is: {exc}", CheckpointWarning, stacklevel=3)
            return False
        if not self.is_url:  # the emptied directory (rmdir never follows a link)
            with contextlib.suppress(OSError):
                os.rmdir(location[len("file://") :] if location.startswith("file://")
                         else location)
        return True


def _takes_location(fn: Any) -> bool:
    """True for a callback that takes the location (one positional parameter)."""
    if not callable(fn) or isinstance(fn, Mapping):
        return False
    import inspect

    try:
        params = [
            p for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


__all__ = ["CheckpointManager", "CheckpointWarning", "Entry"]
