"""tests/INDEX.md (each source file and its tests) is what tests/support/index_of_tests.py makes of the tree."""

from tests.support import index_of_tests


def test_the_index_is_up_to_date():
    committed = (index_of_tests.ROOT / "tests" / "INDEX.md").read_text()
    assert committed == index_of_tests.render(), "run: python -m tests.support.index_of_tests > tests/INDEX.md"


def test_the_index_finds_a_test_by_import_by_name_and_by_quoted_module_name():
    found = index_of_tests.index()
    assert "tests/unit/test_rank_barrier.py" in found["module_utils/barrier/server.py"]
    assert "tests/unit/test_run_model_module.py" in found["library/run_model.py"]
    assert "tests/unit/test_package_imports.py" not in found["library/run_model.py"]
    assert set(found) == {str(path.relative_to(index_of_tests.ROOT)) for path in index_of_tests.source_files()}
