"""tests/INDEX.md (each source file and its tests) is the one tests/support/test_index.py makes of the tree today."""

from tests.support import test_index


def test_the_index_is_up_to_date():
    committed = (test_index.ROOT / "tests" / "INDEX.md").read_text()
    assert committed == test_index.render(), "run: python -m tests.support.test_index > tests/INDEX.md"


def test_the_index_finds_a_test_by_import_by_name_and_by_quoted_module_name():
    found = test_index.index()
    assert "tests/unit/test_rank_barrier.py" in found["module_utils/barrier/server.py"]
    assert "tests/unit/test_run_model_module.py" in found["library/run_model.py"]
    assert "tests/unit/test_package_imports.py" not in found["library/run_model.py"]
    assert set(found) == {str(path.relative_to(test_index.ROOT)) for path in test_index.source_files()}
