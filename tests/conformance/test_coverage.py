"""Every MUST of the spec is verified by an invalid case or a named check of the suite.

Requirements are read from the requirement lines of spec/ucp-*.md. The ids the
reference implementation cites are a floor: an id cited by the code must be a
requirement of the spec too (so a chapter still being written cannot hide a MUST).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conformance.conftest import REPO
from ucpformat.conformance import coverage
from ucpformat.conformance.cases import cases_dir, scenarios_dir
from ucpformat.conformance.checks import CHECKS

SPEC = REPO / "spec"


def _document() -> dict:  # type: ignore[type-arg]
    return coverage.build(cases_dir(), scenarios_dir(), SPEC)


def test_spec_has_requirements_of_every_chapter() -> None:
    reqs = coverage.requirements(SPEC)
    numbers = {int(r.split("-R")[1]) // 100 for r in reqs}
    assert {0, 1, 2} <= numbers, "the core, layout and conformance chapters"
    assert sum(1 for r in reqs.values() if r.level == "MUST") >= 60


def test_every_must_requirement_is_covered() -> None:
    doc = _document()
    missing = coverage.uncovered(doc, floor=coverage.cited_by_code(REPO / "ucpformat"))
    assert not missing, (
        "MUST requirements with neither an invalid case nor a named check (add a case to "
        f"conformance/generate.py or a check to ucpformat/conformance/checks.py): {missing}"
    )


def test_checks_and_cases_cite_existing_requirements() -> None:
    reqs = coverage.requirements(SPEC)
    for check in CHECKS.values():
        for rule in check.requirements:
            assert rule in reqs, f"check {check.id} cites {rule}, which spec/ does not define"
    doc = _document()
    undefined = [r for r, e in doc["requirements"].items() if e["level"] is None]
    assert not undefined, f"cases cite requirements spec/ does not define: {undefined}"


def test_committed_coverage_is_current() -> None:
    committed = json.loads((REPO / "conformance" / "coverage.json").read_text(encoding="utf-8"))
    assert committed == _document(), "run `python -m conformance.generate` and commit"


def test_an_uncovered_must_is_reported(tmp_path: Path) -> None:
    spec = tmp_path / "spec"
    spec.mkdir()
    (spec / "ucp-9.9.md").write_text(
        "**UCP-9.9-R001** (MUST) Something nothing checks.\n\n"
        "**UCP-9.9-R002** (SHOULD) Something optional.\n\n"
        "```text\n**UCP-9.9-R003** (MUST) inside a code block: not a requirement\n```\n",
        encoding="utf-8",
    )
    doc = coverage.build(cases_dir(), scenarios_dir(), spec)
    assert doc["requirements"]["UCP-9.9-R001"] == {"level": "MUST", "cases": [], "checks": []}
    assert "UCP-9.9-R003" not in doc["requirements"]
    missing = coverage.uncovered(doc, floor={"UCP-9.9-R777"})
    assert missing == ["UCP-9.9-R001", "UCP-9.9-R777"]
