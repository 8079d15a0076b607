"""The spec is text that code depends on: its requirements, examples and tables are checked.

(a) requirement paragraphs are well-formed, unique, and at the level of their strongest
    RFC 2119 keyword; no keyword appears outside them;
(b) every requirement id cited by the code, the schemas, the conformance suite and the
    spec itself is defined;
(c) every ```json schema=KIND``` example validates, every ```json invalid ...``` fails;
(d) the data-type table, the schema enum and ucpformat.format.dtypes.NAMES agree, and the
    escaping examples agree with ucpformat.format.names.
"""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests import spec_helpers as sh
from ucpformat.checkpoint import metadata
from ucpformat.checkpoint.reader import parse_root
from ucpformat.errors import UCPError
from ucpformat.format import dtypes, names, schemas

SPEC = sh.SPEC_DIR / "ucp-1.0.md"
#: Kinds a ```json schema=KIND``` block may name: every schema but the shared definitions.
SCHEMA_KINDS = tuple(k for k in schemas.KINDS if k != "defs")


def test_the_spec_exists() -> None:
    assert SPEC.is_file()
    assert sh.normative_files(), "no spec/ucp-*.md"


# -- (a) requirement paragraphs ---------------------------------------------------------


def test_requirement_lines_are_well_formed() -> None:
    bad = [
        f"{line.where}: {line.text[:80]}"
        for path in sh.spec_files()
        for line in sh.requirement_lines(path)
        if not sh.REQUIREMENT_LINE.match(line.text)
    ]
    assert not bad, "malformed requirement lines:\n" + "\n".join(bad)


def test_requirement_ids_are_unique() -> None:
    counts = Counter(r.id for r in sh.all_requirements())
    assert not [i for i, n in counts.items() if n > 1]


def test_requirement_ids_carry_their_document_version() -> None:
    for path in sh.normative_files():
        version = sh.version_of(path)
        for req in sh.requirements(path):
            assert req.id.startswith(f"UCP-{version}-R"), f"{req.where}: {req.id}"


def test_the_spec_defines_requirements() -> None:
    assert len(sh.requirements(SPEC)) >= 50


@pytest.mark.parametrize("req", sh.all_requirements(), ids=lambda r: r.id)
def test_level_is_the_strongest_keyword(req: sh.Requirement) -> None:
    assert req.keywords, f"{req.where}: {req.id} has no RFC 2119 keyword"
    assert req.level == req.strongest, (
        f"{req.where}: {req.id} is marked ({req.level}) but its strongest keyword is "
        f"{req.strongest} ({', '.join(req.keywords)})"
    )


def test_keywords_appear_only_in_requirements() -> None:
    """A capitalised keyword outside a numbered paragraph would be an uncitable rule."""
    stray = []
    for path in sh.normative_files():
        for run in sh.paragraphs(path):
            if sh.REQUIREMENT_LINE.match(run[0].text) or "Conventions" in run[0].section:
                continue
            for line in run:
                found = sh.KEYWORD_RE.findall(sh.strip_code_spans(line.text))
                if found:
                    stray.append(f"{line.where}: {found}: {line.text[:80]}")
    assert not stray, "RFC 2119 keywords outside requirement paragraphs:\n" + "\n".join(stray)


def test_keyword_parsing() -> None:
    req = sh.Requirement("UCP-9.9-R001", "SHOULD", "**UCP-9.9-R001** (SHOULD) A SHOULD NOT "
                         "b; `MUST` is code; MAY c.", "x")
    assert req.keywords == ["SHOULD NOT", "MAY"]
    assert req.strongest == "SHOULD"


# -- (b) cited requirement ids exist ----------------------------------------------------


def _cited_in_repository() -> list[tuple[str, str]]:
    out = []
    sources = [
        *sh.REPO.glob("ucpformat/**/*.py"),
        *sh.REPO.glob("schemas/**/*.json"),
        *(p for p in sh.REPO.glob("conformance/**/*")
          if p.suffix in (".py", ".json", ".md") and p.is_file() and not p.is_symlink()),
    ]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        for match in sh.REQUIREMENT_ID.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append((match.group(0), f"{path.relative_to(sh.REPO)}:{line}"))
    return out


def _block(requirement_id: str) -> tuple[str, int]:
    """(version, hundreds): R001-R099 is block 0 (the core), R100-R199 block 1, ..."""
    match = sh.REQUIREMENT_ID.fullmatch(requirement_id)
    assert match
    return f"{match.group(1)}.{match.group(2)}", int(match.group(3)) // 100


