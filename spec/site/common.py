"""What the site's builder and its mkdocs hook share: where things are, the version, the
citation, and which page defines each requirement."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "spec"
SCHEMAS = REPO / "schemas" / "1.0"
COVERAGE = REPO / "conformance" / "coverage.json"
CITATION = REPO / "CITATION.cff"
#: The chapters of the current text, and of the archived 1.0 text (under 1.0/ on the site).
CHAPTERS = ("ucp-1.0.md", "ucp-1.0-layout.md", "ucp-1.0-conformance.md")
ARCHIVE = SPEC / "archive" / "1.0"
REQUIREMENT_LINE = re.compile(r"^\*\*(UCP-\d+\.\d+-R\d{3,})\*\* \((MUST|SHOULD|MAY)\) ")


def citation() -> dict[str, Any]:
    """CITATION.cff, read without a YAML library beyond what mkdocs brings (PyYAML)."""
    import yaml

    doc = yaml.safe_load(CITATION.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def current_version() -> str:
    return str(citation()["version"]).removesuffix("-draft")


def cite_text(doc: dict[str, Any] | None = None) -> str:
    """The preferred citation, as one line of text."""
    doc = doc or citation()
    pref = doc.get("preferred-citation", doc)
    authors = ", ".join(a.get("name") or f"{a.get('given-names', '')} {a.get('family-names', '')}"
                        for a in pref.get("authors", []))
    return (f"{authors}. {pref['title']}. Version {pref['version']}, "
            f"{pref['date-released']}.")


def requirements(directory: Path) -> dict[str, tuple[str, str]]:
    """Requirement id -> (chapter file name, level), from the chapters in ``directory``."""
    found: dict[str, tuple[str, str]] = {}
    for name in CHAPTERS:
        in_code = False
        for line in (directory / name).read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                in_code = not in_code
                continue
            m = None if in_code else REQUIREMENT_LINE.match(line)
            if m:
                found[m.group(1)] = (name, m.group(2))
    return found


def schema_rules() -> dict[str, list[str]]:
    """Requirement id -> the schema files that annotate a subschema with it (x-ucp-rule)."""
    rules: dict[str, set[str]] = {}

    def walk(node: Any, name: str) -> None:
        if isinstance(node, dict):
            rule = node.get("x-ucp-rule")
            if isinstance(rule, str):
                rules.setdefault(rule, set()).add(name)
            for value in node.values():
                walk(value, name)
        elif isinstance(node, list):
            for value in node:
                walk(value, name)

    for path in sorted(SCHEMAS.glob("*.json")):
        walk(json.loads(path.read_text(encoding="utf-8")), path.name)
    return {rule: sorted(names) for rule, names in rules.items()}


def coverage() -> dict[str, Any]:
    doc = json.loads(COVERAGE.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc
