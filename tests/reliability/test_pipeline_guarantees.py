"""The writer's guarantees on the distributed save pipeline (``ucpformat.distributed.pipeline``,
which ``save_distributed`` and the DCP plugin run): one writer per location, the commit only
while the coordinator still holds it (UCP-1.0-R059); everything that can refuse a save
checked before anything changes, and a failed save cleaned up (UCP-1.0-R049); no link
under the location followed (UCP-1.0-R089).

Two ranks over threads (``ucpformat.distributed.comm.run_threads``); the DCP plugin's counterpart of
the clean-up is in tests/torch/test_dcp_plugin.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.checkpoint.metadata import IN_PROGRESS_KEY, MANIFEST_KEY, ZARR_JSON
from ucpformat.checkpoint.streaming import StreamingWriter
from ucpformat.distributed.comm import Communicator, run_threads
from ucpformat.distributed.pipeline import FragmentList
from ucpformat.distributed.pipeline import save as run_pipeline
from ucpformat.distributed.save_plan import PlanOptions
from ucpformat.errors import ConcurrentWriteError, UCPError
from ucpformat.layout.boxes import Box
from ucpformat.store import LocalStore
from ucpformat.testing import faults
from ucpformat.testing.common import SMALL_CHUNKING, differences, small_state, tree_bytes

SEED_A, SEED_B = 1, 2


def _save(target: Path, *, overwrite: bool = False) -> list[BaseException | None]:
    """Each rank's error (None: saved) of the two-rank save of state B into ``target``."""
    parts = faults.distributed_parts(SEED_B, 2)
    errors: list[BaseException | None] = [None, None]

    def rank_main(comm: Communicator) -> None:
        try:  # caught here: run_threads must not break the barrier of a waiting rank
            faults.distributed_save(LocalStore(target), comm, parts, overwrite=overwrite)
        except BaseException as exc:
            errors[comm.rank] = exc

    run_threads(2, rank_main, timeout=60)
    assert not any(isinstance(e, threading.BrokenBarrierError) for e in errors), errors
    return errors


def _loads(target: Path, expected: Any) -> None:
    with ucpformat.open(target) as ckpt:
        assert differences(ckpt.to_dict(), expected) == []


@pytest.fixture
def previous(tmp_path: Path) -> Path:
    """A committed checkpoint of state A."""
    path = tmp_path / "previous"
    ucpformat.save(path, small_state(SEED_A), **SMALL_CHUNKING)
    return path


def test_a_location_another_writer_holds_is_refused_and_left_to_it(tmp_path: Path) -> None:
    """UCP-1.0-R059: while a streaming writer holds the location, a distributed save there
    is refused on every rank (whatever ``overwrite`` says) and changes nothing; the
    writer holding it then commits."""
    target = tmp_path / "ckpt"
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    with StreamingWriter(target) as holder:
        holder.declare("model/w", value.shape, "float32")
        for overwrite in (False, True):
            errors = _save(target, overwrite=overwrite)
            assert isinstance(errors[0], ConcurrentWriteError), errors
            assert all(e is not None and "R059" in str(e) for e in errors), errors
        holder.write("model/w", value)
        holder.commit()
    _loads(target, {"model": {"w": value}})


def test_a_stray_file_refuses_the_save_before_anything_changes(previous: Path) -> None:
    """UCP-1.0-R049: a file no checkpoint key can name refuses ``overwrite=True`` on every
    rank before the checkpoint is touched (file for file), and it still loads."""
    (previous / "model" / "notes (1).txt").write_text("mine")
    before = tree_bytes(previous)
    errors = _save(previous, overwrite=True)
    assert all(e is not None and "R049" in str(e) and "notes (1).txt" in str(e)
               for e in errors), errors
    assert tree_bytes(previous) == before
    _loads(previous, small_state(SEED_A))


