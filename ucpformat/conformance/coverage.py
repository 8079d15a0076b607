"""Which case or check verifies each requirement of the spec (conformance/coverage.json).

Requirements are read from the requirement lines of ``spec/ucp-*.md``
(``**UCP-1.0-R031** (MUST) ...``). A requirement is *covered* by the invalid cases that
name it in ``violates``, the valid cases that list it in ``exercises`` or ``warnings``,
the scenarios that name it in ``refuse``, and the named checks of
:mod:`ucpformat.conformance.checks`. Every MUST requirement needs at least one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucpformat.conformance.checks import CHECKS

REQUIREMENT_LINE = re.compile(
    r"^\*\*(?P<id>UCP-(?P<version>\d+\.\d+)-R(?P<number>\d{3,}))\*\* \((?P<level>MUST|SHOULD|MAY)\)"
)
REQUIREMENT_ID = re.compile(r"UCP-\d+\.\d+-R\d{3,}")


@dataclass(frozen=True)
class Requirement:
    id: str
    level: str
    source: str  # file name


def spec_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "_spec", here.parent.parent / "spec"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("the spec (spec/ucp-*.md) is not installed")


def requirements(directory: Path | None = None) -> dict[str, Requirement]:
    """Every requirement of ``spec/ucp-*.md`` by id (code blocks skipped)."""
    out: dict[str, Requirement] = {}
    for path in sorted((directory or spec_dir()).glob("ucp-*.md")):
        fence: str | None = None
        for line in path.read_text(encoding="utf-8").splitlines():
            stripped = line.strip()
            if stripped.startswith("```"):
                if fence is None:
                    fence = stripped[: len(stripped) - len(stripped.lstrip("`"))]
                elif stripped == fence:
                    fence = None
                continue
            if fence is not None:
                continue
            match = REQUIREMENT_LINE.match(line)
            if match:
                out[match["id"]] = Requirement(match["id"], match["level"], path.name)
    return out


def cited_by_code(package: Path | None = None) -> set[str]:
    """Requirement ids the reference implementation cites (a floor while a chapter is drafted)."""
    root = package or Path(__file__).resolve().parent.parent
    found: set[str] = set()
    for path in root.rglob("*.py"):
        found.update(REQUIREMENT_ID.findall(path.read_text(encoding="utf-8")))
    return found


def _load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def case_links(cases_dir: Path, scenarios_dir: Path) -> dict[str, dict[str, set[str]]]:
    """requirement id -> {"cases": {...}, "checks": set()} from the case files."""
    links: dict[str, dict[str, set[str]]] = {}

    def add(rule: str, kind: str, name: str) -> None:
        links.setdefault(rule, {"cases": set(), "checks": set()})[kind].add(name)

    for kind in ("valid", "invalid"):
        folder = cases_dir / kind
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            expected_path = entry / "expected.json"
            if not expected_path.is_file():
                continue
            expected = _load(expected_path)
            name = f"{kind}/{entry.name}"
            for rule in expected.get("violates", []):
                add(rule, "cases", name)
            for rule in [*expected.get("exercises", []), *expected.get("warnings", [])]:
                add(rule, "cases", name)
    if scenarios_dir.is_dir():
        for entry in sorted(scenarios_dir.iterdir()):
            expected_path = entry / "expected.json"
            if expected_path.is_file():
                for rule in _load(expected_path).get("refuse", []):
                    add(rule, "cases", f"scenario/{entry.name}")
    for check in CHECKS.values():
        for rule in check.requirements:
            add(rule, "checks", check.id)
    return links


def build(cases_dir: Path, scenarios_dir: Path, spec: Path | None = None) -> dict[str, Any]:
    """The coverage document: every requirement of the spec, its level, cases and checks."""
    reqs = requirements(spec)
    links = case_links(cases_dir, scenarios_dir)

    def key(rule: str) -> tuple[str, int]:
        version, number = rule[4:].split("-R")
        return version, int(number)

    out: dict[str, Any] = {}
    for rule in sorted(set(reqs) | set(links), key=key):
        req = reqs.get(rule)
        entry = links.get(rule, {"cases": set(), "checks": set()})
        out[rule] = {
            "level": req.level if req else None,
            "cases": sorted(entry["cases"]),
            "checks": sorted(entry["checks"]),
        }
    return {
        "$schema": "https://ucpformat.org/schemas/1.0/conformance-coverage.schema.json",
        "ucp_conformance": "1.0",
        "requirements": out,
    }


def uncovered(document: dict[str, Any], *, floor: Iterable[str] = ()) -> list[str]:
    """MUST requirements (and ids of ``floor`` the spec does not define) with no case or check."""
    missing = []
    reqs = document["requirements"]
    for rule, entry in reqs.items():
        if entry["level"] == "MUST" and not entry["cases"] and not entry["checks"]:
            missing.append(rule)
    for rule in sorted(set(floor) - set(reqs)):
        missing.append(rule)
    return missing


__all__ = ["Requirement", "build", "case_links", "cited_by_code", "requirements", "spec_dir",
           "uncovered"]
