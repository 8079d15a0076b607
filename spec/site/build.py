"""Build the rendered specification: ``python -m spec.site.build [SITE_DIR]`` (``make docs``).

Assembles the pages in build/spec-site/ (the current chapters, the archived 1.0 text,
the coverage table, the JSON Schemas and the citation), then runs mkdocs (mkdocs.yml).
Links between the spec's files are kept; links to files the site does not hold become
plain text.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import sys
from pathlib import Path

from spec.site import common

SOURCE = common.REPO / "build" / "spec-site"
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def _relink(text: str, pages: dict[str, str]) -> str:
    """Point links at the site's pages; unlink what the site does not hold."""

    def fix(m: re.Match[str]) -> str:
        label, target = m.group(1), m.group(2)
        if target.startswith(("http://", "https://", "#", "mailto:")):
            return m.group(0)
        path, _, frag = target.partition("#")
        if path in pages:
            return f"[{label}]({pages[path]}{'#' + frag if frag else ''})"
        return label

    return _LINK.sub(fix, text)


_FENCE = re.compile(r"^```(\w+) (.+)$", re.M)


def _fences(text: str, pages: dict[str, str]) -> str:
    """``json invalid schema=array rule=UCP-1.0-R023`` fences: the language alone, and
    what the rest says as a caption (Python-Markdown reads no such info string)."""

    def fix(m: re.Match[str]) -> str:
        lang, words = m.group(1), m.group(2).split()
        attrs = dict(w.split("=", 1) for w in words if "=" in w)
        schema = attrs.get("schema")
        said = []
        if schema:
            name = f"{schema}.schema.json"
            said.append(f"[`{name}`]({pages.get('../schemas/1.0/', 'schemas.md')}#{name})")
        if "invalid" in words:
            rule = attrs.get("rule")
            cap = "Invalid against " + (said[0] if said else "its schema")
            cap += f", by {rule}" if rule else ""
        else:
            cap = "Valid against " + said[0] if said else ""
        return (f"*{cap}:*\n\n```{lang}" if cap else f"```{lang}")

    return _FENCE.sub(fix, text)


def assemble(dest: Path = SOURCE) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "1.0").mkdir(parents=True)
    current = {name: name for name in common.CHAPTERS}
    current.update({"CHANGELOG.md": "CHANGELOG.md", "README.md": "index.md",
                    "../schemas/1.0/": "schemas.md", "../schemas/1.0": "schemas.md",
                    "../CITATION.cff": "cite.md", "archive/1.0/README.md": "1.0/index.md"})
    for name in common.CHAPTERS:
        text = (common.SPEC / name).read_text(encoding="utf-8")
        (dest / name).write_text(_fences(_relink(text, current), current), encoding="utf-8")
    for name, out in (("CHANGELOG.md", "CHANGELOG.md"), ("README.md", "index.md")):
        text = (common.SPEC / name).read_text(encoding="utf-8")
        (dest / out).write_text(_relink(text, current), encoding="utf-8")
    archived = {name: name for name in common.CHAPTERS}
    archived.update({"../../README.md": "../index.md", "../../CHANGELOG.md": "../CHANGELOG.md"})
    for name in common.CHAPTERS:
        text = (common.ARCHIVE / name).read_text(encoding="utf-8")
        (dest / "1.0" / name).write_text(_fences(_relink(text, archived),
                                                 {"../schemas/1.0/": "../schemas.md"}),
                                         encoding="utf-8")
    text = (common.ARCHIVE / "README.md").read_text(encoding="utf-8")
    (dest / "1.0" / "index.md").write_text(_relink(text, archived), encoding="utf-8")
    (dest / "coverage.md").write_text(_coverage_page(), encoding="utf-8")
    (dest / "schemas.md").write_text(_schemas_page(), encoding="utf-8")
    (dest / "cite.md").write_text(_cite_page(), encoding="utf-8")
    shutil.copytree(common.SCHEMAS, dest / "schemas" / "1.0")
    shutil.copy(common.CITATION, dest / "CITATION.cff")
    shutil.copy(common.COVERAGE, dest / "coverage.json")
    return dest