def test_ids_cited_by_code_and_schemas_are_defined() -> None:
    """Every cited id is defined; a chapter not written yet is reported, not failed.

    Ids are allotted to chapters in blocks of a hundred (section 3.2 of the spec). While
    no spec document defines any id of a block, code citing that block's ids is ahead of
    its chapter: that is a warning. Once a block has one requirement, it must have all.
    """
    defined = {r.id for r in sh.all_requirements()}
    written = {_block(i) for i in defined}
    cited = _cited_in_repository()
    assert cited, "the code cites no requirement at all?"
    missing = sorted({f"{i} ({where})" for i, where in cited
                      if i not in defined and _block(i) in written})
    assert not missing, "cited but not defined in spec/*.md:\n" + "\n".join(missing)
    pending = sorted({i for i, _ in cited if _block(i) not in written})
    if pending:
        warnings.warn(
            f"cited by the code, in chapters not yet in spec/: {', '.join(pending)}",
            stacklevel=1,
        )


#: Requirements that no code under ucpformat/ enforces or cites, each with the reason
#: (text for people, say, or a rule the reference implementation leaves to others).
INFORMATIVE: dict[str, str] = {}
PACKAGE = sh.REPO / "ucpformat"
#: A requirement number not spelled as the literal id (``R034``, ``"R" + "211"``, ``R{n}``).
LOOSE_ID = re.compile(r"(?<![-\w])R\d{3}|R\{|[\"']R[\"']\s*\+")


def _package_text() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*"))
            if p.suffix in (".py", ".json")}


def test_every_requirement_is_enforced_or_cited_or_informative() -> None:
    """``grep UCP-1.0-R211 ucpformat`` finds the places that enforce R211: every
    requirement of the spec is cited under ucpformat/ or listed as informative above."""
    text = "\n".join(_package_text().values())
    defined = {r.id for r in sh.all_requirements()}
    uncited = sorted(i for i in defined if i not in text and i not in INFORMATIVE)
    assert not uncited, "requirements the package neither enforces nor cites:\n" + "\n".join(
        uncited)
    stale = sorted(i for i in INFORMATIVE if i not in defined or i in text)
    assert not stale, f"listed as informative but undefined or cited: {stale}"


def test_the_package_spells_requirement_ids_one_way() -> None:
    loose = [f"{p.relative_to(sh.REPO)}:{n}: {line.strip()}"
             for p, text in _package_text().items()
             for n, line in enumerate(text.splitlines(), 1) if LOOSE_ID.search(line)]
    assert not loose, "requirement ids not written as UCP-1.0-Rnnn:\n" + "\n".join(loose)


def test_the_loose_spellings_are_found() -> None:
    for line in ('rule="R034"', "see R211.", 'f"UCP-1.0-R{n:03d}"', 'rule = "R" + "211"'):
        assert LOOSE_ID.search(line), line
    for line in ('rule="UCP-1.0-R034"', "the CRC32C", "R2D2", "XR0345"):
        assert not LOOSE_ID.search(line), line


def test_ids_cited_by_the_spec_are_defined() -> None:
    defined = {r.id for r in sh.all_requirements()}
    written = {_block(i) for i in defined}
    cited = [(i, where) for path in sh.spec_files() for i, where in sh.references(path)]
    missing = sorted({f"{i} ({where})" for i, where in cited
                      if i not in defined and _block(i) in written})
    assert not missing, "the spec cites undefined requirements:\n" + "\n".join(missing)
    pending = sorted({i for i, _ in cited if _block(i) not in written})
    if pending:
        warnings.warn(f"the spec cites chapters not yet in spec/: {', '.join(pending)}",
                      stacklevel=1)


