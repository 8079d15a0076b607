"""Parsing of the spec's Markdown: requirement paragraphs, fenced blocks and tables.

Kept apart from tests/test_spec.py so that other tests (and the conformance suite) can
reuse it. Only the text conventions of spec/ucp-*.md are parsed here; see section 3.2 of
spec/ucp-1.0.md for the form of a requirement paragraph.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPEC_DIR = REPO / "spec"

#: A requirement identifier anywhere in a text.
REQUIREMENT_ID = re.compile(r"UCP-(\d+)\.(\d+)-R(\d{3,})")
#: The first line of a requirement paragraph.
REQUIREMENT_LINE = re.compile(
    r"^\*\*(?P<id>UCP-(?P<major>0|[1-9]\d*)\.(?P<minor>0|[1-9]\d*)-R(?P<number>\d{3,}))\*\*"
    r" \((?P<level>MUST|SHOULD|MAY)\) (?P<text>\S.*)$"
)
#: RFC 2119 / RFC 8174 keywords, longest first, with the level each one stands for.
KEYWORDS: dict[str, str] = {
    "MUST NOT": "MUST",
    "SHALL NOT": "MUST",
    "SHOULD NOT": "SHOULD",
    "NOT RECOMMENDED": "SHOULD",
    "MUST": "MUST",
    "REQUIRED": "MUST",
    "SHALL": "MUST",
    "SHOULD": "SHOULD",
    "RECOMMENDED": "SHOULD",
    "MAY": "MAY",
    "OPTIONAL": "MAY",
}
KEYWORD_RE = re.compile(r"(?<![A-Za-z_])(" + "|".join(KEYWORDS) + r")(?![A-Za-z_])")
LEVEL_ORDER = ("MAY", "SHOULD", "MUST")
FENCE = re.compile(r"^(`{3,})(.*)$")


@dataclass(frozen=True)
class Line:
    path: Path
    number: int  # 1-based
    text: str
    section: str  # the enclosing level-2 heading, "" before the first
    in_code: bool  # inside a fenced code block (fence lines included)

    @property
    def where(self) -> str:
        shown = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{shown}:{self.number}"


@dataclass(frozen=True)
class Requirement:
    id: str
    level: str
    text: str  # the whole paragraph, the id and level included
    where: str

    @property
    def body(self) -> str:
        """The paragraph without its leading ``**id** (LEVEL)``."""
        return self.text.split(")", 1)[1]

    @property
    def keywords(self) -> list[str]:
        return KEYWORD_RE.findall(strip_code_spans(self.body))

    @property
    def strongest(self) -> str | None:
        levels = [KEYWORDS[k] for k in self.keywords]
        return max(levels, key=LEVEL_ORDER.index) if levels else None


@dataclass(frozen=True)
class Block:
    """A fenced code block."""

    info: str  # the info string: "json schema=array"
    body: str
    where: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def attributes(self) -> dict[str, str]:
        """``key=value`` words of the info string; bare words map to ``""``."""
        out = {}
        for word in self.info.split()[1:]:
            key, _, value = word.partition("=")
            out[key] = value
        return out


def spec_files() -> list[Path]:
    return sorted(SPEC_DIR.glob("*.md"))


def normative_files() -> list[Path]:
    """The spec documents themselves (spec/ucp-<version>*.md), not README or CHANGELOG."""
    return sorted(SPEC_DIR.glob("ucp-*.md"))


def version_of(path: Path) -> str:
    """``1.0`` for spec/ucp-1.0.md (and for a companion chapter spec/ucp-1.0-layout.md)."""
    found = re.match(r"ucp-(\d+\.\d+)", path.name)
    assert found, f"{path.name} is not named ucp-<version>...md"
    return found.group(1)


def lines(path: Path) -> Iterator[Line]:
    section = ""
    fence: str | None = None
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = FENCE.match(text)
        if fence is None and match:
            fence = match.group(1)
            yield Line(path, number, text, section, True)
            continue
        if fence is not None:
            if text.strip() == fence:
                fence = None
            yield Line(path, number, text, section, True)
            continue
        if text.startswith("## "):
            section = text[3:].strip()
        yield Line(path, number, text, section, False)


def paragraphs(path: Path) -> Iterator[list[Line]]:
    """Runs of non-blank lines outside code blocks."""
    run: list[Line] = []
    for line in lines(path):
        if line.in_code or not line.text.strip():
            if run:
                yield run
            run = []
        else:
            run.append(line)
    if run:
        yield run


def requirement_lines(path: Path) -> Iterator[Line]:
    """Every line outside code blocks that starts like a requirement, well-formed or not."""
    for line in lines(path):
        if not line.in_code and line.text.startswith("**UCP-"):
            yield line


def requirements(path: Path) -> list[Requirement]:
    """The requirement paragraphs of one file, in order (malformed ones are skipped)."""
    out = []
    for run in paragraphs(path):
        match = REQUIREMENT_LINE.match(run[0].text)
        if match:
            text = "\n".join(line.text for line in run)
            out.append(Requirement(match["id"], match["level"], text, run[0].where))
    return out


def all_requirements() -> list[Requirement]:
    return [r for path in spec_files() for r in requirements(path)]


def blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    info = ""
    body: list[str] = []
    start = ""
    fence: str | None = None
    for line in lines(path):
        if not line.in_code:
            continue
        match = FENCE.match(line.text)
        if fence is None and match:
            fence, info, body, start = match.group(1), match.group(2).strip(), [], line.where
        elif fence is not None and line.text.strip() == fence:
            out.append(Block(info, "\n".join(body), start))
            fence = None
        else:
            body.append(line.text)
    return out


def tables(path: Path) -> list[list[list[str]]]:
    """Every Markdown table outside code blocks: rows of stripped cells, header first."""
    out: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in lines(path):
        text = line.text.strip()
        if not line.in_code and text.startswith("|") and text.endswith("|"):
            cells = [c.strip() for c in text[1:-1].split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):  # the --- row
                current.append(cells)
            continue
        if current:
            out.append(current)
        current = []
    if current:
        out.append(current)
    return out


def table_with_header(path: Path, *header: str) -> list[list[str]]:
    """The body rows of the one table whose header starts with ``header``."""
    found = [t for t in tables(path) if tuple(t[0][: len(header)]) == header]
    assert len(found) == 1, f"{path.name}: {len(found)} tables with header {header}"
    return found[0][1:]


def strip_code_spans(text: str) -> str:
    """Text without its `code spans` (names such as `MAY_X` are not keywords)."""
    return re.sub(r"`[^`]*`", "", text)


def unquote(cell: str) -> str:
    """The content of a table cell that is one code span."""
    assert cell.startswith("`") and cell.endswith("`"), f"{cell!r} is not a code span"
    return cell[1:-1]


#: A range of identifiers ("R100 to R199") designates a block of numbers, not requirements.
ID_RANGE = re.compile(r"(?:UCP-\d+\.\d+-)?R\d{3,}\s+to\s+(?:UCP-\d+\.\d+-)?R\d{3,}")
SHORT_ID = re.compile(r"(?<![\w-])R(\d{3,})(?!\w)")


def references(path: Path) -> Iterator[tuple[str, str]]:
    """(identifier, where) for every requirement a spec document cites.

    Full identifiers anywhere, and short ones (``R031``) in normative documents, expanded
    with the document's version; requirement ranges and the Conventions section (which
    speaks of identifiers in general) are skipped.
    """
    version = version_of(path) if path.name.startswith("ucp-") else None
    for line in lines(path):
        if "Conventions" in line.section:
            continue
        text = ID_RANGE.sub("", line.text)
        for match in REQUIREMENT_ID.finditer(text):
            yield match.group(0), line.where
        if version is not None:
            for match in SHORT_ID.finditer(REQUIREMENT_ID.sub("", text)):
                yield f"UCP-{version}-R{match.group(1)}", line.where