def _coverage_page() -> str:
    from ucpformat.conformance.checks import CHECKS

    defined = common.requirements(common.SPEC)
    cov = common.coverage()["requirements"]
    rows = []
    for rid, (page, level) in sorted(defined.items()):
        entry = cov.get(rid, {"cases": [], "checks": []})
        cases = "<br>".join(html.escape(c) for c in entry.get("cases", [])) or "—"
        checks = "<br>".join(
            f'<span title="{html.escape(CHECKS[c].title) if c in CHECKS else ""}">'
            f"{html.escape(c)}</span>" for c in entry.get("checks", [])) or "—"
        href = page.replace(".md", ".html")
        rows.append(f'<tr id="cov-{rid}"><td><a href="{href}#{rid}">{rid}</a></td>'
                    f"<td>{level}</td><td>{cases}</td><td>{checks}</td></tr>")
    return ("# Coverage of the requirements\n\n"
            "Each requirement of UCP with the conformance cases (folders of `conformance/cases/`) "
            "and the named checks of the suite that verify it, as "
            "[`conformance/coverage.json`](coverage.json) records them "
            "(`python -m conformance.generate` writes it). Every MUST requirement has at least "
            "one. The identifier links to the requirement's text.\n\n"
            '<table class="ucp-coverage">\n<thead><tr><th>Requirement</th><th>Level</th>'
            "<th>Cases</th><th>Checks</th></tr></thead>\n<tbody>\n"
            + "\n".join(rows) + "\n</tbody>\n</table>\n")


def _schemas_page() -> str:
    defined = common.requirements(common.SPEC)
    by_file: dict[str, list[str]] = {}
    for rid, names in common.schema_rules().items():
        for name in names:
            by_file.setdefault(name, []).append(rid)
    parts = ["# JSON Schemas of UCP 1.0\n",
             "The machine-readable part of the specification (Section 18 of the "
             "[core specification](ucp-1.0.md)): JSON Schema draft 2020-12, each `$id` "
             "`https://ucpformat.org/schemas/1.0/<name>.schema.json`. A subschema whose "
             "failure breaks a requirement carries `x-ucp-rule`, the requirement's "
             "identifier; the requirements each file annotates are listed with it.\n"]
    for path in sorted(common.SCHEMAS.glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        title = doc.get("title") or doc.get("description") or ""
        rules = sorted(by_file.get(path.name, []))
        links = ", ".join(
            f"[{rid}]({defined[rid][0]}#{rid})" for rid in rules if rid in defined) or "none"
        parts.append(f"## {path.name} {{#{path.name}}}\n\n{title}\n\n"
                     f"[The schema](schemas/1.0/{path.name}) · requirements it checks: "
                     f"{links}\n")
    return "\n".join(parts)


def _cite_page() -> str:
    doc = common.citation()
    pref = doc.get("preferred-citation", doc)
    version = pref["version"]
    key = "ucp-" + str(version).replace(".", "-")
    return (f"# How to cite UCP\n\n"
            f"Cite the specification as **{common.cite_text(doc)}**\n\n"
            f"A single requirement: its identifier, for example **UCP {version}, requirement "
            f"UCP-1.0-R031**. An identifier keeps its meaning in every version; the text of "
            f"UCP 1.0 as it was on 2026-11-21 stays readable [here](1.0/index.md).\n\n"
            f"```bibtex\n@techreport{{{key},\n  title = {{{pref['title']}}},\n"
            f"  author = {{{' and '.join(a.get('name', '') for a in pref.get('authors', []))}}},\n"
            f"  year = {{{str(pref['date-released'])[:4]}}},\n  note = {{Version {version}}}\n}}\n"
            f"```\n\nMachine-readable: [CITATION.cff](CITATION.cff).\n")


def build(site_dir: Path | None = None, source: Path | None = None) -> Path:
    """Assemble the pages in ``source`` (build/spec-site/) and build the site into
    ``site_dir`` (site/) with mkdocs, in this process."""
    import logging

    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config

    source = assemble(source or SOURCE)
    site = site_dir or common.REPO / "site"
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")
    logging.getLogger("mkdocs").setLevel(logging.WARNING)
    config = load_config(str(common.REPO / "mkdocs.yml"), docs_dir=str(source),
                         site_dir=str(site))
    mkdocs_build(config)
    return site


if __name__ == "__main__":
    print(build(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else None))
