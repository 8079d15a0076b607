"""Checkpoint management: periodic, asynchronous and preemption saves, retention, restart.

::

    manager = CheckpointManager("runs/exp1", save_every=1000, keep_last=3,
                                keep_best=2, best_metric="loss", best_mode="min",
                                keep_every=10_000, save_on_preemption=True)
    step = manager.latest_step()                   # newest valid step, or None
    if step is not None:                           # ucpt: ucpformat.torch
        ucpt.load(manager.location(step), model=model, optimizer=opt)
    for step in range(start, steps):
        ...
        manager.maybe_save(step, lambda path: ucpt.save_async(
            path, model=model, optimizer=opt, step=step), metrics={"loss": loss})
        if manager.reached_preemption(step):
            break
    manager.close()                                 # waits for the last save

Each checkpoint is its own location, ``<root>/step-<step, 10 digits>`` (a new location
per save, so readers of older ones are never disturbed: spec section 11.3); one
formatter (:func:`step_name`) and one parser (:func:`parse_step_name`) agree, and a
``step-*`` name the formatter would not write is ignored with a warning. The rules
(docs/manager.md says more):

- the manager knows which checkpoints it wrote: its record, ``<root>/ucp-manager.json``,
  holds each one's name and the SHA-256 of its root ``zarr.json``. Restoring, counting
  and rotation see only the checkpoints of the record whose root is still the one
  recorded; anything else under the root (a planted checkpoint, a checkpoint replaced
  at one of its names, a link, an odd name) is never restored, counted or deleted, and a
  :class:`CheckpointWarning` says so. A record that changed since this manager wrote it,
  that another user owns, or (with ``record_key``) whose HMAC does not verify, is refused
  with :class:`~ucpformat.errors.ManagerRecordError`; :meth:`CheckpointManager.adopt`
  takes a checkpoint the manager did not write into its record, explicitly;

- a new checkpoint is committed and verified (it opens and validates) before anything old
  is deleted, and only then is its step recorded (:meth:`all_steps`, the metrics); a save
  callback that returns a future (``save_async``, DCP's ``async_save``) is tracked: the
  manager waits for it at the next save, :meth:`wait_until_finished` or :meth:`close`;
- retention keeps the newest ``keep_last`` valid checkpoints, the ``keep_best`` best by
  ``best_metric`` among those saved with metrics, every committed checkpoint whose step is
  a multiple of ``keep_every``, and always the newest valid one; everything else older
  than the newest valid checkpoint is deleted, incomplete remains included;
- a checkpoint is deleted by first removing its root ``zarr.json`` (UCP-1.0-R053), and
  only what is a checkpoint, or the remains of a save, is deleted
  (``commit.delete_checkpoint``): a ``step-*`` link or a directory of other files is left
  as it is with a :class:`CheckpointWarning`; nothing is read, written or deleted through
  a link;
- a save that fails removes what it wrote, and the remains of earlier interrupted saves;
- ``save_on_preemption=True`` turns SIGTERM into one save at the next :meth:`maybe_save`;
- with a ``comm`` (several ranks saving one checkpoint together), the ranks agree on
  preemption saves and rank 0 alone verifies, records and deletes.

Works on local directories and on object stores (``s3://bucket/runs/exp1`` with
``storage_options``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, cast

from ucpformat.checkpoint.commit import delete_checkpoint
from ucpformat.checkpoint.manager_record import (
    MAX_RECORD_BYTES,
    METRICS_SUFFIX,
    RECORD_FORMAT,
    RECORD_KEY,
    parse_record,
    parse_step_name,
    record_mac,
    step_name,
)
from ucpformat.checkpoint.metadata import ZARR_JSON
from ucpformat.checkpoint.reader import (
    MAX_METADATA_BYTES,
    Checkpoint,
    open_checkpoint,
    read_metadata,
)
from ucpformat.checkpoint.validation import validate
from ucpformat.checkpoint.writer import save
from ucpformat.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidValueError,
    ManagerRecordError,
    UCPError,
    WriteError,
)
from ucpformat.store import LocalStore, Store, open_store

if TYPE_CHECKING:  # the distributed layer sits above this one (docs/architecture.md)
    from ucpformat.distributed.comm import Communicator

StateOrCallback = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | Callable[[str], Any]


class CheckpointWarning(UserWarning):
    """A checkpoint location was skipped (incomplete or invalid) or could not be removed."""


@dataclass(frozen=True)
class Entry:
    """One checkpoint location of a manager."""

    step: int
    location: str


@dataclass
class _Pending:
    """An asynchronous save in flight: its future, and what to record once it commits."""

    step: int
    location: str
    future: Any
    metrics: bytes | None  # the encoded metrics


class CheckpointManager:
    """Periodic saves into ``root``, retention, and restart from the newest valid checkpoint.

    ``state_or_callback`` of :meth:`maybe_save` is a state mapping (saved with
    ``ucpformat.save``), a callable without arguments that returns one (called only when a
    save is due), or a callable that takes the location and writes a checkpoint there
    (``lambda path: ucpformat.torch.save(path, model=m, optimizer=o, step=s)``); if it
    returns a future (``ucpformat.torch.save_async``), the save is tracked until it commits.
    ``save_kwargs`` go to ``ucpformat.save``. ``store_factory`` maps a location to the
    :class:`~ucpformat.store.Store` used for it (default: ``open_store``).

    Retention: ``keep_last`` newest valid checkpoints, the ``keep_best`` best ones by
    ``best_metric`` (a key of the ``metrics`` given to :meth:`maybe_save`, or a function of
    them; ``best_mode`` "max" or "min"), every step that is a multiple of ``keep_every``,
    and the newest valid one, always. ``save_on_preemption=True`` installs a SIGTERM
    handler (from the main thread; :meth:`close` restores the previous one): after the
    signal, the next :meth:`maybe_save` saves whether due or not, once, and
    :meth:`reached_preemption` says to stop. ``comm`` (a
    :class:`~ucpformat.distributed.comm.Communicator`, e.g. ``ucpformat.torch.comm.communicator()``)
    is for saves that all ranks make together: the ranks agree on preemption saves and
    rank 0 alone verifies, records metrics and deletes.

    The manager restores, counts and deletes only what it wrote: its record
    (:data:`RECORD_KEY` under ``root``) names each checkpoint with the SHA-256 of its
    root; ``record_key`` (bytes or str, kept outside the root) signs the record with an
    HMAC, so that a record rewritten by anyone without the key is refused after a restart
    too (docs/manager.md).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        save_every: int = 1,
        keep_last: int = 3,
        keep_best: int = 0,
        best_metric: str | Callable[[Mapping[str, Any]], float] | None = None,
        best_mode: Literal["max", "min"] = "max",
        keep_every: int | None = None,
        save_on_preemption: bool = False,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        comm: Communicator | None = None,
        storage_options: Mapping[str, Any] | None = None,
        validate_deep: bool = False,
        store_factory: Callable[[str], Store] | None = None,
        record_key: bytes | str | None = None,
        **save_kwargs: Any,
    ) -> None:
        if save_every < 1 or keep_last < 1:
            raise ValueError("save_every and keep_last must be at least 1")
        if keep_best < 0 or (keep_best and best_metric is None):
            raise ValueError("keep_best is a count (0 or more) and needs a best_metric")
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode is 'max' or 'min', not {best_mode!r}")
        if keep_every is not None and keep_every < 1:
            raise ValueError("keep_every must be at least 1 (or None)")
        self.root = os.fspath(root).rstrip("/")
        self.save_every = save_every
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.keep_every = keep_every
        self.comm = comm
        self.storage_options = dict(storage_options or {})
        self.validate_deep = validate_deep
        self.save_kwargs = save_kwargs
        self._store_factory = store_factory
        self.is_url = "://" in self.root and not self.root.startswith("file://")
        self._pending: _Pending | None = None
        self._verified: set[int] = set()  # steps this manager found valid
        self._record_key = (record_key.encode() if isinstance(record_key, str)
                            else record_key)
        self._record_bytes: bytes | None = None  # the record as this manager last wrote it
        self._warned: set[str] = set()  # names a warning was given for
        self._metrics: dict[int, dict[str, Any] | None] = {}  # metrics read or written
        self._preemption_requested = False  # set by the handler
        self._preemption_step: int | None = None  # the step of the preemption save
        self._previous_handlers: dict[int, Any] = {}
        self.save_on_preemption = save_on_preemption
        if save_on_preemption and preemption_signals:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError("save_on_preemption=True with preemption_signals needs the "
                                 "manager to be made in the main thread (only it can install "
                                 "a signal handler); pass preemption_signals=() and call "
                                 "request_preemption() instead")
            for signum in preemption_signals:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    @property
    def primary(self) -> bool:
        """True on the rank that verifies, records and deletes (rank 0, or no ``comm``)."""
        return self.comm is None or self.comm.rank == 0

    # -- locations ------------------------------------------------------------------------

    def location(self, step: int) -> str:
        """Where the checkpoint of ``step`` is: ``<root>/`` and :func:`step_name`."""
        return f"{self.root}/{step_name(step)}"

    def store(self, location: str) -> Store:
        """The store of a location; on a file system, one that never follows the location if
        it is a symbolic link (the manager writes only real directories under its root)."""
        if self._store_factory is not None:
            return self._store_factory(location)
        if not self.is_url:
            return LocalStore(_local(location), follow_link=False)
        return open_store(location, storage_options=self.storage_options)

    def _root_store(self) -> Store:
        """The store of ``root`` itself, which holds the metrics objects."""
        if self._store_factory is not None:
            return self._store_factory(self.root)
        if not self.is_url:
            return LocalStore(_local(self.root))
        return open_store(self.root, storage_options=self.storage_options)

    def _names(self) -> list[str]:
        """The names directly under ``root``."""
        if self.is_url:
            import fsspec

            fs, path = fsspec.core.url_to_fs(self.root, skip_instance_cache=True,
                                             use_listings_cache=False, **self.storage_options)
            try:
                return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
            except FileNotFoundError:
                return []
        try:
            return os.listdir(_local(self.root))
        except FileNotFoundError:
            return []

    def checkpoints(self) -> list[Entry]:
        """Every checkpoint location under ``root`` (committed or not, written by this
        manager or not), oldest first; a ``step-*`` name that :func:`step_name` would not
        write is left out, with a warning."""
        return self._entries(self._names())

    def _entries(self, names: list[str]) -> list[Entry]:
        found = []
        for name in names:
            step = parse_step_name(name)
            if step is not None:
                found.append((step, name))
            elif (name.startswith("step-") and not name.endswith(METRICS_SUFFIX)
                  and "." not in name):
                self._warn_once(name, f"ignored {self.root}/{name}: not a name this manager "
                                      "writes (step- and at least 10 digits, no other "
                                      "leading zeros)")
        return [Entry(step, f"{self.root}/{name}") for step, name in sorted(found)]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, CheckpointWarning, stacklevel=4)

    # -- the record of the checkpoints this manager wrote ---------------------------------

    def _record_where(self) -> str:
        return f"{self.root}/{RECORD_KEY}"

    def record(self) -> dict[str, dict[str, Any]]:
        """The manager's record: location name -> ``{"step", "state", "root_sha256"}``
        (``state`` is ``"saving"`` from before a save starts until it is recorded
        ``"saved"`` with the SHA-256 of its root ``zarr.json``). Refused with
        :class:`~ucpformat.errors.ManagerRecordError` if it cannot be trusted."""
        where = self._record_where()
        store = self._root_store()
        try:
            body = read_metadata(store, RECORD_KEY, limit=MAX_RECORD_BYTES,
                                 what="the manager's record")
        except UCPError as exc:
            raise ManagerRecordError(f"the record cannot be read: {exc.message}",
                                     path=where) from exc
        except OSError as exc:
            raise ManagerRecordError(f"the record cannot be read: {exc}", path=where) from exc
        if self._record_bytes is not None and body != self._record_bytes:
            raise ManagerRecordError(
                "the record changed since this manager wrote it (another manager on this "
                "root, or a planted record): refused; nothing was restored or deleted "
                "(a new CheckpointManager reads it as it is now)", path=where)
        if body is None:
            return {}
        if not self.is_url:
            try:
                owner = os.stat(_local(where), follow_symlinks=False).st_uid
            except OSError as exc:
                raise ManagerRecordError(f"the record cannot be read: {exc}",
                                         path=where) from exc
            if owner != os.geteuid():
                raise ManagerRecordError(
                    f"the record belongs to user {owner}, not to this process's user "
                    f"{os.geteuid()}: not written by this manager; refused", path=where)
        entries = parse_record(body, self._record_key, where)
        if self.primary:
            self._record_bytes = body  # from now on, only this manager changes it
        return entries

    def _write_record(self, entries: Mapping[str, Mapping[str, Any]]) -> None:
        """Write the record (atomically, never through a link)."""
        doc: dict[str, Any] = {"format": RECORD_FORMAT,
                               "checkpoints": {k: dict(entries[k]) for k in sorted(entries)}}
        if self._record_key is not None:
            doc["hmac_sha256"] = record_mac(doc, self._record_key)
        body = json.dumps(doc, sort_keys=True, indent=1).encode()
        try:
            self._root_store().put(RECORD_KEY, [body], atomic=True)
        except OSError as exc:
            raise WriteError(f"the manager's record cannot be written: {exc}",
                             path=self._record_where()) from exc
        self._record_bytes = body

    def _update_record(self, name: str, entry: Mapping[str, Any] | None) -> None:
        entries = self.record()
        if entry is None:
            if name not in entries:
                return
            entries.pop(name)
        else:
            entries[name] = dict(entry)
        self._write_record(entries)

    def _root_sha256(self, location: str) -> str | None:
        """The SHA-256 of the root zarr.json at ``location`` (None: no commit there)."""
        raw = read_metadata(self.store(location), ZARR_JSON, limit=MAX_METADATA_BYTES,
                            what="the root zarr.json")
        return None if raw is None else hashlib.sha256(raw).hexdigest()

    def foreign(self, entry: Entry, record: Mapping[str, Mapping[str, Any]] | None = None
                ) -> str | None:
        """Why the committed checkpoint at ``entry`` is not one this manager wrote (None if
        it is: its record holds the name, saved, with this root's SHA-256)."""
        record = self.record() if record is None else record
        name = entry.location.rsplit("/", 1)[-1]
        own = record.get(name)
        if own is None or own.get("state") != "saved":
            return (f"not written by this manager (its record, {self._record_where()}, has "
                    "no such checkpoint)")
        try:
            digest = self._root_sha256(entry.location)
        except (OSError, UCPError) as exc:
            return f"its root cannot be read: {exc}"
        if digest != own.get("root_sha256"):
            return ("not the checkpoint this manager wrote there: its root zarr.json differs "
                    "from the one recorded (replaced?)")
        return None

    def _own_entries(self, record: Mapping[str, Mapping[str, Any]] | None = None
                     ) -> tuple[list[Entry], list[Entry]]:
        """The committed checkpoints under root this manager wrote, and the others (each of
        which gets a warning, once), oldest first."""
        record = self.record() if record is None else record
        own, others = [], []
        for entry in self.checkpoints():
            if self._pending is not None and entry.step == self._pending.step:
                continue  # being written
            if not self._committed(entry.location):
                if entry.location.rsplit("/", 1)[-1] not in record:
                    self._warn_once(entry.location, f"left {entry.location} as it is: no "
                                                    "checkpoint, and no save this manager made")
                continue
            why = self.foreign(entry, record)
            if why is None:
                own.append(entry)
            else:
                others.append(entry)
                self._warn_once(entry.location, f"ignored checkpoint of step {entry.step} at "
                                                f"{entry.location}: {why}; it is never "
                                                "restored, counted or deleted by this manager "
                                                "(adopt() takes it)")
        return own, others

    def adopt(self, step: int) -> Entry:
        """Take the checkpoint of ``step``, which this manager did not write (one of an
        earlier version without a record, say), into its record: from now on it is
        restored, counted and rotated as its own. It must be valid."""
        location = self.location(step)
        why = self.problem(location)
        if why is not None:
            raise CheckpointNotFoundError(f"no valid checkpoint of step {step} to adopt: {why}",
                                          path=location)
        digest = self._root_sha256(location)
        self._update_record(step_name(step), {"step": step, "state": "saved",
                                              "root_sha256": digest})
        self._verified.add(step)
        return Entry(step, location)

    def _committed(self, location: str) -> bool:
        """True if ``location`` holds a root ``zarr.json`` (a commit, valid or not)."""
        try:
            return self.store(location).exists(ZARR_JSON)
        except (OSError, UCPError):
            return False

    # -- checking and restoring -----------------------------------------------------------

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
        """The newest checkpoint this manager wrote that opens and validates; skipped ones
        (and checkpoints it did not write) give a warning."""
        own, _ = self._own_entries()
        for entry in reversed(own):
            why = self.problem(entry.location, deep=deep)
            if why is None:
                return entry
            warnings.warn(
                f"skipping checkpoint of step {entry.step} at {entry.location}: {why}",
                CheckpointWarning,
                stacklevel=2,
            )
        return None

    def latest_step(self, *, deep: bool | None = None) -> int | None:
        """The step of the newest valid checkpoint, or None (a finished async save counts)."""
        self._poll()
        entry = self.latest_valid(deep=deep)
        return None if entry is None else entry.step

    def all_steps(self) -> list[int]:
        """The steps of every committed checkpoint this manager wrote, oldest first (an
        async save in flight is not one yet; :meth:`latest_step` also validates)."""
        self._poll()
        return [e.step for e in self._own_entries()[0]]

    def restore(
        self, step: int | None = None, *, deep: bool | None = None, **open_kwargs: Any
    ) -> Checkpoint | None:
        """Open the checkpoint of ``step`` (refused with CheckpointNotFoundError unless it
        is valid), or the newest valid one (None if there is none); close it when done."""
        self._poll()
        if step is None:
            entry = self.latest_valid(deep=deep)
            if entry is None:
                return None
            location = entry.location
        else:
            location = self.location(step)
            why = self.problem(location, deep=deep)
            if why is None:
                why = self.foreign(Entry(step, location))
            if why is not None:
                raise CheckpointNotFoundError(f"no valid checkpoint of step {step}: {why}",
                                              path=location)
        return open_checkpoint(self.store(location), **open_kwargs)

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics the checkpoint of ``step`` was saved with (None if none were given,
        or they cannot be read: a warning says why)."""
        if step in self._metrics:
            return self._metrics[step]
        key = _metrics_key(step)
        try:
            body = self._root_store().get(key)
            value = None if body is None else json.loads(body)
            if value is not None and not isinstance(value, dict):
                raise ValueError("not a JSON object")
            self._metrics[step] = value
            return value
        except (OSError, UCPError, ValueError) as exc:
            warnings.warn(f"the metrics of step {step} ({self.root}/{key}) cannot be read: "
                          f"{exc}", CheckpointWarning, stacklevel=2)
            return None

    # -- saving ---------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True if a save is due at ``step`` (not counting preemption)."""
        return step % self.save_every == 0

    def reached_preemption(self, step: int) -> bool:
        """True once the save after a SIGTERM has been made (at ``step`` or before): the
        training loop should stop, then call :meth:`close`."""
        return self._preemption_step is not None and step >= self._preemption_step

    def maybe_save(
        self,
        step: int,
        state_or_callback: StateOrCallback,
        *,
        force: bool = False,
        metrics: Mapping[str, Any] | None = None,
    ) -> Entry | None:
        """Save at ``step`` if it is due (or ``force``, or after a SIGTERM); then, once the
        save has committed and verifies, record ``metrics`` and delete what retention allows.

        Returns the new checkpoint (for an asynchronous save, where it is being written),
        or None if no save was due. The previous asynchronous save is waited for first
        (its error raised, after its remains are removed). A location that already holds a
        valid checkpoint of this step is kept as it is (a warning says so); one that holds
        the remains of an interrupted save is written over. Errors of the save propagate,
        after which nothing has been deleted.
        """
        body = _encode_metrics(metrics, self.location(step))
        preempt = (self.save_on_preemption and self._preemption_step is None
                   and self._agree(self._preemption_requested))
        if not (force or preempt or self.should_save(step)):
            self._poll()
            return None
        self.wait_until_finished()
        location = self.location(step)
        store = self.store(location)
        takes_location = _takes_location(state_or_callback)
        if self.comm is not None and not takes_location:
            raise ValueError("with comm, the state is saved by a callback that every rank "
                             "calls with the location (e.g. ucpformat.torch.save_async)")
        failure: UCPError | None = None
        try:
            decision = self._before_save(step, location, store) if self.primary else ""
        except UCPError as exc:  # a record that cannot be trusted, or not be written
            if isinstance(exc, WriteError):  # no save began: the remains of earlier ones
                self._clean_up_after_failure()
            if self.comm is None:
                raise
            failure, decision = exc, f"failed: {exc}"
        if self.comm is not None:  # every rank learns rank 0's decision (none waits alone)
            decision = str(self.comm.allgather(decision)[0])
            if failure is not None:
                raise failure
            if decision.startswith("failed: "):
                raise UCPError(f"rank 0 refused the save: {decision[len('failed: '):]}",
                               path=location)
        if decision == "kept":
            warnings.warn(f"step {step} is already saved at {location}; kept as it is",
                          CheckpointWarning, stacklevel=2)
            return Entry(step, location)
        if decision.startswith("refused:"):
            raise CheckpointExistsError(decision[len("refused:"):].strip(), rule="UCP-1.0-R053",
                                        path=location)
        try:
            if takes_location:
                if self.primary and not store.is_empty():
                    delete_checkpoint(store)  # the remains of this manager's interrupted save
                if self.comm is not None:
                    self.comm.barrier()
                result = cast(Callable[[str], Any], state_or_callback)(location)
            else:
                state = (
                    cast(Callable[[], Mapping[str, Any]], state_or_callback)()
                    if callable(state_or_callback)
                    else state_or_callback
                )
                # overwrite=True only replaces what is not a committed checkpoint here
                save(store, state, overwrite=True, **self.save_kwargs)
                result = None
        except BaseException:
            if self.primary:
                self._clean_up_after_failure()  # this save's remains, and earlier ones'
            raise
        if preempt:
            self._preemption_step = step
        future = _future_of(result)
        if future is not None:
            self._pending = _Pending(step, location, future, body)
        else:
            self._record(step, location, body)
        return Entry(step, location)

    def _before_save(self, step: int, location: str, store: Store) -> str:
        """On the primary rank, before a save: "kept" (this manager's valid checkpoint of
        ``step`` is there), "refused: why" (something this manager did not write is
        there), or "" (save; the record now says a save of ``step`` is under way)."""
        name = step_name(step)
        record = self.record()
        own = record.get(name)
        try:
            empty = store.is_empty()
            committed = not empty and store.exists(ZARR_JSON)
        except (OSError, UCPError) as exc:
            return f"refused: {location} cannot be read: {exc}; nothing was saved"
        if committed:
            why = self.foreign(Entry(step, location), record)
            if why is None and self.problem(location) is None:
                return "kept"
            if why is not None and not (own is not None and own["state"] == "saving"):
                return (f"refused: {location} holds a checkpoint {why}; it is left as it is "
                        "and nothing was saved (move it away, or adopt() it)")
        elif not empty and own is None:
            return (f"refused: {location} holds files this manager did not write; they are "
                    "left as they are and nothing was saved")
        self._update_record(name, {"step": step, "state": "saving", "root_sha256": None})
        return ""

    def wait_until_finished(self) -> Entry | None:
        """Wait for the asynchronous save in flight, if any, then verify it, record it and
        delete what retention allows; its checkpoint (None if there was none). A failed
        save raises its error here, after its remains are removed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.future.result()
        except BaseException:
            if self.primary:
                self._clean_up_after_failure()
            raise
        self._record(pending.step, pending.location, pending.metrics)
        return Entry(pending.step, pending.location)

    def close(self) -> None:
        """Wait for the last save (:meth:`wait_until_finished`) and give the preemption
        signals back to the handlers they had before."""
        try:
            self.wait_until_finished()
        finally:
            for signum, previous in self._previous_handlers.items():
                signal.signal(signum, previous)
            self._previous_handlers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _poll(self) -> None:
        """Finish the asynchronous save in flight if it is done (never waits)."""
        if self._pending is not None and self._pending.future.done():
            self.wait_until_finished()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request_preemption()

    def request_preemption(self) -> None:
        """Ask for the preemption save at the next :meth:`maybe_save` (the signal handler
        calls this; call it for other notices, with ``save_on_preemption=True``)."""
        self._preemption_requested = True

    def _agree(self, flag: bool, *, rank0: bool = False) -> bool:
        """``flag`` agreed by every rank of ``comm``: rank 0's, or whether any rank's is set."""
        if self.comm is None:
            return flag
        flags = self.comm.allgather(bool(flag))
        return bool(flags[0]) if rank0 else any(flags)

    def _record(self, step: int, location: str, metrics: bytes | None) -> None:
        """On the primary rank: verify a committed save, record its metrics, rotate."""
        if not self.primary:
            return
        why = self.problem(location)
        if why is not None:
            raise UCPError(f"the checkpoint just saved at {location} is not valid: {why}; "
                           "nothing was deleted")
        self._update_record(step_name(step), {"step": step, "state": "saved",
                                              "root_sha256": self._root_sha256(location)})
        self._verified.add(step)
        if metrics is not None:
            self._root_store().put(_metrics_key(step), [metrics], atomic=True)
        self._metrics[step] = None if metrics is None else json.loads(metrics)
        self.prune(newest=step)

    def _clean_up_after_failure(self) -> None:
        """:meth:`remove_partial` while a save's error is raised: its own failure (a record
        that cannot be trusted, say) is a warning, so that the save's error is the one seen."""
        try:
            self.remove_partial()
        except UCPError as exc:
            warnings.warn(f"the remains of failed saves under {self.root} were not removed: "
                          f"{exc}", CheckpointWarning, stacklevel=3)

    def remove_partial(self) -> list[Entry]:
        """Delete the remains of this manager's saves that failed or were interrupted (its
        record says a save began there, and no commit followed); every committed
        checkpoint stays, valid or not, and so does every location this manager did not
        write (with a warning). Returns the deleted locations; one that cannot be deleted
        gives a warning."""
        deleted = []
        record = self.record()
        for entry in self.checkpoints():
            if self._pending is not None and entry.step == self._pending.step:
                continue  # being written
            name = entry.location.rsplit("/", 1)[-1]
            try:
                committed = self.store(entry.location).exists(ZARR_JSON)
            except (OSError, UCPError) as exc:
                warnings.warn(f"left {entry.location} as it is: {exc}", CheckpointWarning,
                              stacklevel=2)
                continue
            if committed:
                continue
            if name not in record:
                self._warn_once(entry.location, f"left {entry.location} as it is: remains "
                                                "of a save this manager did not make")
                continue
            if self._delete(entry.location):
                deleted.append(entry)
        present = {e.location.rsplit("/", 1)[-1] for e in self.checkpoints()}
        pending = None if self._pending is None else step_name(self._pending.step)
        for name, own in record.items():  # saves that failed before they made a location
            if own["state"] == "saving" and name not in present and name != pending:
                try:
                    self._update_record(name, None)
                except WriteError as exc:
                    warnings.warn(f"{exc}", CheckpointWarning, stacklevel=2)
        return deleted

    def prune(self, *, newest: int | None = None) -> list[Entry]:
        """Delete what retention allows; returns the deleted locations.

        Only checkpoints older than the newest valid one are candidates. Kept: the
        ``keep_last`` newest valid checkpoints, the ``keep_best`` best valid ones, every
        committed one whose step is a multiple of ``keep_every``, and anything newer than
        the newest valid one (a save may be in progress there). Metrics objects of deleted
        checkpoints (and of locations that are gone) are deleted with them.
        """
        record = self.record()
        entries = [e for e in self.checkpoints()
                   if e.location.rsplit("/", 1)[-1] in record]  # only what it wrote
        own, _ = self._own_entries(record)
        valid = [e for e in own if self._valid(e)]
        if not valid:
            return []
        newest_valid = valid[-1].step if newest is None else max(newest, valid[-1].step)
        keep = {e.step for e in valid[-self.keep_last :]} | self._best(valid)
        committed_own = {e.step for e in own}
        deleted = []
        for entry in entries:
            if entry.step >= newest_valid or entry.step in keep:
                continue
            if self._pending is not None and entry.step == self._pending.step:
                continue
            name = entry.location.rsplit("/", 1)[-1]
            if (record[name]["state"] == "saved" and entry.step not in committed_own
                    and self._committed(entry.location)):
                continue  # replaced at one of its names: not what it wrote (warned)
            if (self.keep_every is not None and entry.step % self.keep_every == 0
                    and self._committed(entry.location)):
                continue  # kept for good
            if self._delete(entry.location):
                deleted.append(entry)
        present = {e.location.rsplit("/", 1)[-1] for e in self.checkpoints()}
        gone = [n for n in record if n not in present and (
            (step := parse_step_name(n)) is not None and step < newest_valid)]
        for name in gone:  # recorded, and no longer there: forget it and its metrics
            with contextlib.suppress(OSError, UCPError):
                self._root_store().delete(name + METRICS_SUFFIX)
            with contextlib.suppress(WriteError):  # the next rotation tries again
                self._update_record(name, None)
        return deleted

    def _valid(self, entry: Entry) -> bool:
        """True if ``entry`` is valid (a checkpoint this manager verified before needs only
        to be still committed: validating every kept checkpoint at every save would cost
        more and more, and on an object store one request per stored object)."""
        if entry.step in self._verified:
            if self._committed(entry.location):
                return True
            self._verified.discard(entry.step)
        if self.problem(entry.location, deep=False) is not None:
            return False
        self._verified.add(entry.step)
        return True

    def _best(self, valid: list[Entry]) -> set[int]:
        """The steps of the ``keep_best`` best valid checkpoints saved with metrics."""
        if not self.keep_best or self.best_metric is None:
            return set()
        scored: list[tuple[float, int]] = []
        for entry in valid:
            values = self.metrics(entry.step)
            if values is None:
                continue
            try:
                score = (self.best_metric(values) if callable(self.best_metric)
                         else values[self.best_metric])
                score = float(score)
            except (KeyError, TypeError, ValueError):
                continue  # not ranked: it is kept only by the other rules
            if not math.isnan(score):
                scored.append((score if self.best_mode == "max" else -score, entry.step))
        scored.sort(reverse=True)  # best first; of equal scores, the newer
        return {step for _, step in scored[: self.keep_best]}

    def _delete(self, location: str) -> bool:
        """Delete a checkpoint or the remains of a save (un-committing first, UCP-1.0-R053),
        then its metrics; anything else is left as it is, with a warning. True if deleted."""
        try:
            delete_checkpoint(self.store(location))
        except (OSError, UCPError) as exc:
            warnings.warn(f"left {location} as it is: {exc}", CheckpointWarning, stacklevel=3)
            return False
        if not self.is_url:  # the emptied directory (rmdir never follows a link)
            with contextlib.suppress(OSError):
                os.rmdir(_local(location))
        name = location.rsplit("/", 1)[-1]
        step = parse_step_name(name)
        if step is not None:
            self._verified.discard(step)
            self._metrics.pop(step, None)
            with contextlib.suppress(OSError, UCPError):
                self._root_store().delete(_metrics_key(step))
            try:
                self._update_record(name, None)
            except WriteError as exc:  # a later rotation forgets it
                warnings.warn(f"{location} was deleted, but {exc}", CheckpointWarning,
                              stacklevel=3)
        return True


def _local(location: str) -> str:
    return location[len("file://") :] if location.startswith("file://") else location


def _metrics_key(step: int) -> str:
    return step_name(step) + METRICS_SUFFIX


def _encode_metrics(metrics: Mapping[str, Any] | None, location: str) -> bytes | None:
    """The metrics as the JSON object stored beside the checkpoint (checked before saving)."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        raise InvalidValueError("metrics are a mapping with string keys", path=location)
    try:
        return json.dumps(dict(metrics), allow_nan=False, sort_keys=True).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidValueError(f"metrics must be JSON values (finite numbers): {exc}",
                                path=location) from exc


def _future_of(value: Any) -> Any:
    """The future a save callback returned (``concurrent.futures.Future`` or alike; DCP's
    ``AsyncSaveResponse`` gives its ``upload_completion``), or None for a finished save."""
    value = getattr(value, "upload_completion", value)
    if callable(getattr(value, "result", None)) and callable(getattr(value, "done", None)):
        return value
    return None


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


__all__ = ["METRICS_SUFFIX", "RECORD_KEY", "CheckpointManager", "CheckpointWarning", "Entry",
           "parse_step_name", "step_name"]
