"""LocalStore.batch: one descriptor of the location for a save's writes.

What a batch changes is how many times the location is opened (each open and close is a
system call that hands the GIL to the other writer threads), never where a file goes:
these tests count opens and descriptors, and check that a location removed or replaced
during a save receives nothing and that the save commits nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.helpers import fail_fsync
from ucpformat.checkpoint.metadata import ZARR_JSON
from ucpformat.errors import ConcurrentWriteError
from ucpformat.store import LocalStore, posix

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def location_opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every opening of a store's location by its path (that found it), by location."""
    opened: list[str] = []
    real = LocalStore._open_location

    def counting(self: LocalStore, *, create: bool) -> int:
        fd = real(self, create=create)
        opened.append(self.location)
        return fd

    monkeypatch.setattr(LocalStore, "_open_location", counting)
    yield opened


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if not p.is_dir()]


def test_a_batch_opens_the_location_once_for_every_thread(
    tmp_path: Path, location_opens: list[str]
) -> None:
    store = LocalStore(tmp_path / "c")
    keys = [f"model/w{i}/c/{j}" for i in range(8) for j in range(5)]
    with store.batch():
        threads = [threading.Thread(target=lambda k=k: store.put(k, [k.encode()]))
                   for k in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.flush()
    assert location_opens == [store.location]
    for key in keys:
        assert (tmp_path / "c" / key).read_bytes() == key.encode()
    # without a batch, every call opens it again
    location_opens.clear()
    for key in keys[:5]:
        store.put(f"{key}-again", [b"x"])
    assert len(location_opens) >= 5


def test_a_save_opens_its_location_a_few_times_not_once_per_file(
    tmp_path: Path, location_opens: list[str]
) -> None:
    state = {"model": {f"w{i}": np.full((16, 16), i, np.float32) for i in range(40)}}
    ucpformat.save(tmp_path / "c", state, chunk_bytes=256)
    files = len(_files(tmp_path / "c"))
    assert files > 80
    assert len(location_opens) <= 4, (len(location_opens), files)
    got = ucpformat.open(tmp_path / "c")["model/w7"].read()
    assert np.array_equal(got, state["model"]["w7"])


@needs_proc
def test_no_descriptor_is_left_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"model": {f"w{i}": np.full((16, 16), i, np.float32) for i in range(10)}}
    ucpformat.save(tmp_path / "warm", state)  # imports, thread pools, caches
    before = _open_fds()
    ucpformat.save(tmp_path / "c", state, chunk_bytes=256)
    assert _open_fds() == before
    store = LocalStore(tmp_path / "d")
    with pytest.raises(RuntimeError), store.batch(), store.batch():
        store.put("model/a/c/0", [b"x"])
        raise RuntimeError("a failure inside the batch")
    assert _open_fds() == before
    fail_fsync(monkeypatch, 8)
    with pytest.raises(ucpformat.errors.WriteError):
        ucpformat.save(tmp_path / "e", state)
    assert _open_fds() == before