def test_every_schema_annotation_is_a_requirement_id() -> None:
    """Each x-ucp-rule is one well-formed id (whether it is defined is checked above)."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "x-ucp-rule" in node:
                yield node["x-ucp-rule"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for path in sorted((sh.REPO / "schemas").glob("*/*.schema.json")):
        for rule in walk(json.loads(path.read_text(encoding="utf-8"))):
            assert isinstance(rule, str) and sh.REQUIREMENT_ID.fullmatch(rule), (
                f"{path.name}: x-ucp-rule {rule!r} is not a requirement id"
            )


# -- (c) JSON examples ------------------------------------------------------------------


def _json_blocks() -> list[sh.Block]:
    return [b for path in sh.spec_files() for b in sh.blocks(path) if b.language == "json"]


def _code_rule(kind: str, doc: Any) -> tuple[bool, str | None]:
    """(accepted, rule) from the reference implementation's own parser, where it has one."""
    try:
        if kind == "array":
            metadata.parse_array("model/example", doc)
        elif kind == "group":
            metadata.parse_group("model", doc)
        elif kind == "root":
            parse_root(doc, where="example")
    except UCPError as exc:
        return False, exc.rule
    return True, None


def test_every_json_example_names_its_schema() -> None:
    blocks = _json_blocks()
    assert len(blocks) >= 10
    for block in blocks:
        kind = block.attributes.get("schema")
        assert kind in SCHEMA_KINDS, f"{block.where}: ```{block.info}``` needs schema=KIND"
        assert set(block.attributes) <= {"schema", "invalid", "rule"}, block.where


@pytest.mark.parametrize(
    "block", [b for b in _json_blocks() if "invalid" not in b.attributes], ids=lambda b: b.where
)
def test_valid_examples_validate(block: sh.Block) -> None:
    kind = block.attributes["schema"]
    doc = metadata.loads(block.body.encode("utf-8"), what=block.where)
    problems = schemas.violations(kind, doc)
    assert not problems, f"{block.where}: {problems}"
    accepted, rule = _code_rule(kind, doc)
    assert accepted, f"{block.where}: the reference implementation refuses it ({rule})"


@pytest.mark.parametrize(
    "block", [b for b in _json_blocks() if "invalid" in b.attributes], ids=lambda b: b.where
)
def test_invalid_examples_fail(block: sh.Block) -> None:
    kind = block.attributes["schema"]
    doc = json.loads(block.body)
    rules = {v.rule for v in schemas.violations(kind, doc)}
    accepted, code_rule = _code_rule(kind, doc)
    assert rules or not accepted, f"{block.where}: an invalid example passes"
    expected = block.attributes.get("rule")
    if expected:
        assert expected in rules | {code_rule}, (
            f"{block.where}: fails with {sorted(r for r in rules | {code_rule} if r)}, "
            f"not {expected}"
        )


# -- (d) tables -------------------------------------------------------------------------


def test_data_type_table_is_the_closed_list() -> None:
    rows = sh.table_with_header(SPEC, "`data_type`", "Bytes")
    assert tuple(sh.unquote(r[0]) for r in rows) == dtypes.NAMES
    for row in rows:
        dt = dtypes.BY_NAME[sh.unquote(row[0])]
        assert int(row[1]) == dt.itemsize, row
        assert row[4] == f"`torch.{dt.torch_name}`", row


def test_schema_enum_is_the_closed_list() -> None:
    defs = json.loads((schemas.schema_dir() / "defs.schema.json").read_text(encoding="utf-8"))
    assert tuple(defs["$defs"]["dataType"]["enum"]) == dtypes.NAMES


def test_escaping_examples() -> None:
    rows = sh.table_with_header(SPEC, "Logical name", "Node name")
    assert len(rows) >= 10
    for logical, node in ((sh.unquote(a), sh.unquote(b)) for a, b in rows):
        assert names.escape(logical) == node, (logical, names.escape(logical), node)
        assert names.unescape(node) == logical, (node, logical)
        assert re.fullmatch(r"(?:[A-Za-z0-9._-]|%[0-9A-F]{2})+", node)


def test_helpers_find_what_they_should(tmp_path: Path) -> None:
    text = (
        "## 3. Conventions\n\nMUST here is fine.\n\n## 5. X\n\n"
        "**UCP-1.0-R001** (MUST) A MUST.\ncontinued SHOULD.\n\n"
        "```json schema=array\n{}\n```\n\n| a | b |\n|---|---|\n| `x` | 1 |\n"
    )
    path = tmp_path / "ucp-1.0.md"
    path.write_text(text, encoding="utf-8")
    (req,) = sh.requirements(path)
    assert req.id == "UCP-1.0-R001" and req.keywords == ["MUST", "SHOULD"]
    (block,) = sh.blocks(path)
    assert block.attributes == {"schema": "array"} and block.body == "{}"
    assert sh.tables(path) == [[["a", "b"], ["`x`", "1"]]]
