"""The reference library passes its own suite: reader, writer and validator adapters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conformance.conftest import REPO, reference
from ucpformat import schemas
from ucpformat.conformance.runner import reader_suite, validator_suite, writer_suite


def test_reference_reader() -> None:
    report = reader_suite(reference())
    assert report.passed, report.render()
    assert report.claim == "passes ucpformat conformance 1.0, reader (layout-aware)"
    checks = {r.check for r in report.results}
    assert {"reader.valid", "reader.invalid", "reader.layout", "reader.contract"} <= checks


def test_reference_writer(tmp_path: Path) -> None:
    report = writer_suite(reference(), keep=tmp_path)
    assert report.passed, report.render()
    assert report.claim == "passes ucpformat conformance 1.0, writer (layout-aware)"
    ran = {(r.check, r.status) for r in report.results}
    for check in ("writer.fault-data", "writer.fault-root", "writer.existing",
                  "writer.coverage", "writer.dtensor", "writer.layout"):
        assert (check, "pass") in ran, check


def test_reference_validator_through_its_command_line() -> None:
    report = validator_suite(reference(), only=["valid/warnings", "invalid/missing-chunk",
                                                "invalid/rules-unmatched-name"], strict=True)
    assert report.passed, report.render()
    assert len(report.by_check("validator.cases")) == 3


def test_suite_command_line_reports(tmp_path: Path) -> None:
    """ucp conformance reader --json --junit: a valid report and JUnit XML."""
    junit = tmp_path / "reader.xml"
    cmd = [sys.executable, "-m", "ucpformat.conformance", "reader", "--json", "--junit",
           str(junit), "--only", "valid/basic", "--only", "invalid/no-root", "--",
           *reference().command]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False,
                          env=reference().env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    doc = json.loads(proc.stdout)
    assert not schemas.violations("conformance-report", doc)
    assert doc["passed"] and doc["suite"] == "reader"
    xml = junit.read_text(encoding="utf-8")
    assert xml.startswith("<?xml") and 'name="valid/basic"' in xml
