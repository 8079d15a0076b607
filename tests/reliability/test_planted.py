"""The manager under plantings (ucpformat.testing.planted): the quick mode of make stress's
run, and the harness noticing the defect of issue 31 put back."""

from __future__ import annotations

from typing import Any

import pytest

from ucpformat.checkpoint.manager import CheckpointManager
from ucpformat.testing import planted


def test_one_trial_of_each_kind() -> None:
    figures = planted.run(1, seed=3)
    out = figures.as_dict()
    assert figures.failures == []
    assert out["restored foreign"] == out["deleted foreign"] == out["deleted own"] == 0
    assert out["unreported plants"] == 0
    assert out["restored own"] + out["refused"] == out["trials"]


def test_the_harness_notices_foreign_checkpoints_taken_for_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the manager's check of its record taken away (every committed checkpoint its
    own, as before issue 31), a planted newest checkpoint is restored and the run's own
    saves deleted."""

    def everything_is_own(self: CheckpointManager, entry: Any, record: Any = None) -> None:
        return None

    monkeypatch.setattr(CheckpointManager, "foreign", everything_is_own)
    figures = planted.run(2, seed=1, kinds=["planted-newest"])
    assert figures.outcomes["restored foreign"] >= 1
    assert figures.deleted_own >= 1
