"""The README's Python example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 1
    assert len(blocks[0].strip().splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], str(README), "exec"), {"__name__": "readme"})
    assert "(16, 128)" in capsys.readouterr().out
    assert (tmp_path / "ckpt" / "zarr.json").is_file()


def test_readme_names_every_command() -> None:
    from ucpformat.cli import COMMANDS

    text = README.read_text(encoding="utf-8")
    for module in COMMANDS:
        assert f"`ucp {module.__name__.rsplit('.', 1)[1]} " in text
