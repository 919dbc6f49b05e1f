"""The slurm_multi package's import graph has no cycle, function-local imports included (a cycle forces imports into
functions, and the order modules load in then decides what works)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slurm_multi"


def _imports(path: Path, modules: set) -> set:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "slurm_multi":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slurm_multi."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("slurm_multi.")}
    return found & modules


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


def test_the_package_has_no_import_cycle():
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    graph = {path.stem: _imports(path, modules) - {path.stem} for path in PACKAGE.glob("*.py")}
    assert import_cycle(graph) == []
