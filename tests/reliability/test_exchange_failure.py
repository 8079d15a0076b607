"""A rank that fails mid-exchange: no hang, every rank raises, nothing committed, and the
checkpoint being replaced intact (UCP-1.0-R132, UCP-1.0-R053).

The failing rank's values become unreadable after the plan is made
(``ucpformat.testing.faults.FailingArray``), while its peer expects cells from it: the
shards are coarser than either rank's rows, so each is assembled by one owner from both.
The save replaces a committed checkpoint in place (``overwrite=True``). The DCP plugin's
counterpart is in tests/torch/test_dcp_plugin.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import ucpformat
from ucpformat.distributed.comm import Communicator, run_threads
from ucpformat.errors import WriteError
from ucpformat.store import LocalStore
from ucpformat.testing import faults
from ucpformat.testing.common import SMALL_CHUNKING, differences, small_state, tree_bytes

REPO = Path(__file__).resolve().parents[2]
SEED_A, SEED_B = 1, 2


@pytest.fixture
def previous(tmp_path: Path) -> Path:
    """The committed checkpoint A that the failing save was to replace."""
    path = tmp_path / "previous"
    ucpformat.save(path, small_state(SEED_A), **SMALL_CHUNKING)
    return path


@pytest.mark.parametrize("victim", [0, 1])
def test_a_rank_failing_mid_exchange_over_threads(previous: Path, victim: int) -> None:
    assert faults.exchange_sends(SEED_B, victim) > 0  # its peer expects cells from it
    before = tree_bytes(previous)
    parts = faults.distributed_parts(SEED_B, 2)
    errors: list[BaseException | None] = [None, None]

    def rank_main(comm: Communicator) -> None:
        try:  # caught here: run_threads must not break the barrier of a waiting rank
            faults.exchange_save(LocalStore(previous), comm, parts, victim=victim, reads=0)
        except BaseException as exc:
            errors[comm.rank] = exc

    run_threads(2, rank_main, timeout=60)
    hung = [r for r, e in enumerate(errors) if isinstance(e, threading.BrokenBarrierError)]
    assert not hung, f"ranks {hung} waited 60 s in a collective for the one that failed"
    for rank, error in enumerate(errors):  # every rank raises, naming the failure
        assert isinstance(error, WriteError), (rank, error)
        assert "injected" in str(error) and "nothing was committed" in str(error)
    assert isinstance(errors[victim].__cause__, faults.InjectedFault)  # type: ignore[union-attr]
    # nothing committed, nothing touched: the old checkpoint, file for file, and it loads
    assert tree_bytes(previous) == before
    with ucpformat.open(previous) as ckpt:
        assert differences(ckpt.to_dict(), small_state(SEED_A)) == []
    # the same save without the fault replaces it
    run_threads(2, lambda comm: faults.exchange_save(LocalStore(previous), comm, parts,
                                                     victim=victim, reads=-1))
    with ucpformat.open(previous) as ckpt:
        assert differences(ckpt.to_dict(), parts.expected) == []


@pytest.mark.distributed
def test_a_rank_failing_mid_exchange_over_gloo(tmp_path: Path, previous: Path) -> None:
    """save_distributed over two gloo processes (TorchCommunicator); the coordinator is
    the rank that fails (it must also withdraw its marker from the old checkpoint)."""
    pytest.importorskip("torch.distributed")
    trial = faults.Trial("gloo", "raise", "exchange", "raise", victim=0, fail_reads=0)
    errors = faults.run_raise_trial(trial, tmp_path, previous, SEED_A, SEED_B, timeout=120)
    assert errors is not None, trial.problems  # no rank hung
    assert all(e is not None and "injected" in e for e in errors), errors
    assert trial.outcome == "old-intact" and not trial.lost
    assert trial.problems == []  # the location unchanged, valid; the retried save works


def test_stress_mode_tries_mid_exchange_failures() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "ucpformat.testing.faults", "--json", "--trials", "0",
         "--exchange-trials", "4", "--cli-every", "0"],
        capture_output=True, text=True, timeout=240, cwd=REPO, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    assert figures["trials"] == 4
    assert figures["trials per scenario/phase"] == {"threads/exchange": 4}
    assert figures["outcomes"] == {"old-intact": 4}
    assert figures["checkpoints lost"] == 0 and figures["trials with any failed check"] == 0
