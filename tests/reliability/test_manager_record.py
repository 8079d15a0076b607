"""The manager knows which checkpoints it wrote (issue 31, items 1-3): a planted checkpoint,
a checkpoint replaced at one of its names, a planted record and odd step names never make
it restore, count or delete what it did not write without saying so."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest

import ucpformat
from ucpformat.checkpoint.manager import (
    RECORD_KEY,
    CheckpointManager,
    CheckpointWarning,
    parse_step_name,
    step_name,
)
from ucpformat.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ManagerRecordError,
    UCPError,
)
from ucpformat.testing.common import SMALL_CHUNKING, differences, small_state


def _plant(root: Path, name: str, seed: int = 99) -> Path:
    """A valid checkpoint someone else wrote, at ``root/name``."""
    ucpformat.save(root / name, small_state(seed), durable=False, **SMALL_CHUNKING)
    return root / name


def _manager(root: Path, **kwargs: object) -> CheckpointManager:
    return CheckpointManager(root, durable=False, **SMALL_CHUNKING, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("keep_last", [1, 3])
def test_a_planted_newest_checkpoint_is_never_restored_counted_or_deleted(
    tmp_path: Path, keep_last: int
) -> None:
    """Before: with keep_last=1 the run's own new save was deleted right after it was
    written, and restore() returned the planted one every time."""
    root = tmp_path / "run"
    manager = _manager(root, keep_last=keep_last)
    manager.maybe_save(1, small_state(1))
    planted = _plant(root, "step-999999999999")
    with pytest.warns(CheckpointWarning, match="step 999999999999.*not written by this manager"):
        for step in (2, 3, 4):
            manager.maybe_save(step, small_state(step))
    assert (planted / "zarr.json").exists()  # never deleted
    assert manager.all_steps() == [2, 3, 4][-keep_last:]  # the planted one takes no slot
    assert manager.latest_step() == 4
    with manager.restore() as ckpt:  # type: ignore[union-attr]
        assert differences(ckpt.to_dict(), small_state(4)) == []
    with pytest.raises(CheckpointNotFoundError, match="not written by this manager"):
        manager.restore(999999999999)
    restarted = _manager(root, keep_last=keep_last)
    with pytest.warns(CheckpointWarning, match="not written by this manager"):
        assert restarted.latest_step() == 4


def test_rotation_deletes_only_what_it_wrote(tmp_path: Path) -> None:
    """Before: step-0000000004 and step-00000000012 planted beside the manager's own were
    removed by the next rotation."""
    root = tmp_path / "run"
    manager = _manager(root, keep_last=1)
    manager.maybe_save(1, small_state(1))
    for name in ("step-0000000004", "step-00000000012", "step-0000000002"):
        _plant(root, name)
    (root / "step-0000000003").mkdir()  # remains? not of its saves
    (root / "step-0000000003" / "write-in-progress.ucp.json").write_text("{}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (5, 13, 20):
            manager.maybe_save(step, small_state(step))
    said = " ".join(str(w.message) for w in caught)
    for name in ("step-0000000004", "step-00000000012", "step-0000000002", "step-0000000003"):
        assert (root / name).exists(), name
        assert name in said, name
    assert manager.all_steps() == [20]
    assert not (root / "step-0000000005").exists() and not (root / "step-0000000013").exists()


def test_step_names_and_locations_agree(tmp_path: Path) -> None:
    """Before: step-00000000012 (11 digits) was read as step 12, whose location is
    step-0000000012, so restore(latest_step()) raised and load(location(start)) loaded
    another directory."""
    assert step_name(12) == "step-0000000012"
    assert parse_step_name("step-0000000012") == 12
    assert parse_step_name("step-00000000012") is None
    assert parse_step_name("step-99999999999") == 99999999999
    assert step_name(99999999999) == "step-99999999999"
    for odd in ("step-12", "step-+000000012", "step-0000000012 ", "step-٠٠٠٠٠٠٠٠١٢", "x"):
        assert parse_step_name(odd) is None, odd
    with pytest.raises(ValueError):
        step_name(True)
    root = tmp_path / "run"
    _plant(root, "step-00000000012")
    manager = _manager(root)
    with pytest.warns(CheckpointWarning, match="step-00000000012.*not a name this manager"):
        manager.maybe_save(5, small_state(5))
    with pytest.warns(CheckpointWarning, match="step-00000000012.*not a name this manager"):
        steps = [e.step for e in _manager(root).checkpoints()]
    assert steps == [5]
    start = manager.latest_step()
    assert start == 5
    assert manager.location(start) == str(root / "step-0000000005")
    with manager.restore(start) as ckpt:  # type: ignore[union-attr]
        assert differences(ckpt.to_dict(), small_state(5)) == []


def test_a_checkpoint_replaced_at_its_own_name_is_refused_and_kept(tmp_path: Path) -> None:
    root = tmp_path / "run"
    manager = _manager(root, keep_last=1)
    manager.maybe_save(1, small_state(1))
    manager.maybe_save(2, small_state(2))
    shutil.rmtree(root / "step-0000000002")
    _plant(root, "step-0000000002", seed=77)
    with pytest.raises(CheckpointNotFoundError, match="differs from the one recorded"):
        manager.restore(2)
    with pytest.warns(CheckpointWarning, match="differs from the one recorded"):
        assert manager.latest_step() is None
    with pytest.raises(CheckpointExistsError, match="differs from the one recorded"):
        manager.maybe_save(2, small_state(2))  # never written over, nor deleted
    manager.maybe_save(3, small_state(3))
    assert (root / "step-0000000002" / "zarr.json").exists()
    assert manager.all_steps() == [3]


def test_a_planted_record_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    manager = _manager(root, keep_last=1)
    manager.maybe_save(1, small_state(1))
    planted = _plant(root, "step-0000000009")
    with open(planted / "zarr.json", "rb") as f:
        import hashlib

        digest = hashlib.sha256(f.read()).hexdigest()
    doc = json.loads((root / RECORD_KEY).read_text())
    doc["checkpoints"]["step-0000000009"] = {"step": 9, "state": "saved", "root_sha256": digest}
    (root / RECORD_KEY).write_text(json.dumps(doc))
    # the live manager: the record is not the one it wrote
    with pytest.raises(ManagerRecordError, match="changed since this manager wrote it"):
        manager.latest_step()
    with pytest.raises(ManagerRecordError):
        manager.maybe_save(2, small_state(2))
    assert planted.exists() and (root / "step-0000000001" / "zarr.json").exists()
    # with a record key, a restarted manager refuses a record it did not sign
    keyed = tmp_path / "keyed"
    _manager(keyed, record_key=b"secret").maybe_save(1, small_state(1))
    _plant(keyed, "step-0000000009")
    doc = json.loads((keyed / RECORD_KEY).read_text())
    doc["checkpoints"]["step-0000000009"] = {"step": 9, "state": "saved", "root_sha256": digest}
    (keyed / RECORD_KEY).write_text(json.dumps(doc))
    with pytest.raises(ManagerRecordError, match="HMAC"):
        _manager(keyed, record_key=b"secret").latest_step()
    assert _manager(tmp_path / "keyed", record_key="wrong").all_steps is not None
    with pytest.raises(ManagerRecordError, match="HMAC"):
        _manager(keyed, record_key="wrong").restore()
    if os.geteuid() == 0:  # a record another user wrote
        os.chown(root / RECORD_KEY, 65534, 65534)
        with pytest.raises(ManagerRecordError, match="belongs to user 65534"):
            _manager(root).latest_step()


def test_adopt_takes_a_checkpoint_explicitly(tmp_path: Path) -> None:
    """Checkpoints of a root without a record (an earlier version's) are not restored
    silently; adopt() takes one, saying so by being called."""
    root = tmp_path / "run"
    _plant(root, "step-0000000007", seed=7)
    manager = _manager(root)
    with pytest.warns(CheckpointWarning, match="adopt"):
        assert manager.latest_step() is None
    assert manager.adopt(7).step == 7
    assert manager.latest_step() == 7
    with manager.restore(7) as ckpt:  # type: ignore[union-attr]
        assert differences(ckpt.to_dict(), small_state(7)) == []


def test_ranks_all_refuse_when_rank_0_cannot_trust_the_record(tmp_path: Path) -> None:
    """With comm, a record rank 0 refuses is every rank's refusal (none waits alone in a
    collective for a rank 0 that raised)."""
    import numpy as np

    from ucpformat.distributed.comm import ThreadGroup, run_threads
    from ucpformat.store import LocalStore

    root = tmp_path / "run"
    _manager(root).maybe_save(1, small_state(1))
    (root / RECORD_KEY).write_text("{}")  # not a record of this manager

    def rank_main(comm: ThreadGroup) -> str:
        manager = CheckpointManager(root, comm=comm)
        try:
            manager.maybe_save(2, lambda path: LocalStore(path).put(
                "x", [np.zeros(1).tobytes()]))
        except ManagerRecordError as exc:
            return f"refused: {exc}"
        except UCPError as exc:
            return f"refused by rank 0: {exc}"
        return "saved"

    outcomes = run_threads(2, rank_main, timeout=60)
    assert outcomes[0].startswith("refused: ") and "record" in outcomes[0]
    assert outcomes[1].startswith("refused by rank 0") and "record" in outcomes[1]
    assert not (root / "step-0000000002").exists()
