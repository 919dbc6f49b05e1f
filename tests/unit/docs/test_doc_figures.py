"""One figure for one measure: docs/figures.md is the one home of the measured figures, the pages that quote one
quote it as it stands there, and figures.md's fixed-cost figures are the benchmark's own (benchmarks/README.md).

A figure is a number with its unit (`1.8 s`, `-0.2 s`, `+0.30 s`, `0.10-0.16x`, `2 MB`). A quote that names a figure
figures.md does not hold is a second figure for the measure, and goes stale apart from it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FIGURES_PAGE = ROOT / "docs" / "figures.md"
BENCHMARKS_PAGE = ROOT / "benchmarks" / "README.md"

FIGURE = re.compile(r"(?<![\w.+-])([-+]?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)\s?(ms|s|us|MB|GB|KB|kB|x)\b")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*$")

# (page, the heading of the section that quotes figures.md's figures)
QUOTING_SECTIONS = (
    ("README.md", "Push or pull: which mode, and when the other is better"),
    ("docs/cluster.md", "Which to use"),
)


def figures(text: str) -> set:
    """Every figure in ``text``, spelt one way (`1.8 s` and `1.8s` are one figure)."""
    return {number + unit for number, unit in FIGURE.findall(text)}


def section(page: Path, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    lines = page.read_text(encoding="utf-8").splitlines()
    for start, line in enumerate(lines):
        found = HEADING.match(line)
        if found and found.group(2) == heading:
            level = len(found.group(1))
            body = []
            for later in lines[start + 1 :]:
                next_heading = HEADING.match(later)
                if next_heading and len(next_heading.group(1)) <= level:
                    break
                body.append(later)
            return "\n".join(body)
    raise AssertionError(f"{page.relative_to(ROOT)} has no heading {heading!r}: name the section it moved to here")


def test_a_figure_is_a_number_with_its_unit():
    assert figures("push 1.8 s on 3 nodes, -0.2 s plain, +0.30 s per node, 0.10-0.16x, a 2 MB image") == {
        "1.8s",
        "-0.2s",
        "+0.30s",
        "0.10-0.16x",
        "2MB",
    }
    assert figures("3 nodes, 64 and 256, node1, v1.8, issue 45") == set()


@pytest.mark.parametrize(("page", "heading"), QUOTING_SECTIONS, ids=[page for page, _ in QUOTING_SECTIONS])
def test_every_figure_a_page_quotes_is_the_figures_page_s_own(page, heading):
    quoted = figures(section(ROOT / page, heading))
    assert quoted, f"{page}, {heading!r}: no figure found; the test reads the wrong section"
    held = figures(FIGURES_PAGE.read_text(encoding="utf-8"))
    assert sorted(quoted - held) == [], (
        f"{page}, {heading!r}, quotes figures docs/figures.md does not hold: quote its figure, or change it there"
    )


def test_the_fixed_cost_figures_are_the_benchmark_s_own():
    stated = figures(section(FIGURES_PAGE, "A job's fixed cost, push or pull"))
    measured = figures(section(BENCHMARKS_PAGE, "e2e_bench.py"))
    assert stated and measured
    assert sorted(stated - measured) == [], (
        "docs/figures.md states fixed-cost figures that benchmarks/README.md's e2e_bench.py section does not hold"
    )