@needs_proc
def test_the_descriptor_outlives_the_batch_while_a_call_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch ends while another thread is inside a call: the descriptor stays open
    (its number cannot name another file under that call) until the call is done."""
    if posix.OPENAT2 is None:
        pytest.skip("no openat2 on this system")
    store = LocalStore(tmp_path / "c")
    store.put("model/a/c/0", [b"first"])  # the directories exist: one openat2 from here
    inside, go_on = threading.Event(), threading.Event()
    seen: list[int] = []
    real = posix.OPENAT2

    def slow_openat2(dir_fd: int, path: str, flags: int, mode: int = 0) -> int:
        if path == "model/a/c/1":
            seen.append(dir_fd)
            inside.set()
            assert go_on.wait(30)
        return real(dir_fd, path, flags, mode)

    monkeypatch.setattr(posix, "OPENAT2", slow_openat2)
    writer = threading.Thread(target=lambda: store.put("model/a/c/1", [b"second"]))
    location = os.stat(tmp_path / "c")
    with store.batch():
        writer.start()
        assert inside.wait(30)
    fd = seen[0]
    held = os.fstat(fd)  # still open, still the location
    assert (held.st_dev, held.st_ino) == (location.st_dev, location.st_ino)
    go_on.set()
    writer.join()
    assert (tmp_path / "c" / "model/a/c/1").read_bytes() == b"second"
    try:
        now = os.fstat(fd)
    except OSError:
        return  # closed
    assert (now.st_dev, now.st_ino) != (location.st_dev, location.st_ino)


def test_writes_in_a_batch_never_go_to_a_location_put_in_its_place(tmp_path: Path) -> None:
    """UCP-1.0-R059: the location is moved away and a new directory made at its path
    during a batch: what follows goes to the directory the batch opened (and is made
    durable there), nothing to the new one; an atomic write (a commit) refuses."""
    root = tmp_path / "c"
    store = LocalStore(root)
    with store.batch():
        store.put("model/a/c/0", [b"a"])
        root.rename(tmp_path / "moved")
        root.mkdir()
        store.put("model/b/c/0", [b"b"])
        store.put("model/a/c/1", [b"a1"])
        store.flush()
        with pytest.raises(ConcurrentWriteError) as committing:
            store.put(ZARR_JSON, [b"{}"], atomic=True)
        assert committing.value.rule == "UCP-1.0-R059"
    assert _files(root) == []
    moved = tmp_path / "moved"
    assert sorted(p.relative_to(moved).as_posix() for p in _files(moved)) == [
        "model/a/c/0", "model/a/c/1", "model/b/c/0"]


def test_writes_in_a_batch_never_make_a_removed_location_again(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "c"
    store = LocalStore(root)
    with store.batch():
        store.put("model/a/c/0", [b"a"])
        shutil.rmtree(root)
        for key in ("model/a/c/1", "model/b/c/0", "top"):
            with pytest.raises(FileNotFoundError):
                store.put(key, [b"x"])
        with pytest.raises(ConcurrentWriteError):
            store.put(ZARR_JSON, [b"{}"], atomic=True)
    assert not root.exists()


def test_a_committed_location_may_be_moved_before_the_batch_ends(tmp_path: Path) -> None:
    """Once the root is written the checkpoint is the user's: renaming it (a save to a
    temporary path, then moved into place) while a rank is still leaving its batch is
    no error, and the checkpoint opens at its new path."""
    root = tmp_path / "tmp-ckpt"
    state = {"model": {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}}
    store = LocalStore(root)
    with store.batch():
        ucpformat.save(store, state)
        root.rename(tmp_path / "ckpt")
    with ucpformat.open(tmp_path / "ckpt") as ckpt:
        assert np.array_equal(ckpt["model/w"].read(), state["model"]["w"])


@pytest.mark.parametrize("how", ["moved", "removed"])
def test_a_save_whose_location_is_replaced_commits_nothing_and_writes_nothing_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The location is moved away (or removed) and made again while the arrays are
    written: the save fails (R059), the directory now at the path receives no file of
    it, nothing anywhere is committed, and what it wrote is removed from the directory
    it claimed. (Each write opened the path before: the files written after the swap
    went into the new directory, and stayed there.)"""
    import shutil

    import ucpformat.checkpoint.write_loop as writer

    root = tmp_path / "c"
    real = writer.write_object
    swapped: list[bool] = []

    def swapping(store: Any, *args: Any, **kwargs: Any) -> Any:
        if not swapped:
            swapped.append(True)
            if how == "moved":
                root.rename(tmp_path / "moved")
            else:
                shutil.rmtree(root)
            root.mkdir()
        return real(store, *args, **kwargs)

    monkeypatch.setattr(writer, "write_object", swapping)
    state = {"model": {f"w{i}": np.full((16, 16), i, np.float32) for i in range(12)}}
    with pytest.raises(ucpformat.errors.WriteError) as failed:
        # (removing a tree is no single step: with one writer thread, none races it)
        ucpformat.save(root, state, chunk_bytes=256, workers=4 if how == "moved" else 1)
    assert swapped
    assert _files(root) == []
    if how == "moved":
        assert failed.value.rule == "UCP-1.0-R059"
        assert _files(tmp_path / "moved") == []  # the save's own files, removed
    else:  # the directory claimed is gone: the first write into it fails
        assert isinstance(failed.value.__cause__, FileNotFoundError)
