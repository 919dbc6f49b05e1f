"""The layering of the code, read from its imports, function-local imports included.

* Node-side code (module_utils/, library/) never imports the slurm_multi package: it runs on the nodes, shipped by
  AnsiballZ, where the package is not installed.
* Neither the package nor module_utils has an import cycle (a cycle forces imports into functions, and the order
  modules load in then decides what works).
"""

import ast
import subprocess
import tomllib
from pathlib import Path

import yaml

from slurm_multi import __version__

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "slurm_multi"
MODULE_UTILS = ROOT / "module_utils"
NODE_SIDE = ("module_utils", "library")
SOURCE_FOLDERS = ("module_utils", "library", "plugins", "slurm_multi")


def _dotted(path: Path, top: Path) -> str:
    parts = path.relative_to(top).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path):
    """Every module name `path` imports, with each `from X import y` also as X.y (y may be a module)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def import_graph(top: Path, prefix: str) -> dict:
    """{module: the modules of `top` it imports}, the modules named as imported under `prefix` (dotted, from `top`)."""
    files = {_dotted(path, top): path for path in top.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        names = (name[len(prefix) :] for name in _imported_names(path) if name.startswith(prefix))
        graph[module] = {name for name in names if name in files and name != module and name != ""}
    return graph


def import_cycle(graph: dict) -> list:
    """One cycle of `graph` (module -> the modules it imports) as [a, b, ..., a], or [] when there is none."""
    state = {}

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported) :] + [imported]
            if imported not in state:
                cycle = visit(imported, path + [imported])
                if cycle:
                    return cycle
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_function_local_and_from_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from top.pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("import top.c\n")
    (tmp_path / "c.py").write_text("from top.pkg.a import f\n")
    assert import_graph(tmp_path, "top.") == {
        "pkg": set(),
        "pkg.a": {"pkg", "pkg.b"},
        "pkg.b": {"c"},
        "c": {"pkg.a"},
    }
    assert import_cycle(import_graph(tmp_path, "top.")) == ["c", "pkg.a", "pkg.b", "c"]


def test_the_package_has_no_import_cycle():
    assert import_cycle(import_graph(PACKAGE, "slurm_multi.")) == []


def test_module_utils_has_no_import_cycle():
    graph = import_graph(MODULE_UTILS, "ansible_collections.slurm_multi.pipeline.plugins.module_utils.")
    assert len(graph) > 50 and import_cycle(graph) == []


def test_module_utils_are_imported_by_their_collection_name_only():
    # One name for modules, plugins, the package and tests (docs/contracts.md, "Imports"): an import of a project
    # module under Ansible's own package would work nowhere, since nothing puts module_utils/ there any more.
    ours = {path.stem if path.suffix else path.name for path in MODULE_UTILS.iterdir() if not path.name.startswith("_")}
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for folder in (*SOURCE_FOLDERS, "tests", "benchmarks")
        for path in (ROOT / folder).rglob("*.py")
        for name in _imported_names(path)
        if name.startswith("ansible.module_utils.") and name.split(".")[2] in ours
    ]
    assert offenders == []


def test_no_node_side_file_imports_the_package():
    offenders = [
        str(path.relative_to(ROOT))
        for folder in NODE_SIDE
        for path in (ROOT / folder).rglob("*.py")
        if any(name == "slurm_multi" or name.startswith("slurm_multi.") for name in _imported_names(path))
    ]
    assert offenders == []


def test_every_folder_of_python_files_is_a_package():
    # A subpackage without __init__.py ships without it: AnsiballZ then cannot find the module_utils a module
    # imports ("Could not find imported module support code ...
    # ansible_collections.slurm_multi.pipeline.plugins.module_utils.results").
    missing = sorted(
        str(folder.relative_to(ROOT))
        for top in (MODULE_UTILS, PACKAGE)
        for folder in {path.parent for path in top.rglob("*.py")}
        if not (folder / "__init__.py").is_file() and folder != MODULE_UTILS
    )
    assert missing == []


def test_git_ignores_no_source_file():
    # .gitignore's `results/` once hid module_utils/results/__init__.py: present here, missing from every clone.
    listed = subprocess.run(
        ["git", "ls-files", "--others", "--ignored", "--exclude-standard", *SOURCE_FOLDERS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [name for name in listed if name.endswith(".py")] == []


def test_the_module_utils_collection_has_the_packages_version():
    # ansible-doc warns about a collection without one; its version is not a second fact to keep in step by hand.
    galaxy = yaml.safe_load((ROOT / "collections/ansible_collections/slurm_multi/pipeline/galaxy.yml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (galaxy["namespace"], galaxy["name"]) == ("slurm_multi", "pipeline")
    assert galaxy["version"] == project["version"] == __version__
