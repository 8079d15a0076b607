"""CheckpointManager: periodic saves, rotation after commit, restart from the newest valid."""

from __future__ import annotations

import json
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.checkpoint.manager import (
    RECORD_KEY,
    CheckpointManager,
    CheckpointWarning,
    step_name,
)
from ucpformat.errors import UCPError
from ucpformat.store import LocalStore
from ucpformat.testing import faults
from ucpformat.testing.common import SMALL_CHUNKING, differences, small_state


def _steps(manager: CheckpointManager) -> list[int]:
    return [e.step for e in manager.checkpoints()]


def _record_began(root: Path, step: int) -> None:
    """What the record of a manager killed during its save of ``step`` says."""
    path = root / RECORD_KEY
    doc = json.loads(path.read_text())
    doc["checkpoints"][step_name(step)] = {"step": step, "state": "saving", "root_sha256": None}
    path.write_text(json.dumps(doc))


def _flip_a_chunk(location: str) -> None:
    chunk = sorted(Path(location, "model", "fc.weight", "c").rglob("*"))[-1]
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0x10
    chunk.write_bytes(bytes(data))


def test_saves_every_n_steps_and_keeps_the_last_k(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", save_every=5, keep_last=2, **SMALL_CHUNKING)
    saved = [s for s in range(23) if manager.maybe_save(s, lambda s=s: small_state(s))]
    assert saved == [0, 5, 10, 15, 20]
    assert _steps(manager) == [15, 20]
    latest = manager.latest_valid()
    assert latest is not None and latest.step == 20
    with manager.restore() as ckpt:  # type: ignore[union-attr]
        assert differences(ckpt.to_dict(), small_state(20)) == []


def test_a_failed_save_deletes_no_checkpoint_and_leaves_no_remains(tmp_path: Path) -> None:
    """Never deletes the only good checkpoint (keep_last=1 and the next save fails), and a
    failed save leaves nothing of itself behind."""
    manager = CheckpointManager(tmp_path / "run", keep_last=1, **SMALL_CHUNKING)
    manager.maybe_save(1, small_state(1))

    def broken() -> dict[str, Any]:
        raise RuntimeError("out of disk")

    with pytest.raises(RuntimeError):
        manager.maybe_save(2, broken)

    def half(path: str) -> None:  # writes something, then dies before its commit
        LocalStore(path).put("write-in-progress.ucp.json", [b"{}"])
        LocalStore(path).put("model/zarr.json", [b"{}"])
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        manager.maybe_save(3, half)
    assert _steps(manager) == [1]  # its remains are removed; the only valid one stays
    latest = manager.latest_valid()
    assert latest is not None and latest.step == 1
    manager.maybe_save(4, small_state(4))
    assert _steps(manager) == [4]


def test_recovers_from_a_disk_that_was_full_for_a_while(tmp_path: Path) -> None:
    """A failed save removes its partial location, and the remains of earlier interrupted
    saves, keeping every committed checkpoint: partial saves were removed only after a
    successful save, which a full disk never allowed, so each step added one more."""
    disk = faults.DiskFull()
    manager = CheckpointManager(
        tmp_path / "run", keep_last=2,
        store_factory=lambda loc: faults.FaultyStore(LocalStore(loc), disk=disk),
        **SMALL_CHUNKING,
    )
    manager.maybe_save(1, small_state(1))
    manager.maybe_save(2, small_state(2))
    # the remains of a save killed earlier (marker and a stored object), which the record
    # of the manager that was killed says it began
    LocalStore(manager.location(3)).put("write-in-progress.ucp.json", [b"{}"])
    LocalStore(manager.location(3)).put("model/fc.bias/c/0", [b"x"])
    _record_began(tmp_path / "run", 3)
    manager = CheckpointManager(
        tmp_path / "run", keep_last=2,
        store_factory=lambda loc: faults.FaultyStore(LocalStore(loc), disk=disk),
        **SMALL_CHUNKING,
    )
    disk.fill()
    for step in (4, 5, 6):
        with pytest.raises(UCPError, match="No space left"):
            manager.maybe_save(step, small_state(step))
        assert _steps(manager) == [1, 2]  # no partial location; both committed ones stay
    disk.free()
    manager.maybe_save(7, small_state(7))
    assert _steps(manager) == [2, 7]
    with manager.restore() as ckpt:  # type: ignore[union-attr]
        assert differences(ckpt.to_dict(), small_state(7)) == []


def test_skips_a_corrupt_newest_checkpoint_with_a_warning(tmp_path: Path) -> None:
    """A damaged newest checkpoint is skipped on restart (deep check), with a warning."""
    manager = CheckpointManager(tmp_path / "run", keep_last=3, **SMALL_CHUNKING)
    for step in (1, 2):
        manager.maybe_save(step, small_state(step))
    _flip_a_chunk(manager.location(2))
    assert manager.latest_valid(deep=False).step == 2  # type: ignore[union-attr]
    with pytest.warns(CheckpointWarning, match="step 2.*CRC32C"):
        latest = manager.latest_valid(deep=True)
    assert latest is not None and latest.step == 1
    with pytest.warns(CheckpointWarning), manager.restore(deep=True) as ckpt:  # type: ignore[union-attr]
        assert differences(ckpt.to_dict(), small_state(1)) == []


def test_a_valid_checkpoint_of_the_same_step_is_kept(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", **SMALL_CHUNKING)
    manager.maybe_save(7, small_state(7))
    with pytest.warns(CheckpointWarning, match="already saved"):
        manager.maybe_save(7, small_state(8))
    with ucpformat.open(manager.location(7)) as ckpt:
        assert differences(ckpt.to_dict(), small_state(7)) == []


def test_killed_saves_and_deletions_never_lose_the_last_good_checkpoint(
    tmp_path: Path,
) -> None:
    """Writers killed at every kind of step of maybe_save (saving, verifying, pruning):
    afterwards a valid checkpoint is always found, and it is the newest committed one."""
    root = tmp_path / "run"
    manager = CheckpointManager(root, keep_last=1, **SMALL_CHUNKING)
    manager.maybe_save(0, small_state(0))
    trace: list[tuple[str, str]] = []
    dry = CheckpointManager(tmp_path / "dry", keep_last=1,
                            store_factory=lambda loc: faults.FaultyStore(LocalStore(loc),
                                                                         trace=trace),
                            **SMALL_CHUNKING)
    dry.maybe_save(0, small_state(0))
    trace.clear()
    dry.maybe_save(1, small_state(1))
    n_ops = len(trace)
    rng = np.random.default_rng(1)
    points = sorted({0, n_ops - 1, n_ops - 5, *rng.integers(0, n_ops, 6).tolist()})
    step = 0
    for kill_at in points:
        step += 1
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            counter = faults.OpCounter()  # one count over every store the manager opens
            child = CheckpointManager(
                root, keep_last=1,
                store_factory=lambda loc, k=kill_at, c=counter: faults.FaultyStore(
                    LocalStore(loc, durable=False), kill_at=k, counter=c
                ),
                **SMALL_CHUNKING,
            )
            try:
                child.maybe_save(step, small_state(step))
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        manager = CheckpointManager(root, keep_last=1, **SMALL_CHUNKING)  # a restart
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            latest = manager.latest_valid(deep=True)
        assert latest is not None, f"killed at {kill_at}: no valid checkpoint left"
        with ucpformat.open(latest.location) as ckpt:
            assert differences(ckpt.to_dict(), small_state(latest.step)) == []
        committed = [e.step for e in manager.checkpoints()
                     if (Path(e.location) / "zarr.json").exists()]
        # the newest committed one, unless it was killed before its record said "saved"
        # (then it is not restored: nothing vouches for it)
        record = manager.record()
        newer = [s for s in committed if s > latest.step]
        assert all(record[step_name(s)]["state"] == "saving" for s in newer), kill_at
        assert len(newer) <= 1
    # and a normal save afterwards cleans up the debris
    step += 1
    manager.maybe_save(step, small_state(step))
    assert _steps(manager) == [step]


def test_works_with_ucpformat_torch_save(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import ucpformat.torch as ucpt

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = CheckpointManager(tmp_path / "run", save_every=2, keep_last=2)
    weights = {}
    for step in range(6):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        weights[step] = model.weight.detach().clone()
        manager.maybe_save(
            step, lambda path, step=step: ucpt.save(path, model=model, optimizer=opt, step=step)
        )
    assert _steps(manager) == [2, 4]
    fresh = torch.nn.Linear(4, 3)
    latest = manager.latest_valid()
    assert latest is not None
    result = ucpt.load(latest.location, model=fresh)
    assert result.step == 4
    assert torch.equal(fresh.weight, weights[4])


def test_bad_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError):
        CheckpointManager("x", keep_last=0)
    with pytest.raises(UCPError):
        CheckpointManager("x").maybe_save(1, {"model": "not a group"})
    # the failed save left nothing, not even its entry in the record
    assert CheckpointManager("x").record() == {}
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["ucp-manager.json"]
