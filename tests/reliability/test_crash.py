"""Crash consistency (UCP-1.0-R050 to R056, R132): writers killed at every step of a save.

The harness (ucpformat.testing.faults) runs in its own process, as ``make stress`` runs
it with more trials: it forks writers and kills them, which is safest from a process
that has no other threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.errors import IncompleteCheckpointError
from ucpformat.store import LocalStore
from ucpformat.testing import faults
from ucpformat.testing.common import SMALL_CHUNKING, small_state

REPO = Path(__file__).resolve().parents[2]


def _harness(*args: str, timeout: float = 240) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ucpformat.testing.faults", "--json", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout + proc.stderr
    figures: dict[str, Any] = json.loads(lines[-1])
    figures["_output"] = proc.stdout
    figures["_rc"] = proc.returncode
    return figures


def test_quick_crash_trials_lose_nothing() -> None:
    """UCP-1.0-R050, UCP-1.0-R051, UCP-1.0-R053, UCP-1.0-R054: dozens of killed saves."""
    figures = _harness("--trials", "42", "--seed", "7", "--cli-every", "0")
    assert figures["_rc"] == 0, figures["_output"]
    assert figures["trials"] == 42
    assert figures["checkpoints lost"] == 0
    assert figures["trials with any failed check"] == 0
    phases = {k.split("/")[1] for k in figures["trials per scenario/phase"]}
    assert set(faults.PHASES) <= phases  # every phase of a save was hit
    assert figures["outcomes"].get("refused", 0) > 0
    assert figures["outcomes"].get("committed", 0) > 0


@pytest.mark.distributed
def test_killed_rank_of_a_gloo_save_commits_nothing() -> None:
    """UCP-1.0-R132: one rank of a two-process gloo save is killed; the other fails, no hang."""
    pytest.importorskip("torch.distributed")
    figures = _harness("--trials", "0", "--gloo-trials", "2", "--seed", "3", "--cli-every", "0")
    assert figures["_rc"] == 0, figures["_output"]
    assert figures["trials"] == 2
    assert figures["checkpoints lost"] == 0
    assert figures["writers killed"] == 2


def test_trace_covers_every_phase(tmp_path: Path) -> None:
    trace, _ = faults.dry_run("overwrite", 1, 2, tmp_path)
    phases = [faults.phase_of(trace, i) for i in range(len(trace))]
    assert phases[0] == "prepare" and phases[-1] == "cleanup"
    assert phases.index("data") < phases.index("metadata") < phases.index("manifest")
    assert phases.index("manifest") < phases.index("commit")
    assert phases.count("commit") == 1


def test_partial_marker_still_lets_the_save_be_retried(tmp_path: Path) -> None:
    """UCP-1.0-R056: a crash while writing the in-progress marker leaves a location the
    same save can be retried into, and that every reader refuses meanwhile (R051)."""
    target = tmp_path / "ckpt"
    LocalStore(target).put("write-in-progress.ucp.json", [b'{"wri'])
    with pytest.raises(IncompleteCheckpointError) as info:
        ucpformat.open(target)
    assert info.value.rule == "UCP-1.0-R051"
    assert "UCP-1.0-R051" in ucpformat.validate(target).rules()
    state = small_state(1)
    ucpformat.save(target, state, **SMALL_CHUNKING)
    with ucpformat.open(target) as ckpt:
        assert np.array_equal(ckpt["model/fc.bias"].read(), state["model"]["fc.bias"])


def test_faulty_store_kills_at_the_chosen_operation(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        store = faults.FaultyStore(LocalStore(tmp_path / "x", durable=False), kill_at=2,
                                   mode="torn")
        store.put("a", [b"1"])
        store.put("b", [b"2"])
        store.put("c", [b"0123456789"])
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    assert (tmp_path / "x" / "c").read_bytes() == b"01234"  # torn: half of it
