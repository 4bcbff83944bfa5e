"""The README and the pages under docs/ link only to files that exist, and to headings that exist in them."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target); the target ends at whitespace or ')' (a title after it is ignored).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped but for '-' and '_', spaces to '-'."""
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*$", FENCE.sub("", page.read_text(encoding="utf-8")), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve()
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: {target.name} has no heading #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_relative_link_names_a_file_that_exists(page: Path) -> None:
    assert not broken_links(page), f"{page.relative_to(REPO)}: {broken_links(page)}"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading, with punctuation\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading-with-punctuation) [web](https://x.org/none.md) "
                    "[anchor](#top)\n[gone](missing.md) ![img](img/gone.png) [bad anchor](there.md#nope)\n"
                    "```\n[in code](not-a-link.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file", "img/gone.png: no such file",
                                  "there.md#nope: there.md has no heading #nope"]


def test_the_readme_is_a_front_door_under_21_kb() -> None:
    """Reference material lives in docs/; the README keeps what a newcomer needs first."""
    size = len((REPO / "README.md").read_bytes())
    assert size < 21_000, f"README.md is {size} bytes: move reference material to a page under docs/"


def test_the_readme_gives_the_two_commands_and_links_the_course_pages() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "make study" in readme and "make test" in readme
    for page in ("docs/teachers_guide.md", "docs/glossary.md", "docs/install.md", "docs/colab.md"):
        assert f"]({page})" in readme, f"the README does not link {page}"
