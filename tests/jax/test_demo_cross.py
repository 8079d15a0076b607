"""``ucp demo --framework cross`` at its quick size, end to end: the GPT trained half-way
in PyTorch (TP 2 x FSDP2 2 on 4 gloo processes) and resumed in JAX on a (2, 4) mesh of
8 CPU devices, and the reverse; each resumed curve within the demo's stated tolerance of
the run it resumes, each control (resumed without the optimizer state) far outside it,
and the table, CSV and plot written. The command runs in a process of its own: it forks
its torch workers, which a test process holding JAX's threads must not do."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from ucpformat.cli import cross_demo  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch,
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
]


def test_torch_to_jax_and_back_follow_the_runs_they_resume(tmp_path: Path) -> None:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "ucpformat.cli", "demo", "--framework", "cross", "--quick",
         "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    diff, losses = summary["max_rel_diff"], summary["losses"]
    steps, save_at = summary["config"]["steps"], summary["config"]["save_at"]
    rtol = cross_demo.DEFAULT_RTOL
    assert summary["rtol"] == rtol and summary["ok"]
    assert len(losses["torch"]) == len(losses["jax"]) == steps
    for resumed in ("torch_to_jax", "jax_to_torch"):
        assert len(losses[resumed]) == len(losses[resumed + "_control"]) == steps - save_at
        # the claim, with the stated tolerance ...
        assert diff[resumed] <= rtol, diff
        # ... which is tight enough to see an optimizer state that was not resumed
        assert diff[resumed + "_control"] > 10 * rtol, diff
    # the first resumed step uses the loaded weights only (bit-equal, transposed): the
    # same loss up to the kernels' rounding
    for resumed, reference in (("torch_to_jax", "torch"), ("jax_to_torch", "jax")):
        first = losses[reference][save_at]
        assert abs(losses[resumed][0] - first) <= 1e-6 * first, (resumed, first)
    # both frameworks wrote a checkpoint the other read
    assert (tmp_path / f"torch-step-{save_at}" / "zarr.json").exists()
    assert (tmp_path / f"jax-step-{save_at}" / "zarr.json").exists()
    table = (tmp_path / "table.md").read_text()
    assert "resumed from PyTorch" in table and "resumed from JAX" in table
    assert table in done.stdout  # printed, and the step-by-step table too
    assert "|J-T|/T" in done.stdout and "within the tolerance" in done.stdout
    assert (tmp_path / "losses.csv").read_text().count("\n") == steps + 1
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "resume.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_verdict_needs_every_resume_inside_and_every_control_outside() -> None:
    curve = [2.0, 1.0, 1.0]

    def outcome(resumed: float, control: float) -> cross_demo.CrossOutcome:
        tail = {"torch_to_jax": [resumed], "jax_to_torch": [1.0],
                "torch_to_jax_control": [1.5], "jax_to_torch_control": [control]}
        o = cross_demo.CrossOutcome(3, 2, 1e-3, {"torch": curve, "jax": curve, **tail})
        o.compare()
        return o

    assert outcome(1.0, 1.5).ok
    assert not outcome(1.01, 1.5).ok  # a resume outside the tolerance
    assert not outcome(1.0, 1.0).ok  # a control inside it: the tolerance sees nothing
    assert outcome(1.0005, 1.5).max_rel_diff["torch_to_jax"] == pytest.approx(5e-4)
