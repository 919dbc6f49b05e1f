"""The coverage comparison of issue 27 (tests/support/suite_coverage.py): lines lost per mode, and lines followed
through a code change between the two runs."""

from tests.support.suite_coverage import compare, line_map

OLD = "a\nb\nc\nd\n"
NEW = "a\nnew\nb\nd\n"  # a line added above b, c removed


def test_line_map_follows_kept_lines_and_drops_rewritten_ones():
    assert line_map(OLD, NEW) == {1: 1, 2: 3, 4: 4}


def test_a_line_covered_before_and_not_after_is_lost_in_its_mode_and_in_all():
    before = {"push": {"m.py": [1, 2]}, "pull": {"m.py": [1]}}
    after = {"push": {"m.py": [1]}, "pull": {"m.py": [1, 2]}}
    lost, _ = compare(before, after)
    assert lost == ["push: m.py: 1 line(s) no longer covered: [2]"]


def test_lines_moved_by_a_code_change_are_compared_at_their_new_place():
    before = {"push": {"m.py": [1, 2, 3]}}
    moved = {"m.py": line_map(OLD, NEW)}.get
    lost, rewritten = compare(before, {"push": {"m.py": [1, 3]}}, moved)
    assert (lost, rewritten) == ([], 1)  # b moved to line 3 and is covered there; c is gone with the change
    lost, _ = compare(before, {"push": {"m.py": [1, 2]}}, moved)
    assert lost == ["all: m.py: 1 line(s) no longer covered: [3]", "push: m.py: 1 line(s) no longer covered: [3]"]
