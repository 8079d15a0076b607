"""The committed cases: well-formed, reproducible, and judged as their expected.json says.

``ucp conformance check`` exits 1 on every invalid case, naming the requirements it
breaks, and 0 on every valid case; the reference validator names every requirement an
invalid case violates.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.conftest import REPO
from ucpformat.conformance import command
from ucpformat.conformance.cases import Case, cases_dir, load_cases, load_scenarios
from ucpformat.conformance.runner import validator_suite
from ucpformat.format import schemas

CASES = load_cases()
SUITE = REPO / "conformance"


def test_there_are_enough_cases() -> None:
    valid = [c for c in CASES if c.valid]
    invalid = [c for c in CASES if not c.valid]
    assert len(valid) >= 15 and len(invalid) >= 80
    writers = {c.expected.get("writer", "").split(" ")[0] for c in valid}
    assert {"tensorstore", "zarr-python", "ucpformat"} <= writers


def test_committed_files_are_small() -> None:
    total = sum(p.lstat().st_size for p in (SUITE / "cases").rglob("*") if p.is_file())
    total += sum(p.stat().st_size for p in (SUITE / "scenarios").rglob("*") if p.is_file())
    assert total < 5 * 2**20, f"{total} bytes"


@pytest.mark.parametrize("path", sorted((SUITE / "cases").glob("*/*/expected.json"))
                         + sorted((SUITE / "scenarios").glob("*/expected.json")),
                         ids=lambda p: str(p.parent.relative_to(SUITE)))
def test_expected_files_are_valid(path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert not schemas.violations("conformance-expected", doc)


def test_scenarios_are_valid() -> None:
    scenarios = load_scenarios()
    assert len(scenarios) >= 6
    for s in scenarios:
        assert not schemas.violations("conformance-scenario", dict(s.document)), s.name
        for t in s.document["tensors"]:
            for local in t["content"].get("locals", []):
                assert (s.directory / local["file"]).is_file()


def test_invalid_cases_break_must_requirements() -> None:
    from ucpformat.conformance.coverage import requirements

    reqs = requirements()
    for case in CASES:
        for rule in [*case.violates, *case.expected.get("also", [])]:
            assert rule in reqs, f"{case.name}: {rule} is not a requirement of spec/"
            assert reqs[rule].level == "MUST", f"{case.name}: {rule} is {reqs[rule].level}"
        for rule in case.expected.get("warnings", []):
            assert reqs[rule].level == "SHOULD", f"{case.name}: {rule}"


def test_reference_validator_names_every_violated_requirement() -> None:
    report = validator_suite(None, strict=True)
    assert report.passed, report.render()
    assert len(report.results) == len(CASES)


def _check_json(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    status = command.main(["check", "--json", str(path)])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_check_command(case: Case, capsys: pytest.CaptureFixture[str]) -> None:
    status, doc = _check_json(case.directory, capsys)
    (result,) = doc["results"]
    assert result["case"]["as_expected"], result["case"]["problems"]
    if case.valid:
        assert status == 0 and result["valid"]
    else:
        assert status == 1 and not result["valid"]
        found = set(result["requirements_found"])
        assert set(case.violates) <= found, (case.violates, found)


def test_check_command_line(tmp_path: Path) -> None:
    """The real command line: exit statuses, the named requirement, JUnit XML."""
    junit = tmp_path / "check.xml"
    cmd = [sys.executable, "-m", "ucpformat.conformance", "check", "--junit", str(junit),
           str(cases_dir() / "invalid" / "missing-chunk")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "UCP-1.0-R031" in proc.stdout and "INVALID" in proc.stdout
    assert "UCP-1.0-R031" in junit.read_text(encoding="utf-8")
    proc = subprocess.run([*cmd[:3], "check", str(cases_dir() / "valid" / "basic" /
                                                  "checkpoint")],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "VALID" in proc.stdout


def test_generation_is_reproducible() -> None:
    """Regenerating the cases gives the committed bytes (python -m conformance.generate)."""
    from conformance import generate

    with tempfile.TemporaryDirectory() as tmp:
        generate.generate(Path(tmp))
        diffs = generate.compare(SUITE, Path(tmp))
    assert not diffs, (
        f"{len(diffs)} generated files differ from the committed ones (run `python -m "
        f"conformance.generate` and commit; if only compressed chunks differ, a codec "
        f"library changed its output): {diffs[:10]}"
    )
