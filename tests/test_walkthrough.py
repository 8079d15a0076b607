"""The docs' code blocks run as written: the new user's walk-through (docs/walkthrough.md)
in order, as one Python session and a shell, and the examples of docs/torch.md."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(python|sh)\n(.*?)^```", re.M | re.S)


def blocks(page: Path) -> list[tuple[str, str]]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def run_shell(block: str, cwd: Path) -> None:
    """Each line as a user types it; ``ucp`` is the command the package installs (here
    run as ``python -m ucpformat.cli``, the same entry point, from this checkout)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for line in block.strip().splitlines():
        argv = shlex.split(line)
        if argv[0] == "ucp":
            argv = [sys.executable, "-m", "ucpformat.cli", *argv[1:]]
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env,
                              timeout=300)
        assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"


def run_page(page: Path, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.chdir(cwd)
    session: dict[str, object] = {"__name__": page.stem}
    found = blocks(page)
    for language, code in found:
        if language == "python":
            exec(compile(code, str(page), "exec"), session)
        else:
            run_shell(code, cwd)
    return len(found)


@pytest.mark.torch
def test_the_walkthrough_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    page = REPO / "docs" / "walkthrough.md"
    languages = [language for language, _ in blocks(page)]
    assert languages.count("sh") >= 2 and languages.count("python") >= 5
    assert run_page(page, tmp_path, monkeypatch) == len(languages)
    out = capsys.readouterr().out
    assert "resumed at step 20" in out
    for made in ("run/step-20/zarr.json", "hf-ucp/zarr.json", "hf-back/model.safetensors"):
        assert (tmp_path / made).is_file(), made


@pytest.mark.torch
def test_the_torch_page_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    page = REPO / "docs" / "torch.md"
    assert run_page(page, tmp_path, monkeypatch) >= 2
    assert (tmp_path / "weights" / "zarr.json").is_file()
