"""The documentation lives in the repository: every relative link and image in README and docs/ resolves in a
checkout, and nothing points at pages outside it."""

from __future__ import annotations

import re

from tests.conftest import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or REPO not in path.parents:
                broken.append((page.name, target))
    assert not broken, broken
    assert "shared/" not in (REPO / "README.md").read_text(), "README points outside the repository"
