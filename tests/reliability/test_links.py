"""Links in and around a checkpoint (UCP-1.0-R091, UCP-1.0-R089): nothing outside the
location is ever read, written or deleted through a symbolic or a hard link."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.checkpoint.manager import CheckpointManager, CheckpointWarning
from ucpformat.checkpoint.metadata import IN_PROGRESS_KEY
from ucpformat.checkpoint.streaming import StreamingWriter
from ucpformat.errors import CheckpointExistsError, UCPError, UnsafePathError
from ucpformat.store import LocalStore, posix
from ucpformat.testing import link_attacks as links
from ucpformat.testing.common import SMALL_CHUNKING, differences, small_state, tree_bytes


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A directory beside the checkpoint with a valid checkpoint and a file in it; the
    test fails if anything in it changed."""
    root = tmp_path / "outside"
    root.mkdir()
    (root / "secret").write_bytes(b"outside\n")
    ucpformat.save(root / "ckpt", small_state(99), durable=False, **SMALL_CHUNKING)
    before = tree_bytes(root)
    yield root
    assert tree_bytes(root) == before, "a file outside the checkpoint was changed"


def _loads(location: Path, state: Any) -> bool:
    with ucpformat.open(location) as ckpt:
        return differences(ckpt.to_dict(), state) == []


def test_a_destination_holding_only_a_link_is_not_empty(tmp_path: Path, outside: Path) -> None:
    """UCP-1.0-R089: ``model -> ../outside`` made the destination look empty, and the
    writer wrote the checkpoint's arrays through the link into ``outside``."""
    dest = tmp_path / "ckpt"
    dest.mkdir()
    (dest / "model").symlink_to(outside / "ckpt" / "model", target_is_directory=True)
    with pytest.raises(CheckpointExistsError) as info:
        ucpformat.save(dest, small_state(1), **SMALL_CHUNKING)
    assert "'model'" in str(info.value)
    assert os.listdir(dest) == ["model"]


@pytest.mark.parametrize("where", ["model", "model/fc.weight/c", "model/fc.bias/c/0"])
def test_overwrite_removes_links_without_following_them(
    tmp_path: Path, outside: Path, where: str
) -> None:
    """UCP-1.0-R089: a committed checkpoint whose directory (or stored object) was
    replaced by a link to its counterpart outside is replaced with overwrite=True: the
    link is removed, the new checkpoint is written inside, nothing outside changes."""
    dest = tmp_path / "ckpt"
    ucpformat.save(dest, small_state(1), **SMALL_CHUNKING)
    victim = dest / where
    if victim.is_dir():
        import shutil

        shutil.rmtree(victim)
    else:
        victim.unlink()
    victim.symlink_to(outside / "ckpt" / where)
    ucpformat.save(dest, small_state(2), overwrite=True, **SMALL_CHUNKING)
    assert _loads(dest, small_state(2))
    assert not any(p.is_symlink() for p in dest.rglob("*"))


def test_streaming_writer_never_follows_a_link(tmp_path: Path, outside: Path) -> None:
    dest = tmp_path / "ckpt"
    ucpformat.save(dest, small_state(1), **SMALL_CHUNKING)
    import shutil

    shutil.rmtree(dest / "model")
    (dest / "model").symlink_to(outside / "ckpt" / "model", target_is_directory=True)
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    with StreamingWriter(dest, overwrite=True, durable=False) as writer:
        writer.declare("model/fc.weight", w.shape, w.dtype)
        writer.write("model/fc.weight", w)
        writer.commit()
    with ucpformat.open(dest) as ckpt:
        assert np.array_equal(ckpt["model/fc.weight"].read(), w)


