"""mkdocs hook of the rendered specification (mkdocs.yml): every requirement paragraph
becomes an anchor with its id (``ucp-1.0.html#UCP-1.0-R054``), followed by links to the
schemas that check it and to its row of the coverage table; every page shows the
version it belongs to and how to cite it."""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from spec.site import common  # (mkdocs loads this file by its path)

_REQ = re.compile(r"<p><strong>(UCP-\d+\.\d+-R\d{3,})</strong> \((MUST|SHOULD|MAY)\)(.*?)</p>",
                  re.S)
_ARTICLE = re.compile(r'(<article class="md-content__inner md-typeset">)')
_SCHEMA_RULES = common.schema_rules()
_CITATION = common.citation()
_VERSION = common.current_version()


def _prefix(page: Any) -> str:
    return "../" * page.file.dest_uri.count("/")


def _archived(page: Any) -> bool:
    return bool(page.file.src_uri.startswith("1.0/"))


def on_page_content(content: str, page: Any, config: Any, files: Any) -> str:
    up = _prefix(page)

    def anchor(m: re.Match[str]) -> str:
        rid, level, text = m.group(1), m.group(2), m.group(3)
        schemas = _SCHEMA_RULES.get(rid, [])
        schema_links = (", ".join(f'<a href="{up}schemas.html#{html.escape(s)}">{html.escape(s)}'
                                  f"</a>" for s in schemas)
                        if schemas else f'none (<a href="{up}schemas.html">all schemas</a>)')
        return (f'<p id="{rid}" class="ucp-requirement"><a class="ucp-requirement-id" '
                f'href="#{rid}" title="link to this requirement"><strong>{rid}</strong></a> '
                f"({level}){text}</p>\n"
                f'<p class="ucp-requirement-links"><small>{rid}: '
                f'<a href="{up}coverage.html#cov-{rid}">conformance coverage</a> · '
                f"JSON Schemas: {schema_links}</small></p>")

    return _REQ.sub(anchor, content)


def on_post_page(output: str, page: Any, config: Any) -> str:
    up = _prefix(page)
    if _archived(page):
        version = (f'UCP 1.0, draft of 2026-11-21 (archived: the current text is '
                   f'<a href="{up}ucp-1.0.html">UCP {_VERSION}</a>)')
        cite = ("The ucpformat authors. UCP: Universal Checkpoint Format, version 1.0 "
                "(draft). Version 1.0-draft, 2026-11-21.")
    else:
        version = f"UCP {_VERSION} (draft, {_CITATION['date-released']})"
        cite = common.cite_text(_CITATION)
    banner = (f'<div class="admonition info ucp-cite" id="ucp-cite-this">'
              f'<p class="admonition-title">{version}</p>'
              f"<p>Cite this: {html.escape(cite)} A requirement: its identifier, for example "
              f'"UCP {_VERSION if not _archived(page) else "1.0"}, requirement UCP-1.0-R031". '
              f'<a href="{up}cite.html">How to cite</a></p></div>')
    return _ARTICLE.sub(lambda m: m.group(1) + banner, output, count=1)
