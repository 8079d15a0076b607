"""The committed cases and scenarios of the conformance suite, and the requests made of them.

Layout (spec ucp-1.0-conformance.md, "Cases"):

* ``cases/valid/<name>/checkpoint/`` and ``cases/valid/<name>/expected.json``;
* ``cases/invalid/<name>/checkpoint/`` (or ``rules.json`` and ``apply.json`` for a rule
  file case) and ``cases/invalid/<name>/expected.json``;
* ``scenarios/<name>/scenario.json`` (what a writer is handed), its local files, and
  ``scenarios/<name>/expected.json`` (what the checkpoint it writes must hold).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUITE_VERSION = "1.0"
STAGES = ("open", "read", "validate", "deep")
#: Stages at which a conforming reader refuses an invalid case (UCP-1.0-R212).
READER_STAGES = ("open", "read")


def suite_dir() -> Path:
    """The folder holding ``cases/`` and ``scenarios/``: packaged copy, or the repository's."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "_conformance", here.parent.parent / "conformance"):
        if (candidate / "cases").is_dir():
            return candidate
    raise FileNotFoundError("the conformance cases are not installed (conformance/cases)")


def cases_dir() -> Path:
    return suite_dir() / "cases"


def scenarios_dir() -> Path:
    return suite_dir() / "scenarios"


def load_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Case:
    """One case: a checkpoint (or a rule file) and what must be found in it."""

    name: str  # "valid/dtypes" or "invalid/missing-chunk"
    directory: Path
    expected: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return str(self.expected["kind"])

    @property
    def valid(self) -> bool:
        return self.kind == "valid"

    @property
    def is_rules(self) -> bool:
        return "rules" in self.expected

    @property
    def checkpoint(self) -> Path:
        return self.directory / "checkpoint"

    @property
    def violates(self) -> list[str]:
        return list(self.expected.get("violates", []))

    @property
    def feature(self) -> str | None:
        """The optional feature an implementation must declare to be given this case
        (``"archive"``: the checkpoint is one file, spec section 11.5), or None."""
        feature = self.expected.get("feature")
        return None if feature is None else str(feature)

    @property
    def stage(self) -> str | None:
        stage = self.expected.get("stage")
        return None if stage is None else str(stage)

    @property
    def data_types(self) -> set[str]:
        """Data types of the case's tensors (what a reader must implement to read it all)."""
        return {str(t["dtype"]) for t in self.expected.get("tensors", {}).values()}

    @property
    def description(self) -> str:
        return str(self.expected.get("description", ""))

    def request(self, *, layout: bool = False) -> dict[str, Any]:
        """The reader request for this case (UCP-1.0-R231)."""
        if not self.valid:
            return dict(self.expected.get("request", {"tensors": {}}))
        tensors: dict[str, Any] = {}
        for path, t in self.expected.get("tensors", {}).items():
            tensors[path] = {
                "whole": t.get("sha256") is not None,
                "slices": [s["slice"] for s in t.get("slices", [])],
            }
        out: dict[str, Any] = {"tensors": tensors}
        if layout and self.expected.get("targets"):
            out["targets"] = [
                {"id": t["id"], "tensor": t["tensor"], "config": t["config"]}
                for t in self.expected["targets"]
            ]
        return out


def load_case(directory: Path, name: str | None = None) -> Case:
    expected = load_json(directory / "expected.json")
    return Case(name or f"{directory.parent.name}/{directory.name}", directory, expected)


def iter_cases(root: Path | None = None) -> Iterator[Case]:
    """Every case under ``root`` (default: the suite's), valid ones first, by name."""
    base = root or cases_dir()
    for kind in ("valid", "invalid"):
        folder = base / kind
        if not folder.is_dir():
            continue
        for entry in sorted(folder.iterdir()):
            if (entry / "expected.json").is_file():
                yield load_case(entry, f"{kind}/{entry.name}")


def load_cases(root: Path | None = None) -> list[Case]:
    return list(iter_cases(root))


@dataclass(frozen=True)
class Scenario:
    """One writer scenario: what a writer is handed, and what its checkpoint must hold."""

    name: str
    directory: Path
    document: Mapping[str, Any]
    expected: Mapping[str, Any]

    @property
    def file(self) -> Path:
        return self.directory / "scenario.json"

    @property
    def features(self) -> set[str]:
        return set(self.document.get("features", []))

    @property
    def refuse(self) -> list[str]:
        """Requirement ids a writer breaks if it writes this scenario (it must refuse)."""
        return list(self.expected.get("refuse", []))


def iter_scenarios(root: Path | None = None) -> Iterator[Scenario]:
    base = root or scenarios_dir()
    if not base.is_dir():
        return
    for entry in sorted(base.iterdir()):
        if (entry / "scenario.json").is_file():
            yield Scenario(
                entry.name,
                entry,
                load_json(entry / "scenario.json"),
                load_json(entry / "expected.json"),
            )


def load_scenarios(root: Path | None = None) -> list[Scenario]:
    return list(iter_scenarios(root))


__all__ = [
    "READER_STAGES",
    "STAGES",
    "SUITE_VERSION",
    "Case",
    "Scenario",
    "cases_dir",
    "iter_cases",
    "iter_scenarios",
    "load_case",
    "load_cases",
    "load_scenarios",
    "scenarios_dir",
    "suite_dir",
]
