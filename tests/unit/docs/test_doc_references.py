"""What the docs and comments name exists: the files they point a reader to, and the public names the package's
docstrings show. A file moved or a name renamed breaks this test, not a reader's hunt."""

import re
from pathlib import Path

import slurm_multi

ROOT = Path(__file__).resolve().parents[3]

# Where a reader follows a path: the code, the roles and playbooks, the docs, and the tests' own documentation.
NAMING_TREES = ("library", "module_utils", "plugins", "slurm_multi", "roles", "playbooks", "group_vars", "docs")
NAMING_TREES += ("collections", "benchmarks", "inventory")
NAMING_FILES = ("README.md", "Makefile", "ansible.cfg", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".j2", ".cfg", ".toml", ".sh", ".txt", ""}
TOP_DIRS = sorted(path.name for path in ROOT.iterdir() if path.is_dir() and path.name[0] not in "._")

# A path from the checkout's top (or the naming file's folder): `docs/contracts.md`, `module_utils/results/timeline`
# or `tests/support/pipeline.run_pipeline` (a module, a name in it). Not a runtime path ($RESULTS/..., ~/..., /usr/...);
# `...` stands for any folders between.
CHECKOUT_PATH = re.compile(rf"(?<![\w./$~-])((?:{'|'.join(TOP_DIRS)})/[\w./-]*\w)")
# A Python file named alone (`cancellation.py`) in the code's docstrings and comments.
PYTHON_FILE = re.compile(r"(?<![\w./-])(\w+\.py)\b")
# Made when the wheel or the collection is built, never in the checkout (a collection's plugins/modules is library/,
# its plugins/module_utils is module_utils/: slurm_multi/collection.py).
BUILT_PATHS = {"slurm_multi/ansible_content", "plugins/modules", "plugins/module_utils"}
# Files of other projects the code follows, named as their authors name them.
OTHER_PROJECTS_FILES = {
    "train.py": "a MAD model's training script",
    "primus_backend.py": "madengine's",
}


def _naming_files():
    for name in NAMING_FILES:
        yield ROOT / name
    for tree in NAMING_TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts:
                yield path
    yield from sorted(path for path in (ROOT / "tests").rglob("*.md") if "fixtures" not in path.parts)


def _exists(reference: str, named_in: Path) -> bool:
    if reference in BUILT_PATHS:
        return True
    if "..." in reference:
        return any(ROOT.glob(reference.replace("...", "**")))
    for path in (ROOT / reference, named_in.parent / reference):
        # `all` names group_vars/all.yml, `timeline` a module, `pipeline.run_pipeline` a name in one.
        if path.exists() or any(path.parent.glob(path.name.split(".")[0] + ".*")):
            return True
    return False


def _lines(path: Path):
    try:
        yield from enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
    except UnicodeDecodeError:
        return


def test_every_file_the_docs_and_comments_name_by_its_path_exists():
    missing = [
        f"{path.relative_to(ROOT)}:{number}: {reference}"
        for path in _naming_files()
        for number, line in _lines(path)
        for reference in CHECKOUT_PATH.findall(line)
        if not _exists(reference, path)
    ]
    assert missing == [], "named but not in the checkout (moved or renamed? name where it is now):\n" + "\n".join(
        missing
    )


def test_every_python_file_the_code_names_alone_exists_in_the_checkout():
    ours = {path.name for tree in NAMING_TREES for path in (ROOT / tree).rglob("*.py")}
    code = [path for path in _naming_files() if path.suffix == ".py"]
    missing = [
        f"{path.relative_to(ROOT)}:{number}: {name}"
        for path in code
        for number, line in _lines(path)
        for name in PYTHON_FILE.findall(line)
        if name not in ours and name not in OTHER_PROJECTS_FILES
    ]
    assert missing == [], "no such file in the checkout (name it by its path, module_utils/...):\n" + "\n".join(missing)


def _shown_names(docstring: str, prefix: str) -> set:
    return set(re.findall(rf"\b{re.escape(prefix)}\.(\w+)", docstring))


def test_the_package_docstring_shows_only_public_names():
    shown = _shown_names(slurm_multi.__doc__, "slurm_multi")
    assert {"job_spec", "run", "submit"} <= shown, shown
    assert shown - set(slurm_multi.__all__) == set(), f"slurm_multi's docstring shows names not in its __all__: {shown}"


def test_the_docs_call_only_public_names_of_the_package():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    called = {
        f"{page.relative_to(ROOT)}: slurm_multi.{name}"
        for page in pages
        for name in re.findall(r"\bslurm_multi\.(\w+)\(", page.read_text(encoding="utf-8"))
        if name not in slurm_multi.__all__
    }
    assert called == set(), f"not in slurm_multi.__all__: {sorted(called)}"