def test_a_link_planted_during_a_save_is_refused_not_followed(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UCP-1.0-R089: a directory the writer made is swapped for a link just before the
    writer opens a path through it: the write is refused (the writer resolved the whole
    path again at each open, followed the link and wrote outside)."""
    dest = tmp_path / "ckpt"
    target = dest / "model" / "fc.weight" / "c"
    real_open = os.open
    swapped = []

    def swapping_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        name = os.fsdecode(path)
        if not swapped and target.is_dir() and name in ("c", str(target / "0" / "0")):
            import shutil

            shutil.rmtree(target)
            target.symlink_to(outside / "ckpt" / "model" / "fc.weight" / "c")
            swapped.append(name)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr("ucpformat.store.os.open", swapping_open)
    with pytest.raises(UCPError) as info:
        ucpformat.save(dest, small_state(1), workers=1, **SMALL_CHUNKING)
    assert swapped
    assert info.value.rule == "UCP-1.0-R091", info.value
    assert "symbolic link" in str(info.value)


@pytest.mark.parametrize("kind", ["hard", "symbolic"])
def test_a_linked_marker_is_replaced_never_written_through(
    tmp_path: Path, outside: Path, kind: str
) -> None:
    """A location holding the remains of a save whose in-progress marker is a link to a
    file outside: the new marker replaces the entry (a hard link was written through)."""
    dest = tmp_path / "ckpt"
    (dest / "model").mkdir(parents=True)
    (dest / "model" / "zarr.json").write_bytes(b"{}")
    if kind == "hard":
        os.link(outside / "secret", dest / IN_PROGRESS_KEY)
    else:
        (dest / IN_PROGRESS_KEY).symlink_to(outside / "secret")
    ucpformat.save(dest, small_state(3), **SMALL_CHUNKING)
    assert _loads(dest, small_state(3))


@pytest.mark.parametrize("swap", ["file", "directory"])
@pytest.mark.parametrize("path", ["walk", "openat2"])
def test_reads_check_the_file_they_opened_not_the_path(
    tmp_path: Path, outside: Path, monkeypatch: pytest.MonkeyPatch, swap: str, path: str
) -> None:
    """UCP-1.0-R089, time of check to time of use: the stored object (or its directory)
    is swapped for a link to a valid object outside between the store's check of the
    path and its open. The store opens without following links, relative to directories
    it holds open: it refuses the link, or reads the file it had reached before the swap;
    it returned the bytes of the file outside before. Both ways of opening are attacked:
    the walk component by component, and the one ``openat2`` call that refuses any link
    on the whole path (the swap made just before that call)."""
    dest = tmp_path / "ckpt"
    ucpformat.save(dest, small_state(1), **SMALL_CHUNKING)
    key = "model/fc.weight/c/0/0"
    chunk = dest / key
    victim = chunk if swap == "file" else chunk.parent
    swapped = []

    def swap_now(name: str) -> None:
        if not swapped and not victim.is_symlink():
            hidden = victim.with_name("hidden")
            os.rename(victim, hidden)
            victim.symlink_to(outside / "ckpt" / victim.relative_to(dest))
            swapped.append(name)

    if path == "walk":
        real_open = os.open

        def swapping_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            name = os.fsdecode(path)
            if name in ("0", str(chunk)):
                swap_now(name)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(LocalStore, "_open_beneath", lambda *a, **k: None)
        hook: tuple[str, Any] = ("ucpformat.store.os.open", swapping_open)
    else:
        real_openat2 = posix.OPENAT2
        if real_openat2 is None:
            pytest.skip("no openat2 on this system")

        def swapping_openat2(dir_fd: int, name: str, flags: int, mode: int = 0) -> int:
            if name == key:
                swap_now(name)
            return real_openat2(dir_fd, name, flags, mode)

        hook = ("ucpformat.store.posix.OPENAT2", swapping_openat2)
    saved = chunk.read_bytes()
    store = LocalStore(dest)
    monkeypatch.setattr(*hook)
    try:
        got = store.get(key)
    except UnsafePathError as exc:  # the link met at the open
        assert exc.rule == "UCP-1.0-R091"
    else:  # the file of the directory opened before the swap: never the one outside
        assert got == saved
    assert swapped


def test_manager_never_deletes_through_a_link_nor_other_files(
    tmp_path: Path, outside: Path
) -> None:
    """Rotation deleted the contents of a ``step-*`` link's target, and a ``step-*``
    directory of other files, without a warning; now both stay, with a warning."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "step-0000000001").symlink_to(outside / "ckpt", target_is_directory=True)
    foreign = run / "step-0000000002"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    manager = CheckpointManager(run, keep_last=1, durable=False, **SMALL_CHUNKING)
    with pytest.warns(CheckpointWarning) as caught:
        for step in (3, 4, 5):
            manager.maybe_save(step, small_state(step))
    said = " ".join(str(w.message) for w in caught)
    assert "step-0000000001" in said and "step-0000000002" in said
    assert (run / "step-0000000001").is_symlink()
    assert (foreign / "notes.txt").read_text() == "mine"
    assert [e.step for e in manager.checkpoints()] == [1, 2, 5]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        latest = manager.latest_valid()
    assert latest is not None and latest.step == 5


def test_link_attack_harness_quick() -> None:
    """Every kind of link attack of ``ucpformat.testing.link_attacks`` (make stress runs more)."""
    figures = links.run(1, reads=200, seed=7)
    out = figures.as_dict()
    assert out["trials"] == len(links.KINDS)
    assert out["outside touched (trials)"] == 0
    assert out["wrong reads"] == 0
    assert not figures.failures, figures.failures


@pytest.mark.distributed
def test_link_attack_harness_distributed_quick() -> None:
    """UCP-1.0-R089, UCP-1.0-R091 for distributed saves: every link planting of the
    writer kinds, saved to by two gloo ranks (save_distributed and the DCP plugin in
    turn): nothing outside touched; refused only with a requirement, the location as it
    was (make stress runs 20 of each)."""
    pytest.importorskip("torch.distributed")
    figures = links.run(0, seed=7, dist_trials=1)
    out = figures.as_dict()
    assert out["trials"] == len(links.DIST_KINDS)
    assert out["outside touched (trials)"] == 0
    assert not figures.failures, figures.failures
    assert {label.split(" (")[1] for label in figures.trials} == {"distributed)", "dcp)"}


@pytest.mark.distributed
@pytest.mark.parametrize(("defect", "kinds"), [
    ("follow_links", ("dist-dir-link", "dist-overwrite-dir-link")),
    ("marker_in_place", ("dist-marker-hard-link", "dist-marker-link")),
])
def test_link_attack_harness_notices_a_distributed_save_following_links(
    defect: str, kinds: tuple[str, ...]
) -> None:
    """The distributed link trials fail when a fixed defect of issue 13 is put back in
    the writers: a symbolic link to a directory followed (1), the in-progress marker
    written in place through a link (10)."""
    pytest.importorskip("torch.distributed")
    figures = links.run(0, seed=7, dist_trials=1, dist_kinds=kinds,
                        gloo_setup=f"tests.reliability.regressions:{defect}")
    assert figures.as_dict()["outside touched (trials)"] == len(kinds), figures.failures


def test_link_attacks_without_openat2(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Linux's openat2 is missing (old kernels, other systems, seccomp), the store
    walks every path one component at a time: the same attacks, the same outcome."""

    monkeypatch.setattr(posix, "OPENAT2", None)
    kinds = ("dir-link", "overwrite-nested-link", "race-save", "reader-swap-file",
             "reader-swap-dir")
    figures = links.run(1, reads=200, seed=8, kinds=kinds)
    assert figures.as_dict()["outside touched (trials)"] == 0
    assert not figures.failures, figures.failures
