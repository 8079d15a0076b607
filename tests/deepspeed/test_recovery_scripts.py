"""``engine.save_checkpoint`` with UCPCheckpointEngine leaves no DeepSpeed tool that
cannot work (issue 29, item 5): DeepSpeed's ``zero_to_fp32.py`` fails in a directory of
UCP checkpoints, so it is replaced by a script naming ``ucp export``."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("deepspeed")

import ucpformat
from ucpformat.deepspeed import UCPCheckpointEngine

# the module, which ``ucpformat.deepspeed.save`` (the function) hides
ds_save = importlib.import_module("ucpformat.deepspeed.save")

pytestmark = pytest.mark.torch


def _commit(monkeypatch: pytest.MonkeyPatch, save_dir: Path) -> None:
    """What save_checkpoint does on rank 0 around the engine: DeepSpeed copies its scripts,
    then commit saves (here a stand-in for ucpformat.deepspeed.save) into save_dir/tag."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    def fake_save(engine: Any, path: str, *, tag: str, **_: Any) -> None:
        ucpformat.save(Path(path) / tag, {"model": {"w": np.zeros(4, np.float32)}},
                       durable=False)

    monkeypatch.setattr(ds_save, "save", fake_save)
    save_dir.mkdir(exist_ok=True)
    DeepSpeedEngine._copy_recovery_script(
        SimpleNamespace(_change_recovery_script_permissions=lambda dst: None), str(save_dir))
    plugin = UCPCheckpointEngine(SimpleNamespace(global_rank=0))
    plugin.commit(SimpleNamespace(save_dir=str(save_dir), tag="global_step1"))


def test_zero_to_fp32_points_to_ucp_export(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    _commit(monkeypatch, save_dir)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        text = (save_dir / script).read_text()
        assert "ucp export" in text and "get_fp32_state_dict" not in text, script
    proc = subprocess.run([sys.executable, str(save_dir / "zero_to_fp32.py"), str(save_dir),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "already consolidated" in proc.stderr and "ucp export" in proc.stderr


def test_scripts_that_still_work_are_left(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"  # also holds a DeepSpeed checkpoint: the scripts work for it
    (mixed / "old").mkdir(parents=True)
    (mixed / "old" / "mp_rank_00_model_states.pt").write_bytes(b"")
    _commit(monkeypatch, mixed)
    assert "get_fp32_state_dict" in (mixed / "zero_to_fp32.py").read_text()
    own = tmp_path / "own"  # a user's own file by that name is never touched
    own.mkdir()
    (own / "zero_to_fp32.py").write_text("print('mine')\n")
    plugin = UCPCheckpointEngine(SimpleNamespace(global_rank=0))
    monkeypatch.setattr(ds_save, "save", lambda *a, **k: None)
    plugin.commit(SimpleNamespace(save_dir=str(own), tag="t"))
    assert (own / "zero_to_fp32.py").read_text() == "print('mine')\n"