def test_links_under_the_location_are_never_followed(tmp_path: Path, previous: Path) -> None:
    """UCP-1.0-R089: a destination holding only a link to a directory outside is refused
    (it is not a checkpoint); a group directory of a committed checkpoint replaced by a
    link is removed as a link by ``overwrite=True``, never written through. Outside, not a
    byte changes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"keep")
    only_link = tmp_path / "only-link"
    only_link.mkdir()
    (only_link / "model").symlink_to(outside, target_is_directory=True)
    errors = _save(only_link)
    assert all(e is not None and "R053" in str(e) for e in errors), errors

    moved = tmp_path / "outside-model"
    (previous / "model").rename(moved)
    (previous / "model").symlink_to(moved, target_is_directory=True)
    seen = {"outside": tree_bytes(outside), "moved": tree_bytes(moved)}
    assert _save(previous, overwrite=True) == [None, None]
    assert {"outside": tree_bytes(outside), "moved": tree_bytes(moved)} == seen
    assert (only_link / "model").is_symlink()
    assert not (previous / "model").is_symlink()
    _loads(previous, faults.distributed_parts(SEED_B, 2).expected)


def test_a_save_failing_before_the_uncommit_leaves_a_new_location_empty(tmp_path: Path) -> None:
    """UCP-1.0-R049: a rank failing mid-exchange into a new location: the coordinator
    withdraws its marker and gives the location up, so nothing is left there and the
    same save, retried, succeeds."""
    target = tmp_path / "new"
    parts = faults.distributed_parts(SEED_B, 2)
    errors: list[BaseException | None] = [None, None]

    def rank_main(comm: Communicator) -> None:
        try:
            faults.exchange_save(LocalStore(target), comm, parts, victim=1, reads=0)
        except BaseException as exc:
            errors[comm.rank] = exc

    run_threads(2, rank_main, timeout=60)
    assert all(isinstance(e, UCPError) and "injected" in str(e) for e in errors), errors
    assert tree_bytes(target) == {}  # not even the marker
    run_threads(2, lambda comm: faults.exchange_save(LocalStore(target), comm, parts,
                                                     victim=1, reads=-1))
    _loads(target, parts.expected)


class _Impostor:
    """Rank 1's fragments; the first time they are read, another writer takes the location
    over (its marker replaces the coordinator's, as ``overwrite=True`` does on a store
    without locks)."""

    def __init__(self, fragments: Sequence[faults.Fragment], marker: Path) -> None:
        self._inner = FragmentList(fragments)
        self._marker = marker
        self.taken = False

    def boxes(self) -> list[tuple[str, Box]]:
        return self._inner.boxes()

    def fragments(self, path: str) -> list[tuple[Box, np.ndarray[Any, Any]]]:
        if not self.taken:
            self.taken = True
            self._marker.write_text(json.dumps({"writer": "impostor", "token": "theirs"}))
        return self._inner.fragments(path)


def test_a_displaced_coordinator_commits_nothing_and_removes_nothing(tmp_path: Path) -> None:
    """UCP-1.0-R059: the coordinator checks its token before the commit: a location that
    another writer took over during the save is not committed, and what is there (the
    other writer's marker) is left to it."""
    target = tmp_path / "ckpt"
    parts = faults.distributed_parts(SEED_B, 2)
    impostor = _Impostor(parts.fragments[1], target / IN_PROGRESS_KEY)
    errors: list[BaseException | None] = [None, None]

    def rank_main(comm: Communicator) -> None:
        source = impostor if comm.rank == 1 else FragmentList(parts.fragments[0])
        try:
            run_pipeline(LocalStore(target, durable=False), comm, specs=parts.specs,
                         source=source, group_attributes=parts.group_attributes,
                         options=PlanOptions(None, SMALL_CHUNKING["chunk_bytes"],
                                             SMALL_CHUNKING["shard_bytes"], 1, workers=2))
        except BaseException as exc:
            errors[comm.rank] = exc

    run_threads(2, rank_main, timeout=60)
    assert impostor.taken
    assert isinstance(errors[0], ConcurrentWriteError), errors
    assert "another writer has taken the location over" in str(errors[0])
    assert all(e is not None and "R059" in str(e) for e in errors), errors
    assert not (target / ZARR_JSON).exists()
    assert json.loads((target / IN_PROGRESS_KEY).read_text())["writer"] == "impostor"


class _Recording(LocalStore):
    """A rank's store that records, in order, each stored object it writes, each flush
    and the root's write (the commit point)."""

    def __init__(self, location: Path) -> None:
        super().__init__(str(location))
        self.events: list[str] = []

    def _record(self, key: str) -> None:
        if key == ZARR_JSON:
            self.events.append("root")
        elif not key.endswith(ZARR_JSON) and key not in (MANIFEST_KEY, IN_PROGRESS_KEY):
            self.events.append("object")

    def put(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        self._record(key)
        return super().put(key, buffers, atomic=atomic)

    def create(self, key: str, buffers: Sequence[Any], *, atomic: bool = False) -> int:
        self._record(key)
        return super().create(key, buffers, atomic=atomic)

    def flush(self) -> None:
        self.events.append("flush")
        super().flush()


def test_every_object_is_flushed_before_the_commit_and_the_coordinators_once(
    tmp_path: Path,
) -> None:
    """Each rank makes its stored objects durable before it reports them written; the
    coordinator's are made durable by the commit's one flush, before the root (a flush
    of its objects in the write step too would only repeat it)."""
    parts = faults.distributed_parts(SEED_B, 2)
    stores = [_Recording(tmp_path / "ckpt") for _ in range(2)]

    def rank_main(comm: Communicator) -> None:
        faults.distributed_save(stores[comm.rank], comm, parts)

    run_threads(2, rank_main, timeout=60)
    coordinator, other = (s.events for s in stores)
    assert coordinator[-1] == "root" and "object" in coordinator and "object" in other
    after_objects = coordinator[coordinator.index("object"):]
    assert after_objects.count("flush") == 1
    assert after_objects.index("flush") > max(
        i for i, e in enumerate(after_objects) if e == "object")
    assert other[-1] == "flush" and "root" not in other
    _loads(tmp_path / "ckpt", parts.expected)
