"""What a new user tripped on (issue 29), on the command line: each test failed before its
fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ucpformat
from tests.helpers import ucp

# -- item 6: a DeepSpeed save directory's 'latest' tag ------------------------------------------


@pytest.fixture
def save_dir(tmp_path: Path) -> Path:
    """A save directory as DeepSpeed leaves it: checkpoints per tag, 'latest' naming one."""
    base = tmp_path / "run"
    for step in (1, 2):
        ucpformat.save(base / f"global_step{step}",
                       {"model": {"w": np.full((4,), step, np.float32)}}, durable=False)
    (base / "latest").write_text("global_step2")
    return base


def test_commands_follow_latest(capsys: pytest.CaptureFixture[str], save_dir: Path) -> None:
    code, out, err = ucp(capsys, "validate", str(save_dir))
    assert code == 0, out + err
    assert "global_step2" in out and "'latest' file names 'global_step2'" in err
    code, out, err = ucp(capsys, "inspect", str(save_dir))
    assert code == 0, out + err
    code, out, err = ucp(capsys, "diff", str(save_dir), str(save_dir / "global_step2"))
    assert code == 0, out + err
    code, out, _ = ucp(capsys, "diff", str(save_dir), str(save_dir / "global_step1"))
    assert code == 1


def test_without_latest_the_error_names_the_tags(capsys: pytest.CaptureFixture[str],
                                                 save_dir: Path) -> None:
    (save_dir / "latest").unlink()
    for command in ("validate", "inspect"):
        code, out, err = ucp(capsys, command, str(save_dir))
        assert code == 2
        assert "checkpoints inside it: global_step1, global_step2" in out + err, command


def test_a_latest_that_escapes_is_refused(capsys: pytest.CaptureFixture[str],
                                          save_dir: Path) -> None:
    (save_dir / "latest").write_text("../elsewhere")
    code, out, err = ucp(capsys, "inspect", str(save_dir))
    assert code == 2
    assert "not a directory name of this directory" in out + err


# -- item 10: what a shallow validation did not check; deep by default in CI ---------------------


@pytest.fixture
def flipped(tmp_path: Path) -> Path:
    """A checkpoint with one byte of a chunk flipped (no SHA-256 in its manifest)."""
    path = tmp_path / "ckpt"
    ucpformat.save(path, {"model": {"w": np.arange(64, dtype=np.float32)}}, durable=False)
    victim = next(p for p in (path / "model" / "w").rglob("*")
                  if p.is_file() and p.name != "zarr.json")
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 0x40
    victim.write_bytes(bytes(raw))
    return path


def test_shallow_success_says_what_it_did_not_check(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    flipped: Path) -> None:
    monkeypatch.delenv("UCP_VALIDATE_DEEP", raising=False)
    code, out, _ = ucp(capsys, "validate", str(flipped))
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    assert "no chunk read: damage inside a chunk goes unnoticed" in lines[0]
    assert "UCP_VALIDATE_DEEP=1" in lines[0]


def test_environment_makes_validate_deep(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch, flipped: Path) -> None:
    monkeypatch.setenv("UCP_VALIDATE_DEEP", "1")
    code, out, _ = ucp(capsys, "validate", str(flipped))
    assert code == 1, out
    assert "[UCP-1.0-R041]" in out  # the chunk's CRC32C
    assert ucp(capsys, "validate", "--shallow", str(flipped))[0] == 0
    monkeypatch.setenv("UCP_VALIDATE_DEEP", "0")
    assert ucp(capsys, "validate", str(flipped))[0] == 0
    assert ucp(capsys, "validate", "--deep", str(flipped))[0] == 1
    monkeypatch.setenv("UCP_VALIDATE_DEEP", "maybe")
    code, out, err = ucp(capsys, "validate", str(flipped))
    assert code == 2
    assert "UCP_VALIDATE_DEEP='maybe'" in out + err
