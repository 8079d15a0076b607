"""The resume-anywhere demo, small: resumed curves within the stated tolerance."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from ucpformat.torch import demo  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
]


def test_resume_on_other_layouts_follows_the_uninterrupted_run(tmp_path: Path) -> None:
    lines: list[str] = []
    def log(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    outcome = demo.run_demo(tmp_path, demo.QUICK, log=log, timeout=300)
    cfg = demo.QUICK
    assert len(outcome.losses["A"]) == cfg.steps
    for key in ("B", "C", "control"):
        assert len(outcome.losses[key]) == cfg.steps - cfg.save_at
    # the claim of the demo, with its stated tolerance
    assert outcome.rtol == demo.DEFAULT_RTOL
    assert outcome.max_rel_diff["B"] <= demo.DEFAULT_RTOL, outcome.max_rel_diff
    assert outcome.max_rel_diff["C"] <= demo.DEFAULT_RTOL, outcome.max_rel_diff
    assert outcome.ok
    # ... and the tolerance is tight enough to see an optimizer state that was not resumed
    assert outcome.max_rel_diff["control"] > 10 * demo.DEFAULT_RTOL, outcome.max_rel_diff
    # the first resumed step uses the loaded weights only: the same loss up to rounding
    first = outcome.losses["A"][cfg.save_at]
    assert abs(outcome.losses["C"][0] - first) <= 1e-6 * first
    assert (tmp_path / "losses.csv").read_text().count("\n") == cfg.steps + 1
    assert (tmp_path / f"checkpoint-step-{cfg.save_at}" / "zarr.json").exists()
    table = "\n".join(lines)
    assert "A (uninterrupted)" in table and "within the tolerance" in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "resume.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_arguments() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--quick", "--steps", "10", "--out", "x"])
    assert args.quick and args.steps == 10 and args.out == "x"
    assert args.rtol == demo.DEFAULT_RTOL
