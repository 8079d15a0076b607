"""``ucp demo --framework deepspeed`` at its quick size, run by tests/deepspeed/harness.py:
the resumed loss curves follow the uninterrupted one within the stated tolerance."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

from ucpformat.torch.demo import DEFAULT_RTOL, QUICK  # noqa: E402


def test_resumed_curves_follow_the_uninterrupted_run(ds_run: Path,
                                                     results: dict[str, Any]) -> None:
    demo = results["demo"]
    losses = demo["losses"]
    assert len(losses["A"]) == QUICK.steps
    for key in ("B", "C", "control"):
        assert len(losses[key]) == QUICK.steps - QUICK.save_at
    assert demo["rtol"] == DEFAULT_RTOL
    assert demo["max_rel_diff"]["B"] <= DEFAULT_RTOL, demo["max_rel_diff"]
    assert demo["max_rel_diff"]["C"] <= DEFAULT_RTOL, demo["max_rel_diff"]
    assert demo["ok"]
    # the tolerance sees an optimizer state that was not resumed
    assert demo["max_rel_diff"]["control"] > 10 * DEFAULT_RTOL, demo["max_rel_diff"]
    out = ds_run / "demo"
    assert (out / "losses.csv").read_text().count("\n") == QUICK.steps + 1
    assert (out / f"checkpoint-step-{QUICK.save_at}" / "zarr.json").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "resume.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_chooses_the_framework() -> None:
    from ucpformat.cli.demo import register

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub, argparse.ArgumentParser(add_help=False))
    args = parser.parse_args(["demo", "--framework", "deepspeed", "--quick"])
    assert args.framework == "deepspeed" and args.quick
    assert parser.parse_args(["demo"]).framework == "torch"
