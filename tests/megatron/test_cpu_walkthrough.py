"""docs/megatron.md's CPU walkthrough runs as written (issue 29, item 4): its script,
saved under the name the page gives, then its shell lines, in an empty directory."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_the_cpu_walkthrough_runs(tmp_path: Path) -> None:
    text = (REPO / "docs" / "megatron.md").read_text(encoding="utf-8")
    section = text.split("## On a CPU: a walkthrough that runs as written", 1)[1]
    section = section.split("\n## ", 1)[0]
    (script,) = re.findall(r"^```python\n(.*?)^```", section, re.M | re.S)
    (shell,) = re.findall(r"^```sh\n(.*?)^```", section, re.M | re.S)
    name = re.search(r"Save this as\s+`([\w.]+)`", section)
    assert name is not None
    (tmp_path / name[1]).write_text(script, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outputs = []
    for line in shell.strip().splitlines():
        argv = shlex.split(line)
        if argv[0] == "ucp":
            argv = [sys.executable, "-m", "ucpformat.cli", *argv[1:]]
        elif argv[0] == "python":
            argv[0] = sys.executable
        proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, env=env,
                              timeout=600)
        assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    assert "loaded: the same logits" in outputs[0]
    assert outputs[1].strip().splitlines()[-1].startswith("valid:")
