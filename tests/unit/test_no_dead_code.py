"""Every public function and class of the package and of module_utils has a caller outside the tests.

A function that only tests call is a claim nobody relies on: it drifts from what the product does (the layered
config that group_vars promised and no stage read) while its tests keep passing. Helpers tests need live in
tests/support; a test of a behaviour goes through the function the product calls.
"""

import ast
import importlib.metadata
import re
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where the product's callers are: its code, its Ansible content and its benchmarks (never tests/).
CALLER_DIRS = (
    "slurm_multi",
    "module_utils",
    "library",
    "plugins",
    "roles",
    "playbooks",
    "inventory",
    "group_vars",
    "benchmarks",
)
CALLER_SUFFIXES = (".py", ".yml", ".yaml", ".j2", ".cfg")


def _code_names(path: Path):
    """The names a Python file uses in code (not in its docstrings or comments); every word of any other file."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        yield from re.findall(r"\w+", text)
        return
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, ast.alias):
            yield node.name.split(".")[-1]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            yield node.value  # a name looked up by string: a filter's table, the package's lazy exports


def _caller_names():
    for folder in CALLER_DIRS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in CALLER_SUFFIXES and "molecule" not in path.parts:
                yield from _code_names(path)
    yield from _code_names(ROOT / "Makefile")


def _public_definitions():
    for folder in ("slurm_multi", "module_utils"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith(
                    "_"
                ):
                    yield str(path.relative_to(ROOT)), node.name


def test_every_public_function_has_a_caller_outside_the_tests():
    words = Counter(_caller_names())
    uncalled = [
        f"{where}: {name}" for where, name in _public_definitions() if words[name] <= 1
    ]  # its own `def` line only
    assert not uncalled, "called by tests only (remove it, make it private, or move it to tests/support): " + ", ".join(
        uncalled
    )


# Dependencies the product runs as a program, not imports: distribution -> its program.
EXECUTABLE_DEPENDENCIES = {"py-spy": "py-spy"}


def _product_sources():
    for folder in ("slurm_multi", "module_utils", "library", "plugins"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def _imported_top_level_names():
    for path in _product_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                yield from (alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                yield node.module.split(".")[0]


def test_every_declared_dependency_is_imported_by_the_product():
    # A dependency nobody imports is installed on every controller for nothing (it was the docker SDK: the node
    # side drives the docker CLI with the standard library, and the controller drives no Docker at all).
    distributions = importlib.metadata.packages_distributions()
    imported = {
        re.sub(r"[-_.]+", "-", dist).lower()
        for name in set(_imported_top_level_names())
        for dist in distributions.get(name, [])
    }
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", spec).group()).lower() for spec in declared}
    assert names - imported - set(EXECUTABLE_DEPENDENCIES) == set(), "declared in pyproject.toml but imported nowhere"


def test_every_dependency_used_as_a_program_is_run_by_the_product():
    sources = "\n".join(path.read_text() for path in _product_sources())
    for distribution, program in EXECUTABLE_DEPENDENCIES.items():
        assert f'"{program}"' in sources, f"{distribution} is declared for its {program} program, which nothing runs"


def test_every_path_the_readme_names_is_in_the_repository():
    # The README is read on a fresh checkout: a path beside or above it (`../shared/...`) is not there.
    readme = (ROOT / "README.md").read_text()
    assert "../" not in readme
    top_level = {path.name for path in ROOT.iterdir()} - {".venv"}  # made by the install, not in the repository
    named = {
        token
        for token in re.findall(r"[`\s(]((?:\./)?[\w.-]+/[\w./*-]*)", readme)
        if token.removeprefix("./").split("/")[0] in top_level
    }
    assert named and not [path for path in sorted(named) if not (ROOT / path).exists()]
