"""Issue 31 on the DeepSpeed doors, without engines: ``latest`` through a link (item 4),
counters of another kind (item 6), ``engine.load_checkpoint`` with the plug-in (item 7)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ucpformat
from ucpformat.errors import UCPError, UnsafePathError
from ucpformat.testing.common import SMALL_CHUNKING, small_state

pytest.importorskip("torch")


def _planted_latest(tmp_path: Path) -> Path:
    """``run/latest`` names ``evil``, a link to a valid checkpoint outside ``run``."""
    run = tmp_path / "run"
    ucpformat.save(run / "good", small_state(1), durable=False, **SMALL_CHUNKING)
    ucpformat.save(tmp_path / "outside", small_state(2), durable=False, **SMALL_CHUNKING)
    (run / "evil").symlink_to(tmp_path / "outside", target_is_directory=True)
    (run / "latest").write_text("evil")
    return run


def test_latest_naming_a_link_is_refused(tmp_path: Path) -> None:
    """Before: ``load`` opened ``run/evil`` and loaded the checkpoint outside."""
    from ucpformat.deepspeed.load import load, open_location, resolve_location

    run = _planted_latest(tmp_path)
    with pytest.raises(UnsafePathError, match="R089"):
        resolve_location(run)
    with pytest.raises(UnsafePathError, match="R089"):
        open_location(run)
    with pytest.raises(UCPError, match="R089"):
        load(object(), run)  # refused on opening, before the engine is looked at
    (run / "latest").write_text("good")
    with open_location(run) as ckpt:
        assert ckpt.values("training")["step"] == small_state(1)["training"]["step"]
    assert resolve_location(run) == os.fspath(run / "good")
    # the caller's own path (and a tag the caller gives) may still be a link
    (tmp_path / "mine").symlink_to(run / "good", target_is_directory=True)
    with open_location(tmp_path / "mine") as ckpt:
        assert "model/fc.weight" in ckpt


@pytest.mark.parametrize("training", [
    {"step": "abc"}, {"step": 2**70}, {"step": -5}, {"step": True}, {"step": 3.0},
    {"step": 3, "global_samples": 1.5}, {"step": 3, "skipped_steps": -1},
    {"global_samples": 10},
])
def test_counters_of_another_kind_are_refused(training: dict[str, object]) -> None:
    """Before: "abc" left global_steps unchanged and result.step None; 2**70 and -5 were
    accepted; global_samples 1.5 became 1."""
    from ucpformat.deepspeed.load import check_counters
    from ucpformat.errors import LoadError

    with pytest.raises(LoadError, match=r"training/(step|global_samples|skipped_steps)"):
        check_counters(training, where="ckpt")


def test_counters_of_the_engines_kind_load() -> None:
    from ucpformat.deepspeed.load import check_counters

    check_counters({"step": 0, "global_samples": 2**63 - 1, "skipped_steps": 2}, where="c")
    check_counters({"epoch": "abc"}, where="c")  # client state: not a counter


class _Engine:
    """What DeepSpeed 0.19.8's engine does on load_checkpoint of a UCP checkpoint: its
    SDLoaderBase.check_ckpt_list asserts that mp_rank_* files exist, before any
    checkpoint engine's load is called."""

    def __init__(self) -> None:
        self.checkpoint_engine: object = None
        self.calls = 0

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str, dict]:
        self.calls += 1
        ckpt_list: list[str] = []
        assert len(ckpt_list) > 0
        return load_dir, {}


def test_load_checkpoint_with_the_plugin_names_the_ucp_load(tmp_path: Path) -> None:
    """Before: a bare AssertionError from DeepSpeed's check_ckpt_list; the documented
    message pointing to ucpformat.deepspeed.load never appeared."""
    from ucpformat.deepspeed.plugin import UCPCheckpointEngine
    from ucpformat.errors import UnsupportedFeatureError

    engine = _Engine()
    engine.checkpoint_engine = UCPCheckpointEngine(engine)
    with pytest.raises(UnsupportedFeatureError, match=r"ucpformat\.deepspeed\.load"):
        engine.load_checkpoint(tmp_path, tag="global_step3")
    assert engine.calls == 0
    UCPCheckpointEngine(engine)  # made again: one guard
    engine.checkpoint_engine = None  # the user went back to DeepSpeed's engine
    with pytest.raises(AssertionError):
        engine.load_checkpoint(tmp_path)
    assert engine.calls == 1
