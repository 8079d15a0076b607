"""The rendered specification (``make docs``; spec/site/) in a real browser.

Headless Chromium (Debian's package, which ``make test`` installs) follows every internal
link and every requirement anchor of the built site; a site with one anchor broken on
purpose must fail. Skipped only where chromium is not installed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from spec.site import build, check, common

needs_browser = pytest.mark.skipif(check.chromium() is None,
                                   reason="chromium is not installed (make test installs it)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("spec-site")
    return build.build(tmp / "site", tmp / "source")


def _expected() -> dict[str, list[str]]:
    reqs = common.requirements(common.SPEC)
    return {page.replace(".md", ".html"): [r for r, (p, _) in reqs.items() if p == page]
            for page in common.CHAPTERS}


def test_every_page_shows_its_version_and_how_to_cite(site: Path) -> None:
    version = common.current_version()
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")
    assert len(pages) >= 12
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert 'id="ucp-cite-this"' in text, page
        assert "Cite this:" in text, page
        archived = page.relative_to(site).parts[0] == "1.0"
        assert ("UCP 1.0, draft of 2026-11-21" if archived else f"UCP {version}") in text, page


def test_every_requirement_is_an_anchor_with_links_to_schemas_and_coverage(site: Path) -> None:
    for page, ids in _expected().items():
        text = (site / page).read_text(encoding="utf-8")
        for rid in ids:
            assert f'<p id="{rid}" class="ucp-requirement">' in text, (page, rid)
            assert f'href="coverage.html#cov-{rid}"' in text, (page, rid)
        assert len(re.findall(r'href="schemas.html#[a-z-]+\.schema\.json"', text)) >= 1, page
    coverage = (site / "coverage.html").read_text(encoding="utf-8")
    for rid in common.requirements(common.SPEC):
        assert f'id="cov-{rid}"' in coverage, rid


@needs_browser
def test_every_link_and_requirement_anchor_resolves_in_a_browser(site: Path) -> None:
    problems, checked = check.check_site(site, expected=_expected())
    assert not problems, "\n".join(problems)
    assert checked > 1000


@needs_browser
def test_a_broken_requirement_anchor_fails(site: Path, tmp_path: Path) -> None:
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    page = broken / "ucp-1.0.html"
    text = page.read_text(encoding="utf-8")
    assert text.count('id="UCP-1.0-R054"') == 1
    page.write_text(text.replace('id="UCP-1.0-R054"', 'id="UCP-1.0-R054-moved"'),
                    encoding="utf-8")
    problems, _ = check.check_site(broken, expected=_expected())
    assert problems, "a broken anchor went unnoticed"
    assert all("UCP-1.0-R054" in p for p in problems), problems
    # both the links to it (from the coverage table, from its own id) and the visit fail
    assert any("no element has this id" in p for p in problems), problems
    assert any("does not resolve to its text" in p for p in problems), problems
