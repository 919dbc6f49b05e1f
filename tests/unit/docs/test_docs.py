"""The docs as a reader walks them: a short README, an index of every page in docs/, and links that land (the file,
and the heading an #anchor names, by GitHub's rule for heading anchors)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README_MAX_LINES = 200

LINKING_FILES = sorted(
    {ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "tests" / "README.md", ROOT / "benchmarks" / "README.md"}
    | set((ROOT / "docs").glob("*.md"))
    | set((ROOT / "roles").glob("*/README.md"))
)

FENCED_CODE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text (markup and link targets dropped) lower-cased, every character but
    letters, digits, `_`, `-` and spaces dropped, each space a `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    """Every anchor of a markdown file; a repeated heading's gets -1, -2... as on GitHub."""
    seen = {}
    found = set()
    for heading in HEADING.findall(FENCED_CODE.sub("", path.read_text())):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(path: Path) -> list:
    return [
        target
        for target in LINK.findall(FENCED_CODE.sub("", path.read_text()))
        if not re.match(r"[a-z]+:", target)  # https:, mailto:
    ]


def test_the_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move a section to docs/ and link it"


def test_the_docs_index_links_every_page_in_docs():
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / target.split("#")[0]).resolve() for target in relative_links(index)}
    pages = set((ROOT / "docs").glob("*.md")) - {index}
    assert sorted(page.name for page in pages if page.resolve() not in linked) == []


def test_github_anchors_drop_markup_and_punctuation():
    assert github_anchor("Launchers (MAD's contract with a model's container)") == (
        "launchers-mads-contract-with-a-models-container"
    )
    assert github_anchor("e2e_bench.py: a job's fixed cost, push and pull mode") == (
        "e2e_benchpy-a-jobs-fixed-cost-push-and-pull-mode"
    )
    assert github_anchor("The site config: `/etc/slurm-multi/site.yml`") == "the-site-config-etcslurm-multisiteyml"


@pytest.mark.parametrize("path", LINKING_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_lands_on_a_file_and_heading_that_exist(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)
